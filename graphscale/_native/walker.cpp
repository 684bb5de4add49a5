// walker.cpp: the native module's bindings.  Python twin:
// graphscale/_backward/native_backend.py NativeBackend (the interface) and
// graphscale/_native/__init__.py (loading).
//
// The planner (planner/) makes the plan of graphscale/_planner/plan.py build,
// done on the C++ autograd Nodes directly:
// breadth-first discovery over next_edges, Kahn's topological order, pins on
// AccumulateGrad leaves, bottom-up reachable pin values and votes, top-down
// potentials.  Every order and tie-break mirrors the Python reference, so the
// two give identical plans (tests/native/test_walker_build.py checks this).
// Iterative throughout: graphs have 1e5 nodes.  Then the governed backward
// itself (NOTE [ One native call per backward ] in registry.h).
//
// One translation unit: this file includes one header per concept, each
// naming its Python twin (docs/native-walker.md has the map).  The planner
// (planner/, no Python in it) comes in through python_planner.h, its Python
// face; the Python-facing headers after it include nothing themselves, so
// what they use beyond it is included here.  The build hashes all of them
// (graphscale/_native/build.py sources).
#include "python_planner.h"

#include <ATen/FuncTorchTLS.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <stdexcept>

#include "registry.h"
#include "bind.h"
#include "hooks.h"
#include "engine.h"
#include "govern.h"
#include "front.h"
#include "for_python.h"

// The planner's face (python_planner.h): what the Python route and the tests
// call directly.
static void def_planner(py::module_& m) {
  py::class_<Owners>(m, "Owners", py::module_local())
      .def(py::init<const std::vector<uintptr_t>&, const std::vector<int>&>());
  py::class_<NativePlan, PlanPtr>(m, "NativePlan", py::module_local())
      .def_readonly("seeds", &NativePlan::seeds)
      .def_readonly("num_nodes", &NativePlan::num_nodes)
      .def_readonly("multiplications", &NativePlan::multiplications)
      .def_readonly("base", &NativePlan::base)
      .def_readonly("owned_leaves", &NativePlan::owned_leaves)
      .def_readonly("custom_nodes", &NativePlan::custom_nodes)
      .def_readonly("tensor_hooks", &NativePlan::tensor_hooks)
      .def_readonly("phase_ns", &NativePlan::phase_ns)
      .def_property_readonly("unowned_params", [](const NativePlan& p) { return static_cast<int64_t>(p.unowned_param_pos.size()); })
      .def("groups_reached", &NativePlan::groups_reached)
      .def("unowned_parameters", &NativePlan::unowned_parameters)
      .def("hooks", &NativePlan::hooks)
      .def("phi_of", &NativePlan::phi_of);
  m.def("plan", &plan);
  m.def("probe", &probe);
}

