// registry.h: the process-wide state of the native route: the Python
// objects it needs (Registry, configure), a snapshot's Governor, a graph
// task's Binding, the registry of running plans and the lookup of the plan a
// nested backward runs inside (find_enclosing).  Python twin:
// graphscale/_backward/python_backend.py (Binding, PythonBackend) and
// graphscale/_backward/running.py (find_enclosing).
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// ===================================================================== the governed backward, natively
//
// NOTE [ One native call per backward ]
// graphscale/_entry/entry.py reads the call and the factors (Python: GAS
// may be a callable, an engine's attribute) and graphscale/_routes/native.py
// hands the rest to one call here: top(governor, ...) for a top-level backward,
// govern_nested for one called from inside a node's backward (once the native
// route governs, torch.autograd.backward is this module's front, front.h, which
// calls govern_nested itself).  That call decides (left
// alone, the fast path, a plan: graphscale/_backward/decide.py decide),
// walks and plans, scales the seeds, puts each edge multiplier on its node as
// a C++ FunctionPostHook (ScaleHook: no Python when it fires), binds the
// graph task (BindNode, a node of its own in front of the roots, so before
// any output hook; bind.h), registers the plan for nested backwards,
// calls the original torch.autograd.backward, and takes every hook, binding
// and registration back in a destructor (Undo), on every exit.  It declines
// (returns the reason as a short str, having touched nothing) what the
// Python route handles: a call it cannot read ("call"), a seed it cannot
// make ("seed"), more than 64 factors ("factors").  Python declines before
// the call what the native hooks cannot do (inputs=, compiled autograd: the
// gate, graphscale/_backward/gate.py).  Same decisions, same plans, same seeds
// as the Python route (tests/native/test_route.py runs the suite's graphs
// through both).
// (See NOTE [ Nested backward ] in graphscale/_entry/entry.py.)
//
// NOTE [ One running state, both routes ]
// What is running is kept once, here, for both routes while this module is
// loaded: the registry of walked plans whose backward runs (RunningEntry:
// NativePlans, or a Python route's plan past 64 factors), the lookup of the
// plan a nested backward runs inside (find_enclosing: the registry, else the
// task's binding), the Binding class, and the binding node (BindNode).  The
// Python route registers, looks up and binds through the same functions
// (graphscale/_backward/native_backend.py hands them over as the Backend
// interface; running.py calls the backend the state is in); running.py's
// PythonBackend serves only before this module keeps the state, and its
// Python binding hook also under compiled autograd, which lifts Python hooks only.
// The graph task -> Binding map is one Python dict (running.bindings) that
// both kinds of hook write, so output hooks read one map either way.
// Nothing here reads an attribute of graphscale's Python by name: what it
// needs is handed over as values (configure; top's arguments) or read from
// its own C++ structs (the gate's flag; see NOTE [ The native front ] in front.h).

// Process-wide Python objects the route needs (native.configure, once;
// graphscale/_backward/native_backend.py NativeBackend.configure hands them over).
struct Registry {
  py::object by_task;      // graphscale._backward.running.bindings: graph task id -> Binding
  py::object original;     // torch.autograd.backward as torch defined it (graphscale._backward.overrides.ORIGINAL_BACKWARD)
  py::object param_type;   // torch.nn.Parameter
  py::object carries_attr; // graphscale._backward.frames.CARRIES_ATTR: what a root's seed carries already
  py::object innermost;    // graphscale._backward.frames.innermost: this thread's top-level on_failure list
  py::object original_own; // its twin for calls an override sees
                           // (see NOTE [ An override sees torch's own backward ] in graphscale/_backward/overrides.py)
  py::object joined;       // graphscale._backward.native_backend.joined: (once, on_failure, reference) of
                           // a binding that is not this module's (running.py's Python Binding)
  py::object edge_type;    // torch.autograd.graph.GradientEdge
};

// A decline: the reason (a short str) the Python route takes the backward
// for, having touched nothing (graphscale/_routes/native.py counts it).
// (See NOTE [ Which route governs a backward ] in graphscale/_backward/gate.py.)
static py::object declined(const char* why) { return py::str(why); }
static Registry* registry = nullptr;  // leaked on purpose: outlives the interpreter's teardown order

