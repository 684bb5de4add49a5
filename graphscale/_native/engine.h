// engine.h: handing a governed backward to torch (call_torch): straight to
// torch's engine in the plain case, else through the original
// torch.autograd.backward.  Python twin: graphscale/_backward/call.py
// BackwardCall.run (the Python route always calls the original).
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

#include <ATen/PythonTorchFunctionTLS.h>

// NOTE [ Straight to the engine ]
// torch.autograd.backward is a Python function: it reads its arguments, asks
// for __torch_function__, checks or makes each seed (_make_grads: a sym_eq
// per given seed, ones_like per implicit one) and then calls
// _engine_run_backward, torch's own wrapper of the C++ engine (its logging
// hooks, the context device threads see).  That Python is about 300
// bytecodes, some 13 thousand instructions a backward: more than a tenth of
// what graphscale added to a DeepSpeed backward of one Linear, all of it
// work a governed backward has done already (it read the roots, seeds and
// flags).  So, in the plain case, call_torch does what the original would,
// natively, and calls _engine_run_backward itself, found in the original's
// globals each call, as the original finds it.  The plain case: the
// original is torch's own function (its code is torch/autograd/__init__.py's
// `backward`: nothing wraps it); no inputs=; every root an exact
// torch.Tensor (no __torch_function__ of a subclass) and no torch-function
// mode on; no functorch transform active; each seed None for a root that
// needs a gradient, is not nested and is a real floating-point scalar
// (made: ones_like, preserve format, as _make_grads makes it), or a tensor
// of the root's sizes and complexness, neither nested nor of symbolic sizes.
// retain_graph None means create_graph, as torch says.  Any other call (a
// subclass root, a shape mismatch, inputs=, a wrapped original ...) goes
// through the original, which raises torch's own errors.  The roots handed
// to torch may be edges to the binding node (bind.h); the seeds are checked against the caller's
// roots, whose metadata that node copies.  tests/native/test_engine_call.py pins
// both sides.
struct Straight {
  PyObject* original = nullptr;  // the registry's original when `globals` was read (borrowed: registry keeps it)
  py::object globals;            // its __globals__, where it finds _engine_run_backward; None: not torch's own
  py::object functorch_active;   // torch._C._are_functorch_transforms_active (None: absent, never straight)
  py::object kwnames;            // ("allow_unreachable", "accumulate_grad")
  py::object run_name;           // "_engine_run_backward", interned
};
static Straight* straight = nullptr;  // leaked on purpose, like the registry

// Whether `fn` is torch's own torch.autograd.backward: its code's name and
// file are torch/autograd/__init__.py's `backward`.
static bool is_torch_backward(PyObject* fn) {
  if (!PyFunction_Check(fn)) return false;
  PyCodeObject* code = reinterpret_cast<PyCodeObject*>(PyFunction_GET_CODE(fn));
  py::object autograd = py::module_::import("torch.autograd");
  py::object file = py::getattr(autograd, "__file__", py::none());
  return !file.is_none() && PyUnicode_Check(code->co_name) &&
         PyUnicode_CompareWithASCIIString(code->co_name, "backward") == 0 &&
         PyObject_RichCompareBool(code->co_filename, file.ptr(), Py_EQ) == 1;
}

static Straight& straight_state() {
  if (straight == nullptr) {
    straight = new Straight();
    py::object c = py::module_::import("torch._C");
    straight->functorch_active = py::getattr(c, "_are_functorch_transforms_active", py::none());
    straight->kwnames = py::make_tuple("allow_unreachable", "accumulate_grad");
    straight->run_name = py::reinterpret_steal<py::object>(PyUnicode_InternFromString("_engine_run_backward"));
  }
  if (straight->original != registry->original.ptr()) {  // (configure ran again)
    straight->original = registry->original.ptr();
    straight->globals = is_torch_backward(straight->original)
                            ? py::reinterpret_borrow<py::object>(PyFunction_GET_GLOBALS(straight->original))
                            : py::none();
  }
  return *straight;
}

