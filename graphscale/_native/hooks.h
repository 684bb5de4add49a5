// hooks.h: what a governed backward puts on the graph and takes back: its
// edge multipliers, rows of each node's one ScaleHook read by its own graph
// task (task_keys), and the undo of everything (Undo).  Python twins:
// graphscale/_routes/hooks.py post_hook and the finally of
// graphscale/_routes/python.py _Backward.run.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// NOTE [ Multipliers per graph task ]
// A hook on a node applies to every graph task that runs the node, and a
// node's hook lists are plain std::vectors that torch's engine iterates with
// no lock and no GIL, on every thread that runs the node.  So a backward does
// not add and remove its edge multipliers: each hooked node carries one
// ScaleHook for good (added the first time a plan hooks the node, found
// again after), and a backward adds its row (its multipliers, under its key)
// to that hook and takes the row out when it ends.  The row is read only by
// the backward's own graph task: the binding node in front of its roots
// (bind.h) records graph task id -> key when the task starts (task_keys),
// and the hook looks the running task up.  Another backward over the same
// node, on another thread (retain_graph, one graph), a torch.autograd.grad,
// or a backward after remove(), finds no row of its own and passes the
// gradients on unchanged; nothing any other thread iterates moves, except
// the first time a node gets its hook (as with any register_hook on a node a
// backward is running: docs/contract.md, "Threads").  No backward waits for
// another: graphscale holds no lock around any backward.  Python twin: the
// Python route's node hooks (graphscale/_routes/hooks.py post_hook, which
// check the task's binding), on torch's one hook dict per node.

// The edge multipliers of one backward on one node: grad_inputs[k] (flowing
// along next_edges[k]) times m, timed into `ns`.
struct ScaleRow {
  uint64_t key = 0;
  std::vector<std::pair<int64_t, double>> mults;
  std::shared_ptr<std::atomic<int64_t>> ns;
};

// A node's one multiplier hook: the rows of the backwards that hook it now,
// each applied in its own graph task only.  What graphscale/_routes/hooks.py
// post_hook does.
class ScaleHook : public torch::autograd::FunctionPostHook {
 public:
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    const auto t0 = Clock_::now();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (rows_.empty()) return outputs;
    }
    const Keys keys = keys_of_task(torch::autograd::get_current_graph_task_id());
    if (keys.empty()) return outputs;
    std::vector<std::shared_ptr<const ScaleRow>> mine;  // in the order they were added (outer first)
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& r : rows_)
        if (std::find(keys.begin(), keys.end(), r->key) != keys.end()) mine.push_back(r);
    }
    if (mine.empty()) return outputs;
    torch::autograd::variable_list out(outputs);
    for (const auto& row : mine) {
      GS_SEAM(++scale_calls;
              if (inject_failure_in.load(std::memory_order_relaxed) > 0 && inject_failure_in.fetch_sub(1) == 1)
                  throw std::runtime_error("graphscale: a hook failure injected by a test");)
      for (const auto& km : row->mults) {
        const size_t k = static_cast<size_t>(km.first);
        if (k < out.size() && out[k].defined()) out[k] = out[k].mul(km.second);
      }
    }
    mine.front()->ns->fetch_add(ns_since(t0), std::memory_order_relaxed);
    return out;
  }

  void add(std::shared_ptr<const ScaleRow> row) {
    GS_SEAM(++scale_made; ++scale_live;)
    std::lock_guard<std::mutex> lock(mu_);
    rows_.push_back(std::move(row));
  }
  void remove(uint64_t key) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = rows_.size(); i-- > 0;)
      if (rows_[i]->key == key) {
        rows_.erase(rows_.begin() + static_cast<std::ptrdiff_t>(i));
        GS_SEAM(--scale_live;)
      }
  }

  // `node`'s hook, added the first time (with the GIL held: only graphscale
  // adds one, and it adds under the GIL).
  static ScaleHook* of(Node* node) {
    for (const auto& h : node->post_hooks())
      if (auto* s = dynamic_cast<ScaleHook*>(h.get())) return s;
    GS_SEAM(++scale_hooks;)
    auto hook = std::make_unique<ScaleHook>();
    ScaleHook* raw = hook.get();
    node->add_post_hook(std::move(hook));
    return raw;
  }

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<const ScaleRow>> rows_;
};

static bool overridable(py::handle roots);  // engine.h

