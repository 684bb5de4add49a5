// python_planner.h: the planner (planner/, no Python in it) seen from
// Python: the C++ Node behind a grad_fn and back, the answers the planner
// asks for (ParameterTest, CheckpointHint, EnclosingPotentials, from the
// Python objects a caller hands over), NativePlan (a Plan that keeps its
// roots alive and answers Python), and the module's plan() and probe().
// Python twin: graphscale/_backward/native_backend.py NativeBackend (plan,
// probe) and the PyPlan of graphscale/_planner/plan.py.
// Included once, in order, by walker.cpp (one translation unit), first.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <unordered_map>
#include <vector>

#include "planner/planner.h"
#include "planner/probe.h"

namespace py = pybind11;
namespace planner = graphscale::planner;

// What the Python-facing headers after this one use of the planner.
using planner::AccumulateGrad;
using planner::kAny;
using planner::kPlain;
using planner::kPlainParams;
using planner::Node;
using planner::NodePtr;
using planner::Owners;
using planner::probe_nodes;
using planner::raw;

namespace {

// The C++ Node behind a Python grad_fn object (borrowed), or nullptr.
Node* node_of(PyObject* obj) {
  if (obj == Py_None) return nullptr;
  if (torch::autograd::THPCppFunction_Check(obj))
    return raw(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata);
  if (THPFunction_Check(obj)) return raw(reinterpret_cast<THPFunction*>(obj)->cdata);
  throw py::type_error("graphscale: native walker got a root that is not an autograd Node");
}

py::object py_of(Node* n) {
  auto ptr = n->getptr();
  return py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(ptr));
}

// Is `var` an nn.Parameter, as isinstance(var, nn.Parameter) says?
// Parameter's metaclass answers isinstance in Python (also True for a tensor
// flagged _is_param); the C type check first spares that call for real
// Parameters, the flag is read for the others.
bool is_parameter(const at::Tensor& var, py::handle param_type) {
  PyObject* obj = THPVariable_Wrap(var);
  if (obj == nullptr) throw py::error_already_set();
  bool isparam = PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(param_type.ptr()));
  if (!isparam) {
    // The flag lives in the instance dict (Parameter's metaclass reads it so);
    // read there, no AttributeError is raised and cleared for a plain tensor.
    static PyObject* key = PyUnicode_InternFromString("_is_param");  // not a new string per call
    PyObject** dictptr = _PyObject_GetDictPtr(obj);
    PyObject* flag = (dictptr != nullptr && *dictptr != nullptr) ? PyDict_GetItemWithError(*dictptr, key) : nullptr;
    if (flag != nullptr) isparam = PyObject_IsTrue(flag) == 1;
    PyErr_Clear();
  }
  Py_DECREF(obj);
  return isparam;
}

}  // namespace

// The planner's question about unowned leaves, answered with torch.nn.Parameter.
class PyParameterTest : public planner::ParameterTest {
 public:
  explicit PyParameterTest(py::handle param_type) : type_(param_type) {}
  bool is_parameter(const at::Tensor& leaf) const override { return ::is_parameter(leaf, type_); }

 private:
  py::handle type_;
};

// NOTE [ Checkpoint hints ] (graphscale/_backward/hints.py) on the native route: the
// position a custom-Function node's run_function hints, kept per snapshot
// (in its Governor) for run_functions that are nn.Modules, which it holds
// (so an address is never reused while cached); other run_functions ask the
// Python hint every time.  A stale entry costs multiplications, never
// correctness, as in Python.  Used and dropped with the GIL held.
struct HintCache {
  std::unordered_map<PyObject*, int64_t> by_fn;
  HintCache() = default;
  HintCache(const HintCache&) = delete;
  HintCache& operator=(const HintCache&) = delete;
  ~HintCache() {
    for (auto& kv : by_fn) Py_DECREF(kv.first);
  }
};
static PyObject* module_type = nullptr;  // torch.nn.Module (native.configure)

// The checkpoint hint, a Python callable: node -> a pin (or group position
// where `positions`) or None; with a HintCache, asked once per nn.Module
// run_function.
class PyHint : public planner::CheckpointHint {
 public:
  PyHint(py::handle fn, bool positions, HintCache* cache) : fn_(fn), positions_(positions), cache_(cache) {}

  planner::Hinted at(Node* node) override {
    using planner::Hinted;
    if (cache_ != nullptr) {
      const int64_t pos = cached(node);
      return pos < 0 ? Hinted{} : Hinted{Hinted::kGroup, pos, 0.0};
    }
    py::object h = fn_(py_of(node));
    if (h.is_none()) return Hinted{};
    return positions_ ? Hinted{Hinted::kGroup, h.cast<int64_t>(), 0.0} : Hinted{Hinted::kPin, -1, h.cast<double>()};
  }