// The running state's face (registry.h, bind.h, hooks.h, for_python.h).
static void def_running(py::module_& m) {
  // Its fields (reading, potential, once, on_failure, reference) are
  // in each instance's __dict__ (registry.h exposed).
  py::class_<Binding>(m, "Binding", py::module_local(), py::dynamic_attr());
  py::class_<RunningPlan>(m, "RunningPlan", py::module_local())
      .def("__enter__", [](RunningPlan& self) {})
      .def("__exit__", [](RunningPlan& self, py::args) {
        if (self.token != 0) pop_running(self.token);
        self.token = 0;
      });
  // running_plan(plan, reading, phi_of): phi_of None for a NativePlan, else the Python plan's phi_of.
  m.def("running_plan", [](py::object plan, py::object reading, py::object phi_of) {
    RunningPlan r;
    PlanPtr native = py::isinstance<NativePlan>(plan) ? plan.cast<PlanPtr>() : nullptr;
    if (native == nullptr && phi_of.is_none())
      throw std::invalid_argument("graphscale: running_plan() of a Python plan needs its phi_of");
    r.token = push_running(std::move(native), std::move(plan), std::move(reading),
                           native != nullptr ? py::object() : std::move(phi_of));
    return r;
  });
  m.def("configure", &configure);
  m.def("binding", [](py::object reading, py::object potential, py::object on_failure, py::object governor,
                      std::vector<double> factors) {
    return make_binding(std::move(reading), std::move(potential), std::move(on_failure), false,
                        std::move(governor), std::move(factors));
  });
  m.def("reference_binding", [](py::object reading) {
    return make_binding(std::move(reading), py::none(), py::list(), true, py::none(), {});
  });
  m.def("running", &running_entries);
  m.def("enclosing_phi", &enclosing_phi);
  m.def("nested_plan", &nested_plan);
  m.def("configure_front", &configure_front);
  m.def("set_front_open", &set_front_open);
  py::class_<Bound>(m, "Bound", py::module_local())
      .def("__enter__", [](Bound& self) { return self.roots; })
      .def("__exit__", [](Bound& self, py::args) {
        self.undo.reset();
        self.roots = py::tuple();  // the BindNode goes with the last reference to them
      });
  m.def("bound", &make_bound, py::arg("roots"), py::arg("binding"), py::arg("key") = 0);
  // NOTE [ Multipliers per graph task ], for the Python route's hooks
  m.def("new_key", [] { return next_key.fetch_add(1, std::memory_order_relaxed); });
  m.def("task_has", [](uint64_t key) { return task_has_key(torch::autograd::get_current_graph_task_id(), key); });
  m.def("task_keyed", [] { return !keys_of_task(torch::autograd::get_current_graph_task_id()).empty(); });
  // NOTE [ No functorch state left behind ] in _adapters/deepspeed/checks.py: whether
  // functorch's thread-local state exists on this thread, and dropping it.
  m.def("functorch_state", [] { return at::functorch::functorchTLSAccessor() != nullptr; });
  m.def("drop_functorch_state", [] { at::functorch::setFuncTorchTLS(nullptr); });
}

// NOTE [ Two entries without pybind11's dispatcher ]
// top (a top-level governed backward) and govern_nested (one a reentrant
// checkpoint makes per block) run once per backward.  Through pybind11 each
// call paid its dispatcher: the function record, argument and conversion
// vectors, the overload loop, a life-support frame, about 9k instructions of
// the ~114k graphscale added to a tiny mixed backward (benchmarks/cost.py).
// They are plain METH_FASTCALL functions of the module instead: positional
// arguments checked here, a C++ exception raised as pybind11 raises it.
static PyObject* raised_here() {  // inside a catch: the exception, as Python's error indicator
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (...) {
#if PYBIND11_VERSION_HEX >= 0x020D0000
    py::detail::try_translate_exceptions();  // the translators pybind11's dispatcher applies
#else
    PyErr_SetString(PyExc_RuntimeError, "graphscale: the native governed backward raised a C++ exception");
#endif
  }
  return nullptr;
}

static bool positional(const char* name, const char* usage, Py_ssize_t n, Py_ssize_t want, bool types_ok) {
  if (n == want && types_ok) return true;
  PyErr_Format(PyExc_TypeError, "graphscale native %s(%s): got %zd argument(s) of other types", name, usage, n);
  return false;
}

// top(governor, roots: tuple, grads: list, reading, factors: list, (retain_graph, create_graph, inputs),
//     carries: float, on_failure: list, want_stats)
static PyObject* top_entry(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!positional("top",
                  "governor, roots: tuple, grads: list, reading, factors: list, flags: tuple, carries: float, "
                  "on_failure: list, want_stats",
                  n, 9,
                  n == 9 && PyTuple_Check(args[1]) && PyList_Check(args[2]) &&
                      (PyList_Check(args[4]) || PyTuple_Check(args[4])) && PyTuple_Check(args[5])))
    return nullptr;
  try {
    py::detail::loader_life_support frame;  // as inside pybind11's dispatcher (casts may keep temporaries)
    TopCall t;
    t.reading = py::reinterpret_borrow<py::object>(args[3]);
    const Py_ssize_t nf = PySequence_Fast_GET_SIZE(args[4]);  // (a list or a tuple: checked above)
    PyObject** items = PySequence_Fast_ITEMS(args[4]);
    t.factors.resize(static_cast<size_t>(nf));
    for (Py_ssize_t k = 0; k < nf; ++k) t.factors[static_cast<size_t>(k)] = PyFloat_AsDouble(items[k]);
    t.carries = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred()) throw py::error_already_set();
    t.on_failure = py::reinterpret_borrow<py::object>(args[7]);
    return govern_top(py::reinterpret_borrow<py::object>(args[0]), py::reinterpret_borrow<py::tuple>(args[1]),
                      py::reinterpret_borrow<py::list>(args[2]), t, py::reinterpret_borrow<py::tuple>(args[5]),
                      PyObject_IsTrue(args[8]) == 1)
        .release()
        .ptr();
  } catch (...) {
    return raised_here();
  }
}

