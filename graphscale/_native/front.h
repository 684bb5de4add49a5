// front.h: the native front: what torch.autograd.backward is while the
// native route governs.  A backward called from inside a node's backward
// (a reentrant checkpoint's recompute) goes from here straight to
// govern_nested, with no Python frame; every other call goes on to the
// Python entry, unchanged.  Python twin: graphscale/_entry/entry.py
// governed_backward (its nested branch) with graphscale/_routes/native.py
// govern_nested_natively.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// NOTE [ The native front ]
// A reentrant checkpoint calls torch.autograd.backward once per block, from
// inside the block's node, between its recompute and its backward: nothing
// graphscale's Python entry touches is in the caches then, so its frames
// (the patched function, the route's checks, the call into this module)
// cost a block about as much as the walk and plan of its graph (measured:
// docs/benchmark.md).  So once the native route governs (its self-test
// passed, the running state is in this module: entry.py adopts the front),
// torch.autograd.backward is this module's `front`, a C function:
//   - not inside a node's backward (no current node), or a call it does
//     not read (grad_variables=, inputs=, an edge root, an iterable torch
//     reads once, unknown keywords): the Python entry
//     (entry.governed_backward) takes it, with the same arguments;
//   - nested, and nothing asks for the Python route's view (route.enabled
//     false, the running state moved to another native module (a test
//     build), python_only on this thread, an active phase, walk or route
//     recorder, the "graphscale" logger possibly at DEBUG, compiled
//     autograd on: the gate below, which reads them every call, so tests
//     and tools that switch them are obeyed at once): govern_nested
//     directly.  Where it declines (it touched nothing), the Python entry
//     takes the call and counts the decline, as before.
// Every decision is govern_nested's, so the front changes which frames run,
// never which leaves get which factor (tests/native/test_route.py,
// tests/native/test_backward_path.py).  entry.patched() knows both faces of the
// patch; remove() puts torch's own function back either way.

struct Front {
  py::object python;     // graphscale._entry.entry.governed_backward: every call the front hands on
  py::object route;      // graphscale._routes.native: `enabled`
  py::object running;    // graphscale._backward.running: `state.module`, the module the running state is in
  py::object here;       // route._here (a threading.local): `python`, python_only on this thread
  py::object active;     // graphscale._core.observation.ACTIVE: phases, walks, routes
  py::object log_cache;  // the "graphscale" logger's level cache: a cached False for DEBUG is the only "off"
};
static Front* front_state = nullptr;  // leaked on purpose, like the registry

// configure_front(python, route, running, here, active, log_cache): what the front
// reads (graphscale/_routes/native.py native_front); the module's `front`
// is the function itself (walker.cpp).
static PyObject* this_module = nullptr;  // this extension module (borrowed: modules are not unloaded)

static void configure_front(py::object python, py::object route, py::object running, py::object here,
                            py::object active, py::object log_cache) {
  if (front_state == nullptr) front_state = new Front();
  *front_state = Front{std::move(python), std::move(route), std::move(running), std::move(here), std::move(active),
                       std::move(log_cache)};
}

static PyObject* interned(const char* s) { return PyUnicode_InternFromString(s); }  // (kept for good)

// Whether attribute `name` of `obj` is `want` (false, the error cleared, where it cannot be read).
static bool attr_is(PyObject* obj, PyObject* name, PyObject* want) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool same = v == want;
  Py_DECREF(v);
  return same;
}

static bool attr_empty_tuple(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool empty = PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 0;
  Py_DECREF(v);
  return empty;
}