static void configure(py::object by_task, py::object original, py::object param_type, py::object module_type_,
                      py::object carries_attr, py::object innermost, py::object original_own, py::object joined,
                      py::object edge_type) {
  if (registry == nullptr) registry = new Registry();
  Py_XDECREF(module_type);
  module_type = module_type_.inc_ref().ptr();
  *registry = Registry{by_task, original, param_type, carries_attr, innermost, original_own, joined, edge_type};
}

#ifdef GRAPHSCALE_TEST_SEAMS
// The test build only (graphscale/_native/build.py, variant "seams";
// tests/helpers/seams.py loads it): multiplier rows and binding hooks made and
// alive, ScaleHook calls, ScaleHooks added to nodes (hook_tally); the ScaleHook call that takes inject_failure_in to 0
// throws (0: none does); may_bind False: no graph task is bound to a Binding (tests that
// break the binding on purpose).
static std::atomic<int64_t> inject_failure_in{0};
static std::atomic<int64_t> scale_made{0}, scale_live{0}, bind_made{0}, bind_live{0}, scale_calls{0};
static std::atomic<int64_t> scale_hooks{0};  // ScaleHooks added to nodes (each node's first)
static std::atomic<bool> may_bind{true};
#define GS_SEAM(...) __VA_ARGS__
#else
#define GS_SEAM(...)
#endif

using Clock_ = std::chrono::steady_clock;
static int64_t ns_since(Clock_::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock_::now() - t0).count();
}

// What a natively governed backward's snapshot contributes (one per
// snapshot, kept in its tables): its owners, policy, checkpoint hint (node ->
// group position or None), whether it governs objects with output hooks, and
// the callable that warns about groups a backward missed.
struct Governor {
  py::object owners_obj;
  const Owners* owners = nullptr;
  int policy = kAny;
  py::object hint;
  bool hook_owners = false;
  py::object warn;
  std::unique_ptr<HintCache> hints = std::make_unique<HintCache>();
  Governor(py::object owners_, int policy_, py::object hint_, bool hook_owners_, py::object warn_)
      : owners_obj(owners_), owners(&owners_.cast<const Owners&>()), policy(policy_), hint(hint_),
        hook_owners(hook_owners_), warn(warn_) {
    if (policy < kAny || policy > kPlain) throw std::invalid_argument("graphscale: unknown unowned policy");
  }
};

// A running graph task's binding: the Reading that governs the task; where no
// plan of it exists, the potential everything in it carries (None: nested
// backwards are left alone), with the snapshot's Governor and the factors to
// plan them natively; `once` and `on_failure` shared with the binding of the
// task it runs inside; `reference`: a reference pass (audit).
// (See NOTE [ Which snapshot an output hook obeys ] in graphscale/_backward/running.py;
// NOTE [ Fast path ] in graphscale/_entry/entry.py;
// NOTE [ Once per backward ] in graphscale/_backward/running.py;
// NOTE [ A backward that raised ] in graphscale/_backward/frames.py.)
struct Binding {
  py::object reading;
  py::object potential = py::none();
  py::object once;
  py::object on_failure;
  bool reference = false;
  py::object governor = py::none();
  std::vector<double> factors;
};

// The binding of the graph task this thread runs a node of (borrowed), or nullptr.
static PyObject* current_binding() {
  PyObject* dict = registry->by_task.ptr();
  if (PyDict_GET_SIZE(dict) == 0) return nullptr;
  const int tid = torch::autograd::get_current_graph_task_id();
  if (tid < 0) return nullptr;
  PyObject* key = PyLong_FromLong(tid);
  if (key == nullptr) throw py::error_already_set();
  PyObject* found = PyDict_GetItem(dict, key);  // borrowed; no error set
  Py_DECREF(key);
  return found;
}

