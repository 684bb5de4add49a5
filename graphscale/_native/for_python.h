// for_python.h: what the Python route and the tools ask of the native
// module beside the governed backward: a nested plan through the one lookup,
// a graph task's binding, a plan's registration.  Python twin:
// graphscale/_backward/python_backend.py PythonBackend (nested_plan, bound,
// running_plan) and graphscale/_backward/decide.py plan_nested.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// The Python route's nested plan (graphscale/_backward/decide.py
// plan_nested), through the one lookup: (reading, NativePlan), None where
// nothing governs it, or "python" where a running Python plan walked
// `current` (the Python route looks it up itself).
static py::object nested_plan(py::handle current, const py::tuple& roots) {
  const Enclosing e = find_enclosing(node_of(current.ptr()));
  if (e.kind == Enclosing::kNone) return py::none();
  if (e.kind == Enclosing::kPython) return py::str("python");
  Roots call;
  if (!root_nodes_of(roots, &call.nodes, &call.leaf_roots)) return py::str("python");
  py::object gov_obj;
  NativePlan P = plan_core(roots, call.nodes, nested_request(e, &gov_obj));
  P.leaf_roots = std::move(call.leaf_roots);
  P.governor = gov_obj;
  return py::make_tuple(e.reading, py::cast(std::make_shared<NativePlan>(std::move(P))));
}

// A graph task's binding for the Python route and the tools
// (graphscale/_backward/running.py bound): `binding` on a BindNode in front
// of the roots, as govern_top binds, until __exit__; __enter__ gives the
// roots to hand torch (GradientEdges to that node).
struct Bound {
  py::tuple roots;
  std::unique_ptr<Undo> undo;
};

// `key`: the Python route's multiplier rows (new_key; 0: none).
static Bound make_bound(const py::tuple& roots, py::object binding, uint64_t key) {
  Bound b;
  b.roots = roots;
  Roots call;
  if (!root_nodes_of(roots, &call.nodes, &call.leaf_roots))
    throw std::invalid_argument("graphscale: bound() got a root that is neither a tensor nor an edge");
  b.undo = std::make_unique<Undo>();
  b.undo->key = key;
  for (Node* n : call.nodes)
    if (n == nullptr) throw std::invalid_argument("graphscale: bound() got a root that needs no gradient");
  b.roots = b.undo->bind_roots(roots, std::move(binding));
  return b;
}

// The Python route's registration of a plan for nested backwards: a
// context manager whose exit takes the entry out (running.py's running_plan).
struct RunningPlan {
  uint64_t token = 0;
};
