// front.h: the native front: what torch.autograd.backward is while the
// native route governs.  A backward called from inside a node's backward
// (a reentrant checkpoint's recompute) goes from here straight to
// govern_nested, with no Python frame; every other call goes on to the
// Python entry, unchanged.  Python twin: graphscale/_entry/entry.py
// governed_backward (its nested branch) with graphscale/_routes/native.py
// govern_nested_natively; its gate is graphscale/_backward/gate.py reason,
// pushed here as one flag.
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
//   - nested, and the gate open: govern_nested directly.  The gate is one
//     flag, `front_open`, that this code only reads: graphscale's gate
//     (graphscale/_backward/gate.py reason, with front=True) decides it and
//     pushes it here (set_front_open) each time one of its inputs changes:
//     the route switched (GRAPHSCALE_ROUTE, gate.set_route_enabled),
//     python_only entered or left on any thread, a phase, walk or route
//     recorder entered or left, the running state moved to or from this
//     module, a self-test verdict; and, as the latest top-level backward saw
//     them, compiled autograd and the "graphscale" logger at DEBUG (read at
//     each top-level backward, which reads them anyway; so a nested call
//     follows the logger level its top-level backward saw).  Each is obeyed
//     from the next nested call on.  Closed, the Python entry takes the call
//     and asks the gate itself (and counts a decline, as before).  Where
//     govern_nested declines (it touched nothing), the same.
// Every decision is govern_nested's, so the front changes which frames run,
// never which leaves get which factor (tests/native/test_route.py,
// tests/native/test_backward_path.py, tests/native/test_front.py).  entry.patched()
// knows both faces of the patch; remove() puts torch's own function back
// either way.

// entry.governed_backward: every call the front hands on (leaked on purpose, like the registry)
static py::object* front_python = nullptr;
static std::atomic<bool> front_open{false};  // NOTE [ The native front ]: set by the gate only

// configure_front(python): the function the front hands on to (graphscale/_backward/gate.py
// adopt_front); the module's `front` is the function itself (walker.cpp).
static void configure_front(py::object python) {
  if (front_python == nullptr) front_python = new py::object();
  *front_python = std::move(python);
}

// set_front_open(open): the gate's answer (graphscale/_backward/gate.py _recompute).
static void set_front_open(bool open) { front_open.store(open, std::memory_order_release); }

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
  if (!front_open.load(std::memory_order_acquire) || !front_arguments(args, nargs, kwnames, slot)) return false;
  py::tuple roots;
  py::list grads;
  if (!front_roots(slot[0], slot[1], &roots, &grads)) return false;
  py::object retain = py::reinterpret_borrow<py::object>(slot[2] != nullptr ? slot[2] : Py_None);
  py::object create = py::reinterpret_borrow<py::object>(slot[3] != nullptr ? slot[3] : Py_False);
  const py::object out = govern_nested(node, roots, grads, py::make_tuple(retain, create, py::none()), false);
  return !PyUnicode_Check(out.ptr());  // a str: declined, touched nothing
}