// NOTE [ The native front ]: may govern_nested take a nested call now, with
// nothing to report to Python?
static bool front_gate_open(const Front& F) {
  static PyObject* const enabled = interned("enabled");
  static PyObject* const python = interned("python");
  static PyObject* const phases = interned("phases");
  static PyObject* const walks = interned("walks");
  static PyObject* const routes = interned("routes");
  static PyObject* const ca_on = interned("compiled_autograd_enabled");
  static PyObject* const ca_region = interned("in_compiled_autograd_region");
  static PyObject* const ca_module = interned("torch._dynamo.compiled_autograd");
  static PyObject* const state = interned("state");
  static PyObject* const module = interned("module");
  static PyObject* const debug = PyLong_FromLong(10);  // logging.DEBUG
  if (!attr_is(F.route.ptr(), enabled, Py_True) || !attr_is(F.here.ptr(), python, Py_False)) return false;
  PyObject* backend = PyObject_GetAttr(F.running.ptr(), state);  // the running state still in this module?
  const bool here = backend != nullptr && attr_is(backend, module, this_module);
  Py_XDECREF(backend);
  if (!here) {
    PyErr_Clear();
    return false;
  }
  PyObject* const active = F.active.ptr();
  if (!attr_empty_tuple(active, phases) || !attr_empty_tuple(active, walks) || !attr_empty_tuple(active, routes))
    return false;
  if (!PyDict_Check(F.log_cache.ptr()) || PyDict_GetItemWithError(F.log_cache.ptr(), debug) != Py_False) {
    PyErr_Clear();
    return false;  // unknown yet: the Python entry asks the logger (and fills its cache)
  }
  PyObject* ca = PyDict_GetItemWithError(PyImport_GetModuleDict(), ca_module);  // borrowed
  if (ca == nullptr) {
    if (!PyErr_Occurred()) return true;  // never imported: off
    PyErr_Clear();
    return false;
  }
  return attr_is(ca, ca_on, Py_False) && attr_is(ca, ca_region, Py_False);
}

// torch.autograd.backward's six parameters, by position or keyword; false
// where the front does not read the call (the Python entry does).
static bool front_arguments(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** slot) {
  static const char* const names[6] = {"tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables",
                                       "inputs"};
  if (nargs > 6) return false;
  for (Py_ssize_t i = 0; i < nargs; ++i) slot[i] = args[i];
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    int at = -1;
    for (int i = 0; i < 6 && at < 0; ++i)
      if (PyUnicode_CompareWithASCIIString(name, names[i]) == 0) at = i;
    if (at < 0 || slot[at] != nullptr) return false;  // (torch's own TypeError, through the Python entry)
    slot[at] = args[nargs + k];
  }
  const auto none = [](PyObject* v) { return v == nullptr || v == Py_None; };
  return slot[0] != nullptr && none(slot[4]) && none(slot[5]);
}

// The roots and seeds of a plain nested call as govern_nested reads them
// (graphscale/_routes/native.py govern_nested_natively); false: not plain.
static bool front_roots(PyObject* tensors, PyObject* grad_tensors, py::tuple* roots, py::list* grads) {
  // (exact tuples and lists first: THPVariable_Check is an isinstance, slow for the usual tuple)
  if (PyTuple_CheckExact(tensors)) {
    *roots = py::reinterpret_borrow<py::tuple>(tensors);
  } else if (PyList_CheckExact(tensors)) {
    *roots = py::reinterpret_steal<py::tuple>(PyList_AsTuple(tensors));
  } else if (THPVariable_Check(tensors)) {
    *roots = py::make_tuple(py::handle(tensors));
  } else {
    return false;
  }
  if (!*roots) throw py::error_already_set();  // (PyList_AsTuple out of memory)
  const Py_ssize_t n = static_cast<Py_ssize_t>(roots->size());
  const bool one = grad_tensors != nullptr && grad_tensors != Py_None && !PyTuple_CheckExact(grad_tensors) &&
                   !PyList_CheckExact(grad_tensors);
  if (one && !THPVariable_Check(grad_tensors)) return false;
  PyObject* list = nullptr;
  if (grad_tensors == nullptr || grad_tensors == Py_None || one) {
    list = PyList_New(one ? 1 : n);  // [None] * n, or [grad_tensors]
    for (Py_ssize_t i = 0; list != nullptr && i < PyList_GET_SIZE(list); ++i)
      PyList_SET_ITEM(list, i, Py_NewRef(one ? grad_tensors : Py_None));
  } else {
    list = PySequence_List(grad_tensors);
  }
  if (list == nullptr) throw py::error_already_set();  // (out of memory)
  *grads = py::reinterpret_steal<py::list>(list);
  return true;
}

// A call to the front from inside `node`'s backward: true where
// govern_nested governed it; false where the Python entry takes it (nothing
// touched).
static bool front_governs(Node* node, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* slot[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (!front_arguments(args, nargs, kwnames, slot) || !front_gate_open(*front_state)) return false;
  py::tuple roots;
  py::list grads;
  if (!front_roots(slot[0], slot[1], &roots, &grads)) return false;
  py::object retain = py::reinterpret_borrow<py::object>(slot[2] != nullptr ? slot[2] : Py_None);
  py::object create = py::reinterpret_borrow<py::object>(slot[3] != nullptr ? slot[3] : Py_False);
  const py::object out = govern_nested(node, roots, grads, py::make_tuple(retain, create, py::none()), false);
  return !PyUnicode_Check(out.ptr());  // a str: declined, touched nothing
}