 private:
  // The group position the hint gives custom-Function node `node`, or -1 (HintCache).
  int64_t cached(Node* node) {
    static PyObject* name = PyUnicode_InternFromString("run_function");
    py::object ctx = py_of(node);
    PyObject* fn = PyObject_GetAttr(ctx.ptr(), name);
    if (fn == nullptr) PyErr_Clear();
    const bool cacheable = fn != nullptr && module_type != nullptr &&
                           PyObject_TypeCheck(fn, reinterpret_cast<PyTypeObject*>(module_type));
    if (cacheable) {
      auto it = cache_->by_fn.find(fn);
      if (it != cache_->by_fn.end()) {
        Py_DECREF(fn);
        return it->second;
      }
    }
    py::object v = fn_(ctx);
    const int64_t pos = v.is_none() ? -1 : v.cast<int64_t>();
    if (cacheable) {
      cache_->by_fn.emplace(fn, pos);  // keeps the reference GetAttr gave
    } else {
      Py_XDECREF(fn);
    }
    return pos;
  }

  py::handle fn_;
  bool positions_;
  HintCache* cache_;
};

// The potentials of an enclosing Python plan, a Python callable: node -> potential or None.
class PyEnclosing : public planner::EnclosingPotentials {
 public:
  explicit PyEnclosing(py::handle fn) : fn_(fn) {}
  bool phi_of(Node* node, double* out) const override {
    py::object seen = fn_(py_of(node));
    if (seen.is_none()) return false;
    *out = seen.cast<double>();
    return true;
  }

 private:
  py::handle fn_;
};

// A Plan as Python holds it: what keeps its nodes alive, what a backward
// nested inside it is asked with (the owners object, the checkpoint hint,
// the Governor), and what the Python route reads of it.
struct NativePlan : planner::Plan {
  // The roots' Python objects keep every walked node alive (so addresses stay
  // unique).  Not C++ NodePtrs: if the last owner of a deep graph were a
  // plain NodePtr, freeing it would recurse down the chain; torch frees
  // graphs owned by Python objects and tensors iteratively.
  py::object roots;
  // AccumulateGrad nodes of leaf roots given as tensors (nested_plan): the
  // tensor holds them only weakly.  They have no next edges, so holding them
  // here cannot make a free recurse.
  std::vector<NodePtr> leaf_roots;
  py::object owners;  // the Owners object (owners_ptr is its C++ side)
  py::object hint;
  bool hint_positions = false;
  HintCache* hint_cache = nullptr;  // the governor's (alive while `governor` is)
  py::object governor = py::none();  // the Governor of a natively governed backward (None: planned for Python)

  py::list groups_reached() const {
    py::list out;
    for (size_t g = 0; g < reached.size(); ++g)
      if (reached[g]) out.append(static_cast<int64_t>(g));
    return out;
  }

  py::list unowned_parameters() const {
    py::list out;
    for (int64_t o : unowned_param_pos)
      out.append(py::reinterpret_steal<py::object>(
          THPVariable_Wrap(static_cast<AccumulateGrad*>(found[o])->variable)));
    return out;
  }

  py::object phi_of(py::handle obj) const {
    Node* n = node_of(obj.ptr());
    if (n == nullptr) return py::none();
    int64_t i = index.get(n);
    if (i < 0) return py::none();
    return py::float_(phi_disc[i]);
  }

  py::list hooks() const {
    py::list out;
    for (size_t h = 0; h < hook_nodes.size(); ++h) {
      py::object node = py_of(found[hook_nodes[h]]);
      py::tuple mults(hook_mults[h].size());
      for (size_t k = 0; k < hook_mults[h].size(); ++k)
        mults[k] = py::make_tuple(hook_mults[h][k].first, hook_mults[h][k].second);
      out.append(py::make_tuple(node, mults));
    }
    return out;
  }
};
using PlanPtr = std::shared_ptr<NativePlan>;  // how a plan is held (RunningEntry, Apply, Python)

// A planner Request with the Python objects that answer its questions:
// graphscale/_planner/request.py PlanRequest as the Python-facing headers fill it.
struct Request : planner::Request {
  py::object owners_obj;                   // the Owners of the installed state (owners is its C++ side)
  py::handle param_type;                   // torch.nn.Parameter
  py::object outer_phi = py::none();       // None, or a callable: node -> potential or None (outer_plans first)
  py::object hint = py::none();            // None, or a callable: custom Function node -> pin or None
  bool hint_positions = false;             // the hint answers a group position (or None), not a pin
  HintCache* hint_cache = nullptr;         // with hint_positions: answers kept per run_function module
};