// A Binding's fields as Python reads them (running.py's Binding has the
// same names): in the instance's __dict__, set once from the struct when it
// is made, so that a read is a plain attribute read, not a pybind11
// property call (the DeepSpeed adapter's output hooks read them per engine
// and backward: graphscale/_adapters/deepspeed/hooks.py _governing).  The
// C++ side reads the struct only; neither changes after this.
static py::object exposed(py::object obj) {
  static const char* const kNames[] = {"reading", "potential", "once", "on_failure", "reference"};
  static PyObject* names[5] = {nullptr};
  if (names[0] == nullptr)
    for (int k = 0; k < 5; ++k) names[k] = PyUnicode_InternFromString(kNames[k]);  // kept for the process
  const Binding& b = obj.cast<const Binding&>();
  PyObject* values[5] = {b.reading.ptr(), b.potential.ptr(), b.once.ptr(), b.on_failure.ptr(),
                         b.reference ? Py_True : Py_False};
  for (int k = 0; k < 5; ++k)
    if (PyObject_GenericSetAttr(obj.ptr(), names[k], values[k]) != 0) throw py::error_already_set();
  return obj;
}

// A new Binding, joining the one of the task this thread runs inside (its
// `once`, `on_failure` and `reference`), else with a new `once` and the
// given `on_failure` (where None: the innermost top-level backward's on
// this thread, NOTE [ A backward that raised ]).
static py::object make_binding(py::object reading, py::object potential, py::object on_failure, bool reference,
                               py::object governor, std::vector<double> factors) {
  Binding b;
  b.reading = std::move(reading);
  b.potential = std::move(potential);
  b.governor = std::move(governor);
  b.factors = std::move(factors);
  b.reference = reference;
  PyObject* enclosing = current_binding();
  if (enclosing != nullptr && py::isinstance<Binding>(py::handle(enclosing))) {
    const Binding& e = py::handle(enclosing).cast<const Binding&>();
    b.once = e.once;
    b.on_failure = e.on_failure;
    b.reference = b.reference || e.reference;
  } else if (enclosing != nullptr) {  // running.py's Python one (made before this module kept the state)
    const py::tuple fields = registry->joined(py::handle(enclosing));
    b.once = fields[0];
    b.on_failure = fields[1];
    b.reference = b.reference || fields[2].cast<bool>();
  } else {
    b.once = py::reinterpret_steal<py::object>(PySet_New(nullptr));
    b.on_failure = on_failure.is_none() ? registry->innermost() : on_failure;
  }
  return exposed(py::cast(std::move(b)));
}

// The registry of walked plans whose backward is running, any thread,
// innermost last (NOTE [ One running state, both routes ]).  `plan` is null
// for a Python route's Python plan (past 64 factors: asked through the
// phi_of it was registered with).  Changed and read with the GIL held only.
//
// A natively governed backward registers its plan as a C++ object only: no
// Python object is made for it (making and freeing one cost about as much as
// planning a reentrant checkpoint's block, measured); running_entries()
// wraps one for Python when asked.
struct RunningEntry {
  PlanPtr plan;        // null for a Python route's Python plan
  PyObject* plan_obj;  // strong; null for a native plan registered without a Python object
  PyObject* reading;   // strong
  uint64_t token;
  PyObject* phi_of;    // strong: a Python plan's phi_of(node) -> float | None; null for a native plan
};
static std::vector<RunningEntry> native_running;
static uint64_t next_token = 1;

static uint64_t push_running(PlanPtr plan, py::object plan_obj, py::object reading,
                             py::object phi_of = py::object()) {
  const uint64_t token = next_token++;
  native_running.push_back(RunningEntry{std::move(plan), plan_obj.release().ptr(), reading.release().ptr(), token,
                                        phi_of.release().ptr()});
  return token;
}

static void pop_running(uint64_t token) {
  for (size_t i = native_running.size(); i-- > 0;)
    if (native_running[i].token == token) {
      PlanPtr plan = std::move(native_running[i].plan);  // freed last: freeing may run Python
      PyObject* plan_obj = native_running[i].plan_obj;
      PyObject* reading = native_running[i].reading;
      PyObject* phi_of = native_running[i].phi_of;
      native_running.erase(native_running.begin() + static_cast<std::ptrdiff_t>(i));
      Py_XDECREF(plan_obj);
      Py_DECREF(reading);
      Py_XDECREF(phi_of);
      return;
    }
}