// The seeds torch would hand its engine for `roots` and `seeds` (a
// sequence of None or tensors, one per root), made as _make_grads makes
// them; false where the call is not the plain case (nothing made).
// (See NOTE [ Straight to the engine ].)
static bool plain_seeds(const py::tuple& roots, py::handle seeds, py::tuple* out) {
  const Py_ssize_t n = static_cast<Py_ssize_t>(roots.size());
  if (PySequence_Size(seeds.ptr()) != n) {
    PyErr_Clear();
    return false;
  }
  py::tuple made(n);
  for (Py_ssize_t r = 0; r < n; ++r) {
    PyObject* root = roots[r].ptr();
    if (!THPVariable_CheckExact(root)) return false;
    const at::Tensor& var = THPVariable_Unpack(root);
    if (var.is_nested()) return false;
    py::object s = py::reinterpret_steal<py::object>(PySequence_GetItem(seeds.ptr(), r));
    if (!s) throw py::error_already_set();
    if (s.is_none()) {
      if (!var.requires_grad() || !at::isFloatingType(var.scalar_type()) ||
          var.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || var.numel() != 1)
        return false;
      made[r] = py::reinterpret_steal<py::object>(
          THPVariable_Wrap(at::ones_like(var, at::TensorOptions{}, at::MemoryFormat::Preserve)));
      continue;
    }
    if (!THPVariable_Check(s.ptr())) return false;
    const at::Tensor& g = THPVariable_Unpack(s.ptr());
    if (g.is_nested() || var.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
        g.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !var.sizes().equals(g.sizes()) ||
        var.is_complex() != g.is_complex())
      return false;
    made[r] = s;
  }
  *out = std::move(made);
  return true;
}

// Whether torch's backward, handed `roots` now, asks a __torch_function__
// override: a torch-function mode is on, or a root is a tensor of a subclass
// other than nn.Parameter.  Twin: graphscale/_backward/overrides.py overridable.
static bool overridable(py::handle roots) {
  if (at::impl::torch_function_mode_enabled()) return true;
  const Py_ssize_t n = PyTuple_Check(roots.ptr()) ? PyTuple_GET_SIZE(roots.ptr()) : 0;
  for (Py_ssize_t r = 0; r < n; ++r) {
    PyObject* t = PyTuple_GET_ITEM(roots.ptr(), r);
    if (THPVariable_Check(t) && !THPVariable_CheckExact(t) &&
        Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(registry->param_type.ptr()))
      return true;
  }
  return false;
}

// torch.autograd.backward as torch defined it, called positionally (tensors,
// grad_tensors, retain_graph, create_graph, grad_variables=None, inputs);
// its twin where an override may see the call.
// (See NOTE [ An override sees torch's own backward ] in graphscale/_backward/overrides.py.)
static void call_original(py::handle roots, py::handle seeds, py::handle retain, py::handle create,
                          py::handle inputs) {
  PyObject* args[6] = {roots.ptr(), seeds.ptr(), retain.ptr(), create.ptr(), Py_None, inputs.ptr()};
  PyObject* fn = overridable(roots) && !registry->original_own.is_none() ? registry->original_own.ptr()
                                                                          : registry->original.ptr();
  PyObject* out = PyObject_Vectorcall(fn, args, 6, nullptr);
  if (out == nullptr) throw py::error_already_set();
  Py_DECREF(out);
}

// What the original would do with (`torch_roots`, `seeds`, retain, create,
// inputs): NOTE [ Straight to the engine ].  `roots`: the caller's roots
// (tensors or edges), which `torch_roots` stands for (the same, or edges to
// the binding node).
static void call_torch(const py::tuple& roots, py::handle torch_roots, py::handle seeds, py::handle retain,
                       py::handle create, py::handle inputs) {
  Straight& s = straight_state();
  py::tuple made;
  PyObject* run = nullptr;  // borrowed
  if (inputs.is_none() && !s.globals.is_none() && !s.functorch_active.is_none() &&
      !at::impl::torch_function_mode_enabled()) {
    run = PyDict_GetItemWithError(s.globals.ptr(), s.run_name.ptr());
    if (run == nullptr && PyErr_Occurred()) throw py::error_already_set();
  }
  if (run != nullptr) {
    PyObject* active = PyObject_CallNoArgs(s.functorch_active.ptr());
    if (active == nullptr) throw py::error_already_set();
    const int on = PyObject_IsTrue(active);
    Py_DECREF(active);
    if (on < 0) throw py::error_already_set();
    if (on != 0 || !plain_seeds(roots, seeds, &made)) run = nullptr;
  }
  if (run == nullptr) return call_original(torch_roots, seeds, retain, create, inputs);
  py::object keep_run = py::reinterpret_borrow<py::object>(run);  // (the globals may change while it runs)
  py::tuple no_inputs(0);
  PyObject* args[7] = {torch_roots.ptr(), made.ptr(), retain.is_none() ? create.ptr() : retain.ptr(),
                       create.ptr(), no_inputs.ptr(), Py_True, Py_True};
  PyObject* out = PyObject_Vectorcall(run, args, 5, s.kwnames.ptr());
  if (out == nullptr) throw py::error_already_set();
  Py_DECREF(out);
}