// Plan `root_nodes` for `req` (planner::plan, answered from req's Python objects).
static NativePlan plan_core(py::object roots, const std::vector<Node*>& root_nodes, const Request& req) {
  const PyParameterTest parameters(req.param_type);
  PyHint hint(req.hint, req.hint_positions, req.hint_cache);
  const PyEnclosing enclosing(req.outer_phi);
  planner::Answers answers;
  answers.parameters = &parameters;
  answers.hint = req.hint.is_none() ? nullptr : &hint;
  answers.enclosing = req.outer_phi.is_none() ? nullptr : &enclosing;
  NativePlan P;
  P.roots = std::move(roots);
  P.owners = req.owners_obj;
  P.hint = req.hint;
  P.hint_positions = req.hint_positions;
  P.hint_cache = req.hint_cache;
  planner::plan(root_nodes, req, answers, &P);
  return P;
}

// The plan of graphscale/_planner/plan.py build (_backward/native_backend.py NativeBackend.plan builds
// this call).  roots: Python Nodes or None.  outer_phi: None, a callable
// (node -> potential or None), or a list of the enclosing NativePlans,
// innermost last.
static NativePlan plan(const py::list& roots, py::object owners, const std::vector<double>& factors,
                       double base, py::object carrier, int policy, py::object param_type,
                       const py::list& extra_nodes, const std::vector<double>& extra_values,
                       py::object outer_phi, py::object hint) {
  if (extra_nodes.size() != extra_values.size()) throw planner::BadInput("extra pins sizes differ");
  Request req;
  req.owners_obj = owners;
  req.owners = &owners.cast<const Owners&>();
  req.factors = factors;
  req.base = base;
  req.nested = !carrier.is_none();
  req.carrier = req.nested ? carrier.cast<double>() : 0.0;
  if (policy < kAny || policy > kPlain) throw planner::BadInput("unknown unowned policy");
  req.policy = policy;
  req.param_type = param_type;
  for (size_t k = 0; k < extra_nodes.size(); ++k) req.extra_nodes.push_back(node_of(extra_nodes[k].ptr()));
  req.extra_values = extra_values;
  req.hint = hint;
  std::vector<const planner::Plan*> outer_plans;
  if (py::isinstance<py::list>(outer_phi)) {
    py::list lst = outer_phi.cast<py::list>();
    for (size_t k = lst.size(); k-- > 0;) outer_plans.push_back(lst[k].cast<const NativePlan*>());
    req.outer_plans = &outer_plans;
  } else {
    req.outer_phi = outer_phi;
  }
  std::vector<Node*> root_nodes(roots.size(), nullptr);
  for (size_t r = 0; r < roots.size(); ++r) root_nodes[r] = node_of(roots[r].ptr());
  return plan_core(roots, root_nodes, req);
}

// Root nodes as graphscale/_planner/nodes.py root_node reads them: an edge's node,
// a tensor's grad_fn, a leaf's AccumulateGrad (kept alive in `leaf_roots`:
// the tensor holds it only weakly), or none.  False when a root is neither a
// tensor nor an edge.
static bool root_nodes_of(const py::tuple& roots, std::vector<Node*>* nodes,
                          std::vector<NodePtr>* leaf_roots) {
  nodes->assign(roots.size(), nullptr);
  for (size_t r = 0; r < roots.size(); ++r) {
    PyObject* obj = roots[r].ptr();
    if (THPVariable_Check(obj)) {
      const auto& var = THPVariable_Unpack(obj);
      if (auto fn = var.grad_fn()) {
        (*nodes)[r] = fn.get();
      } else if (var.requires_grad()) {
        auto acc = torch::autograd::impl::grad_accumulator(var);
        (*nodes)[r] = acc.get();
        leaf_roots->push_back(std::move(acc));
      }
    } else if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) >= 1) {  // GradientEdge(node, output_nr)
      (*nodes)[r] = node_of(PyTuple_GET_ITEM(obj, 0));
    } else {
      return false;
    }
  }
  return true;
}

// The probe of graphscale/_backward/decide.py probe (planner/probe.h probe_nodes).
static int probe(const py::tuple& roots, py::object owners_obj, int policy, py::handle param_type) {
  const Owners& owners = owners_obj.cast<const Owners&>();
  std::vector<Node*> root_nodes;
  std::vector<NodePtr> leaf_roots;
  if (!root_nodes_of(roots, &root_nodes, &leaf_roots)) throw py::type_error("graphscale: probe got a root that is neither a tensor nor an edge");
  return probe_nodes(root_nodes, owners, policy, PyParameterTest(param_type));
}
