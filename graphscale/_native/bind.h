// bind.h: binding a backward's graph task to its snapshot with a node of its
// own in front of the roots (BindNode).  Python twin: _PyBound in
// graphscale/_backward/python_backend.py.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// Graph task id -> the keys of the backwards whose multiplier rows its hooks
// read: its own backward's and those of the tasks it runs inside; the
// BindNode writes it.  (See NOTE [ Multipliers per graph task ] in hooks.h.)
using Keys = std::vector<uint64_t>;
struct TaskKeys {
  std::mutex mu;
  std::vector<std::pair<int, Keys>> of;
};
TaskKeys task_keys;
std::atomic<uint64_t> next_key{1};

static Keys keys_of_task(int tid) {
  if (tid < 0) return {};
  std::lock_guard<std::mutex> lock(task_keys.mu);
  for (const auto& tk : task_keys.of)
    if (tk.first == tid) return tk.second;
  return {};
}
static bool task_has_key(int tid, uint64_t key) {
  if (tid < 0) return false;
  std::lock_guard<std::mutex> lock(task_keys.mu);
  for (const auto& tk : task_keys.of)
    if (tk.first == tid) return std::find(tk.second.begin(), tk.second.end(), key) != tk.second.end();
  return false;
}
static void forget_tasks(const std::vector<int>& tids) {
  if (tids.empty()) return;
  std::lock_guard<std::mutex> lock(task_keys.mu);
  auto& of = task_keys.of;
  of.erase(std::remove_if(of.begin(), of.end(),
                          [&](const auto& tk) { return std::find(tids.begin(), tids.end(), tk.first) != tids.end(); }),
           of.end());
}

// What one backward's binding hooks share: the Binding, the tasks they bound.
struct BindState {
  PyObject* binding = nullptr;  // strong; released by Undo, with the GIL (null: the task is only keyed)
  Keys keys;                    // the task's keys: its backward's own, then inherited (hooks.h)
  std::mutex mu;
  std::vector<int> tasks;       // bound to `binding`
  std::vector<int> keyed;       // given `keys`
};

// NOTE [ Binding without touching a shared node ]
// A graph task is bound when it runs its first node.  This used to be a
// pre-hook put first in the root nodes' tensor_pre_hooks and erased after
// the backward.  Those lists are plain std::vectors that torch's engine
// iterates with no lock and no GIL (call_tensor_pre_hooks), and a root node
// is shared by every backward of the same graph: a backward on another
// thread (retain_graph, one graph, torch's TestMultithreadAutograd
// test_multi_grad_all_hooks) iterated the vector while this thread inserted
// or erased, and read a freed or moved-from hook (SIGSEGV in
// call_tensor_pre_hooks, 7 runs in 25 of that test; issue 38).  Now the
// binding is a node of its own, made for this one backward (BindNode): its
// next edges are the roots' edges, its input metadata theirs, and torch is
// handed GradientEdges to it in place of the roots.  It runs before every
// root node, so before any output hook, as the pre-hook did; no other
// backward can reach it, so nothing any other thread runs is changed.
// Freed with the roots handed to torch, once the backward is over.
// Records the running graph task's keys (task_keys) and graph task id ->
// Binding in graphscale._backward.running.bindings (running.py's Python hook
// does the same), once per task: what the binding node, or each root view's
// pre-hook, does first in the task.
static void record_task(BindState& st) {
  const int tid = torch::autograd::get_current_graph_task_id();
  if (tid < 0) return;
  if (!st.keys.empty()) {
    std::lock_guard<std::mutex> lock(st.mu);
    if (std::find(st.keyed.begin(), st.keyed.end(), tid) == st.keyed.end()) {
      st.keyed.push_back(tid);
      std::lock_guard<std::mutex> keys_lock(task_keys.mu);
      task_keys.of.emplace_back(tid, st.keys);
    }
  }
  if (st.binding == nullptr) return;
  py::gil_scoped_acquire gil;
  PyObject* key = PyLong_FromLong(tid);
  if (key != nullptr) {
    PyObject* dict = registry->by_task.ptr();
    if (PyDict_Contains(dict, key) == 0 && PyDict_SetItem(dict, key, st.binding) == 0) {
      std::lock_guard<std::mutex> lock(st.mu);
      st.tasks.push_back(tid);  // only what this binding put there is taken out again
    }
  }
  Py_XDECREF(key);
  PyErr_Clear();
}

// The pre-hook on a view of a root, a node of the backward's own: where
// torch must be handed tensors (below, Undo::bind_roots).
class BindPreHook : public torch::autograd::FunctionPreHook {
 public:
  explicit BindPreHook(std::shared_ptr<BindState> st) : st_(std::move(st)) { GS_SEAM(++bind_made; ++bind_live;) }
  ~BindPreHook() override { GS_SEAM(--bind_live;) }
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    record_task(*st_);
    return grads;
  }

 private:
  std::shared_ptr<BindState> st_;
};

namespace {
class BindNode : public Node {
 public:
  BindNode(std::shared_ptr<BindState> st, torch::autograd::edge_list&& next)
      : Node(std::move(next)), st_(std::move(st)) {
    GS_SEAM(++bind_made; ++bind_live;)
  }
  ~BindNode() override { GS_SEAM(--bind_live;) }
  std::string name() const override { return "GraphscaleBindBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    record_task(*st_);
    return std::move(grads);
  }

 private:
  std::shared_ptr<BindState> st_;
};

PyTypeObject bind_node_type{};  // its Python type (registered at import: GradientEdge needs a Python node)

template <typename P>
struct MakeNode;
template <typename T>
struct MakeNode<std::shared_ptr<T>> {
  template <typename N, typename... A>
  static std::shared_ptr<T> make(A&&... a) { return std::make_shared<N>(std::forward<A>(a)...); }
};
template <typename T>
struct MakeNode<c10::intrusive_ptr<T>> {
  template <typename N, typename... A>
  static c10::intrusive_ptr<T> make(A&&... a) { return c10::make_intrusive<N>(std::forward<A>(a)...); }
};
}  // namespace