// (plan, reading) of every running entry, innermost last.
static py::list running_entries() {
  py::list out;
  for (const auto& e : native_running)
    out.append(py::make_tuple(e.plan_obj != nullptr ? py::reinterpret_borrow<py::object>(e.plan_obj) : py::cast(e.plan),
                              py::reinterpret_borrow<py::object>(e.reading)));
  return out;
}

// What a backward nested inside `node` is planned with: the running plan
// that walked `node` (innermost first) and its potential there, or, inside
// a backward left unplanned, its task's binding and the potential bound.
struct Enclosing {
  enum Kind { kNone, kPlan, kBound, kPython } kind = kNone;
  const NativePlan* plan = nullptr;   // kPlan
  py::object reading;                 // kPlan, kBound
  double phi = 1.0;                   // the potential everything nested carries
  const Binding* binding = nullptr;   // kBound (alive while `keep` is)
  py::object keep;                    // the binding (kBound)
  std::vector<const planner::Plan*> outer_plans;  // every running NativePlan, innermost first (the kPlan one too)
  std::vector<PlanPtr> alive;  // their owners: alive while a hint may run Python (and another thread)
};

// The one nested-plan lookup (NOTE [ One running state, both routes ]).
// kPython: a running Python plan walked `node` (only the Python route,
// past 64 factors, makes one), so the Python route plans it.
static Enclosing find_enclosing(Node* node) {
  Enclosing out;
  out.outer_plans.reserve(native_running.size());
  out.alive.reserve(native_running.size());
  for (size_t k = native_running.size(); k-- > 0;)
    if (native_running[k].plan != nullptr) {
      out.outer_plans.push_back(native_running[k].plan.get());
      out.alive.push_back(native_running[k].plan);
    }
  for (size_t k = native_running.size(); node != nullptr && k-- > 0;) {
    if (k >= native_running.size()) continue;  // another thread's backward ended while Python ran (below)
    const RunningEntry& e = native_running[k];
    if (e.plan == nullptr) {  // Python runs here and may let another thread change the registry
      py::object phi_of = py::reinterpret_borrow<py::object>(e.phi_of);
      if (phi_of(py_of(node)).is_none()) continue;
      out.kind = Enclosing::kPython;
      return out;
    }
    const int64_t i = e.plan->index.get(node);
    if (i < 0) continue;
    out.kind = Enclosing::kPlan;
    out.plan = e.plan.get();  // (kept by out.alive)
    out.phi = e.plan->phi_disc[i];
    out.reading = py::reinterpret_borrow<py::object>(e.reading);
    return out;
  }
  PyObject* bound = current_binding();
  if (bound == nullptr) return out;
  py::handle b(bound);
  if (!py::isinstance<Binding>(b)) return out;  // a reference pass's Python binding: nothing nested is planned
  const Binding& binding = b.cast<const Binding&>();
  if (binding.potential.is_none() || binding.governor.is_none()) return out;
  out.kind = Enclosing::kBound;
  out.binding = &binding;
  out.phi = binding.potential.cast<double>();
  out.reading = binding.reading;
  out.keep = py::reinterpret_borrow<py::object>(b);
  return out;
}

// The potential a running plan gave `node`, or None: what the Python
// route's nested plan with inputs= asks per node (its outer_phi).
static py::object enclosing_phi(py::handle obj) {
  Node* node = node_of(obj.ptr());
  for (size_t k = native_running.size(); node != nullptr && k-- > 0;) {
    if (k >= native_running.size()) continue;  // another thread's backward ended while Python ran (below)
    const RunningEntry& e = native_running[k];
    if (e.plan == nullptr) {  // Python runs here and may let another thread change the registry
      py::object phi_of = py::reinterpret_borrow<py::object>(e.phi_of);
      py::object phi = phi_of(obj);
      if (!phi.is_none()) return phi;
      continue;
    }
    const int64_t i = e.plan->index.get(node);
    if (i >= 0) return py::float_(e.plan->phi_disc[i]);
  }
  return py::none();
}