// govern_nested(current_node, roots: tuple, grads: list, (retain_graph, create_graph, inputs), want_stats)
static PyObject* nested_entry(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (!positional("govern_nested", "current_node, roots: tuple, grads: list, flags: tuple, want_stats", n, 5,
                  n == 5 && PyTuple_Check(args[1]) && PyList_Check(args[2]) && PyTuple_Check(args[3])))
    return nullptr;
  try {
    py::detail::loader_life_support frame;
    return govern_nested(node_of(args[0]), py::reinterpret_borrow<py::tuple>(args[1]),
                         py::reinterpret_borrow<py::list>(args[2]), py::reinterpret_borrow<py::tuple>(args[3]),
                         PyObject_IsTrue(args[4]) == 1)
        .release()
        .ptr();
  } catch (...) {
    return raised_here();
  }
}

// front(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None):
// torch.autograd.backward while the native route governs (NOTE [ The native front ] in front.h).
static PyObject* front_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (front_python == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "graphscale: the native front was called before configure_front");
    return nullptr;
  }
  const auto current = torch::autograd::get_current_node();  // (the running node: alive meanwhile)
  if (current && registry != nullptr) {  // else a top-level backward: the Python entry reads its factors
    try {
      py::detail::loader_life_support frame;
      if (front_governs(raw(current), args, nargs, kwnames)) Py_RETURN_NONE;
    } catch (...) {
      return raised_here();
    }
  }
  return PyObject_Vectorcall(front_python->ptr(), args, nargs, kwnames);
}

static PyMethodDef entries[] = {
    {"top", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(top_entry)), METH_FASTCALL,
     "One governed top-level backward (NOTE [ One native call per backward ] in registry.h)."},
    {"govern_nested", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(nested_entry)), METH_FASTCALL,
     "One governed nested backward (NOTE [ Nested backward ] in graphscale/_entry/entry.py)."},
    {"front", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(front_entry)),
     METH_FASTCALL | METH_KEYWORDS,
     "torch.autograd.backward while the native route governs (NOTE [ The native front ] in front.h)."},
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "graphscale native walk + plan + governed backward (see graphscale/_planner/potentials.py NOTE [ Potentials ])";
  // module_local: the test build (tests/helpers/seams.py) may be loaded beside this one.
  def_planner(m);
  def_running(m);
  py::class_<Governor>(m, "Governor", py::module_local()).def(py::init<py::object, int, py::object, bool, py::object>());
  for (PyMethodDef& def : entries) {  // NOTE [ Two entries without pybind11's dispatcher ]
    PyObject* fn = PyCFunction_NewEx(&def, nullptr, m.attr("__name__").ptr());
    if (fn == nullptr) throw py::error_already_set();
    m.attr(def.ml_name) = py::reinterpret_steal<py::object>(fn);
  }
  torch::autograd::_initFunctionPyTypeObject(bind_node_type, "GraphscaleBindBackward", nullptr, nullptr);
  Py_INCREF(&bind_node_type);  // static: never freed
  torch::autograd::registerCppFunction(typeid(BindNode), &bind_node_type);
#ifdef GRAPHSCALE_TEST_SEAMS
  m.attr("seams") = true;
  m.def("hook_tally", []() {
    return py::make_tuple(scale_made.load(), scale_live.load(), bind_made.load(), bind_live.load(), scale_calls.load(),
                          scale_hooks.load());
  });
  m.def("_inject_hook_failure", [](int64_t call) { inject_failure_in.store(call); });  // the call-th from now throws
  m.def("_set_may_bind", [](bool on) { may_bind.store(on); });
#else
  m.attr("seams") = false;
#endif
}
