// hooks.h: what a governed backward puts on the graph and takes back: the
// edge multiplier (ScaleHook), the lock that lets it hook shared nodes
// (Hold), and the undo of everything (Undo).  Python twins:
// graphscale/_routes/hooks.py post_hook, graphscale/_backward/sharing.py,
// and the finally of graphscale/_routes/python.py _Backward.run.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// One edge multiplier row on one node: grad_inputs[k] (flowing along
// next_edges[k]) times m.  What graphscale/_routes/hooks.py post_hook does.
class ScaleHook : public torch::autograd::FunctionPostHook {
 public:
  ScaleHook(std::vector<std::pair<int64_t, double>> mults, std::shared_ptr<std::atomic<int64_t>> ns)
      : mults_(std::move(mults)), ns_(std::move(ns)) {
    GS_SEAM(++scale_made; ++scale_live;)
  }
  ~ScaleHook() override { GS_SEAM(--scale_live;) }
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    const auto t0 = Clock_::now();
    GS_SEAM(++scale_calls;
            if (inject_failure_in.load(std::memory_order_relaxed) > 0 && inject_failure_in.fetch_sub(1) == 1)
                throw std::runtime_error("graphscale: a hook failure injected by a test");)
    torch::autograd::variable_list out(outputs);
    for (const auto& km : mults_) {
      const size_t k = static_cast<size_t>(km.first);
      if (k < out.size() && out[k].defined()) out[k] = out[k].mul(km.second);
    }
    ns_->fetch_add(ns_since(t0), std::memory_order_relaxed);
    return out;
  }

 private:
  std::vector<std::pair<int64_t, double>> mults_;
  std::shared_ptr<std::atomic<int64_t>> ns_;
};

// NOTE [ Hooks on shared nodes ]
// A node's hook lists are plain std::vectors that torch's engine iterates
// with no lock and no GIL, on every thread that runs the node, and a hook on
// a node applies to every graph task that runs it.  A backward whose plan
// puts edge multipliers on nodes (several factors among the leaves one graph
// reaches) adds them to those nodes' post-hooks and removes them after: were
// another backward running over the same nodes at that moment, on another
// thread (retain_graph, one graph), it would read the vector while it moves
// (SIGSEGV: 5 threads on one two-factor graph died within 40 rounds) and
// take those multipliers as its own (wrong gradients, on both routes).  So
// every top-level backward graphscale sees (governed, untouched, and every
// torch.autograd.grad while installed: graphscale/_backward/sharing.py)
// holds this process-wide lock while torch runs it: shared by a backward
// that changes no shared node, exclusive by one that hooks nodes.  Backwards
// over separate graphs, and every backward of a graph with one factor, run
// together as before; one that hooks runs alone.  A backward called from
// inside a running graph task (reentrant checkpointing's recompute) takes
// nothing: the backward it runs inside holds the lock for it, and waiting
// there could wait for itself.  The nodes such a nested backward hooks are
// those of the graph its node built, which no other backward reaches.  A
// waiting thread lets go of the GIL; an exclusive waiter stops new shared
// holders (a stream of overlapping backwards on other threads cannot starve
// it).  The Python route holds the same lock (hold() below) once this
// module is loaded, and a lock of its own before (sharing.py).
struct HookLock {
  std::mutex mu;
  std::condition_variable cv;
  int64_t shared = 0;
  int64_t waiting = 0;  // exclusive waiters
  bool exclusive = false;
};
HookLock hook_lock;

struct Hold {
  bool exclusive = false;
  bool held = false;

  explicit Hold(bool exclusive_) : exclusive(exclusive_) {}
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
  ~Hold() { leave(); }

  bool free_now() const {
    return !hook_lock.exclusive && (exclusive ? hook_lock.shared == 0 : hook_lock.waiting == 0);
  }
  void take() { exclusive ? (void)(hook_lock.exclusive = true) : (void)++hook_lock.shared; }

  // Call with the GIL held; returns with it held.
  void enter() {
    if (held || torch::autograd::get_current_graph_task_id() >= 0) return;
    {
      std::lock_guard<std::mutex> lock(hook_lock.mu);
      if (free_now()) {
        take();
        held = true;
        return;
      }
    }
    py::gil_scoped_release nogil;  // the holder may need it to finish
    std::unique_lock<std::mutex> lock(hook_lock.mu);
    if (exclusive) ++hook_lock.waiting;
    hook_lock.cv.wait(lock, [this] {
      return !hook_lock.exclusive && (exclusive ? hook_lock.shared == 0 : hook_lock.waiting == 0);
    });
    if (exclusive) --hook_lock.waiting;
    take();
    held = true;
  }
  void leave() {
    if (!held) return;
    held = false;
    {
      std::lock_guard<std::mutex> lock(hook_lock.mu);
      exclusive ? (void)(hook_lock.exclusive = false) : (void)--hook_lock.shared;
    }
    hook_lock.cv.notify_all();
  }
};