// Everything one governed backward added, taken back when it goes out of
// scope (normal return or exception); runs with the GIL held.
struct Undo {
  std::vector<ScaleHook*> rows;  // the hooks this backward added a row to (under `key`)
  std::vector<NodePtr> keep;  // the nodes hooked, alive (with their hooks) until the rows are out
  uint64_t key = 0;  // this backward's rows and task (NOTE [ Multipliers per graph task ]); 0: none
  std::shared_ptr<BindState> bind;
  uint64_t token = 0;  // the registry entry (0: none)
  std::shared_ptr<std::atomic<int64_t>> hook_ns = std::make_shared<std::atomic<int64_t>>(0);
  int64_t* off_ns = nullptr;

  Undo() = default;
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  ~Undo() {
    const auto t0 = Clock_::now();
    for (ScaleHook* h : rows) h->remove(key);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);  // a pending Python error survives the clean-up
    if (token != 0) pop_running(token);
    if (bind) {
      std::vector<int> tasks, keyed;
      {
        std::lock_guard<std::mutex> lock(bind->mu);
        tasks.swap(bind->tasks);
        keyed.swap(bind->keyed);
      }
      forget_tasks(keyed);
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

  // Where torch's backward asks a __torch_function__ override (a mode is on),
  // the roots handed to it must stay tensors, or the override is not asked
  // (torch asks only for tensor roots): views of the roots, each a node of
  // this backward's own whose pre-hook binds the task.  None where a root is
  // not a plain strided tensor (the binding node then; the override is not asked).
  py::object bind_views(const py::tuple& roots) {
    for (size_t r = 0; r < roots.size(); ++r) {
      PyObject* t = roots[r].ptr();
      if (!THPVariable_Check(t) ||
          (!THPVariable_CheckExact(t) && Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(registry->param_type.ptr())))
        return py::none();
      const auto& var = THPVariable_Unpack(t);
      if (var.layout() != at::kStrided || var.is_nested() || !var.requires_grad()) return py::none();
    }
    at::AutoGradMode grad_on(true);
    py::tuple out(roots.size());
    for (size_t r = 0; r < roots.size(); ++r) {
      const auto& var = THPVariable_Unpack(roots[r].ptr());
      at::Tensor view = var.view_as(var);
      view.grad_fn()->add_pre_hook(std::make_unique<BindPreHook>(bind));
      out[r] = py::reinterpret_steal<py::object>(THPVariable_Wrap(view));
    }
    return std::move(out);
  }

  // This backward's rows: `mults` on `node` under a key of its own.
  void add_row(Node* node, const std::vector<std::pair<int64_t, double>>& mults) {
    if (key == 0) key = next_key.fetch_add(1, std::memory_order_relaxed);
    auto row = std::make_shared<ScaleRow>();
    row->key = key;
    row->mults = mults;
    row->ns = hook_ns;
    keep.push_back(node->getptr());
    ScaleHook* hook = ScaleHook::of(node);
    hook->add(std::move(row));
    rows.push_back(hook);
  }

  // Bind the graph task of a backward of `roots` to `binding`: the roots to
  // hand torch instead, GradientEdges to a BindNode of this backward's own
  // (NOTE [ Binding without touching a shared node ]).  `roots`: tensors
  // that need a gradient, or GradientEdges.
  // `binding` None: the task is only keyed (its rows and the rows of the
  // tasks it runs inside read: NOTE [ Multipliers per graph task ]).
  // `inherited`: the keys of the task it runs inside, if the caller read them already.
  py::tuple bind_roots(const py::tuple& roots, py::object binding, const Keys* inherited = nullptr) {
    GS_SEAM(if (!may_bind.load()) binding = py::none();)  // (the test seam unbinds; the rows' keys stay)
    PyObject* edge_type = registry->edge_type.ptr();  // torch.autograd.graph.GradientEdge (configure)
    bind = std::make_shared<BindState>();
    if (key != 0) bind->keys.push_back(key);
    const Keys outer = inherited != nullptr ? Keys() : keys_of_task(torch::autograd::get_current_graph_task_id());
    for (uint64_t k : inherited != nullptr ? *inherited : outer) bind->keys.push_back(k);
    if (binding.is_none() && bind->keys.empty()) {
      bind.reset();
      return roots;
    }
    if (!binding.is_none()) bind->binding = binding.release().ptr();
    if (overridable(roots)) {
      py::object views = bind_views(roots);
      if (!views.is_none()) return views;
    }
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