// Everything one governed backward added, taken back when it goes out of
// scope (normal return or exception); runs with the GIL held.
struct Undo {
  std::vector<std::pair<Node*, uintptr_t>> posts;
  std::vector<NodePtr> keep;  // the nodes hooked, alive until unhooked
  std::shared_ptr<BindState> bind;
  uint64_t token = 0;  // the registry entry (0: none)
  std::shared_ptr<std::atomic<int64_t>> hook_ns = std::make_shared<std::atomic<int64_t>>(0);
  int64_t* off_ns = nullptr;

  Undo() = default;
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  ~Undo() {
    const auto t0 = Clock_::now();
    for (auto& pk : posts) pk.first->del_post_hook(pk.second);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);  // a pending Python error survives the clean-up
    if (token != 0) pop_running(token);
    if (bind) {
      std::vector<int> tasks;
      {
        std::lock_guard<std::mutex> lock(bind->mu);
        tasks.swap(bind->tasks);
      }
      for (int tid : tasks) {
        PyObject* key = PyLong_FromLong(tid);
        if (key != nullptr && PyDict_DelItem(registry->by_task.ptr(), key) < 0) PyErr_Clear();
        Py_XDECREF(key);
      }
      Py_CLEAR(bind->binding);
    }
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    keep.clear();
    if (off_ns != nullptr) *off_ns = ns_since(t0);
  }

  // Bind the graph task of a backward of `roots` to `binding`: the roots to
  // hand torch instead, GradientEdges to a BindNode of this backward's own
  // (NOTE [ Binding without touching a shared node ]).  `roots`: tensors
  // that need a gradient, or GradientEdges.
  py::tuple bind_roots(const py::tuple& roots, py::object binding) {
    GS_SEAM(if (!may_bind.load()) return roots;)
    PyObject* edge_type = registry->edge_type.ptr();  // torch.autograd.graph.GradientEdge (configure)
    bind = std::make_shared<BindState>();
    bind->binding = binding.release().ptr();
    torch::autograd::edge_list edges;
    edges.reserve(roots.size());
    for (size_t r = 0; r < roots.size(); ++r) {
      PyObject* obj = roots[r].ptr();
      if (THPVariable_Check(obj)) {
        edges.push_back(torch::autograd::impl::gradient_edge(THPVariable_Unpack(obj)));
      } else {  // GradientEdge(node, output_nr)
        Node* n = node_of(PyTuple_GET_ITEM(obj, 0));
        edges.emplace_back(n->getptr(), py::handle(PyTuple_GET_ITEM(obj, 1)).cast<uint32_t>());
      }
    }
    NodePtr node = MakeNode<NodePtr>::template make<BindNode>(bind, std::move(edges));
    // Input metadata: the roots' own, so that the seeds torch checks and
    // makes (and the engine casts) are what they were without this node.
    for (size_t r = 0; r < roots.size(); ++r) {
      PyObject* obj = roots[r].ptr();
      if (THPVariable_Check(obj)) {
        node->add_input_metadata(THPVariable_Unpack(obj));
        continue;
      }
      // An edge's: copied whole (InputMetadata's fields differ between torch
      // releases; it has a copy constructor, not a copy assignment).
      const auto& e = node->next_edges()[r];
      const uint32_t nr = node->add_input_metadata(Node::undefined_input());
      torch::autograd::InputMetadata& slot = node->mutable_input_metadata(nr);
      slot.~InputMetadata();
      new (&slot) torch::autograd::InputMetadata(e.function->input_metadata(e.input_nr));
    }
    py::object pynode = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(node));
    if (!pynode) throw py::error_already_set();
    py::tuple out(roots.size());
    for (size_t r = 0; r < roots.size(); ++r) {
      // GradientEdge(pynode, r) as tuple.__new__(GradientEdge, (pynode, r)) makes it: what its
      // NamedTuple __new__ does, without that Python-level call.
      py::tuple fields = py::make_tuple(pynode, static_cast<Py_ssize_t>(r));
      py::tuple args = py::make_tuple(fields);
      PyObject* edge = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(edge_type), args.ptr(), nullptr);
      if (edge == nullptr) throw py::error_already_set();
      out[r] = py::reinterpret_steal<py::object>(edge);
    }
    return out;
  }
};
