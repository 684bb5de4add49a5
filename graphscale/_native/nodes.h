// nodes.h: what every part reads of autograd's graph: a pointer map
// (PtrMap, the walk's one per-node lookup), the C++ Node behind a Python
// grad_fn, node kinds (AccumulateGrad, a custom Function's PyNode), whether a
// leaf is an nn.Parameter, and the installed groups' owned leaves (Owners).
// Python twin: the helpers of graphscale/_core/walk.py (root_node, node kinds)
// and the owner table of graphscale/_core/snapshot.py.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::Node;

namespace {

// Pointer -> value, open addressing (the walk's only per-node lookup, and
// the owned-leaf lookup).  Key and value share a 16-byte slot: a probe
// touches one cache line.
template <typename K, typename V>
class PtrMap {
 public:
  void reserve(size_t n) {
    size_t cap = 64;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Slot{nullptr, V(-1)});
    mask_ = cap - 1;
    size_ = 0;
  }
  // Value of `key`, or -1.
  V get(const K* key) const {
    if (slots_.empty()) return V(-1);
    size_t h = hash(key) & mask_;
    while (true) {
      const Slot& s = slots_[h];
      if (s.key == key) return s.val;
      if (s.key == nullptr) return V(-1);
      h = (h + 1) & mask_;
    }
  }
  // Value of `key`; inserts `fresh` when absent (then *inserted = true).
  V get_or_insert(const K* key, V fresh, bool* inserted) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    size_t h = hash(key) & mask_;
    while (true) {
      Slot& s = slots_[h];
      if (s.key == key) {
        *inserted = false;
        return s.val;
      }
      if (s.key == nullptr) {
        s.key = key;
        s.val = fresh;
        ++size_;
        *inserted = true;
        return fresh;
      }
      h = (h + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  struct Slot {
    const K* key;
    V val;
  };
  static size_t hash(const K* p) {
    uint64_t x = reinterpret_cast<uintptr_t>(p);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    size_t cap = old.empty() ? 64 : old.size() * 2;
    slots_.assign(cap, Slot{nullptr, V(-1)});
    mask_ = cap - 1;
    size_ = 0;
    bool ins;
    for (const Slot& s : old)
      if (s.key != nullptr) get_or_insert(s.key, s.val, &ins);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

using NodeIndex = PtrMap<Node, int64_t>;  // Node* -> discovery position

// torch's owning pointer to a Node: std::shared_ptr before torch 2.10 or so,
// c10::intrusive_ptr since.  Node::getptr() returns it in both.
using NodePtr = decltype(std::declval<Node&>().getptr());

// The raw Node of a THPFunction's or THPCppFunction's cdata, whichever
// pointer type this torch uses (a custom Function's is a weak_ptr in older
// torch; the graph keeps the node alive meanwhile).
template <typename T>
Node* raw(const std::weak_ptr<T>& p) { return p.lock().get(); }
template <typename P>
Node* raw(const P& p) { return p.get(); }

// The C++ Node behind a Python grad_fn object (borrowed), or nullptr.
Node* node_of(PyObject* obj) {
  if (obj == Py_None) return nullptr;
  if (torch::autograd::THPCppFunction_Check(obj))
    return raw(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata);
  if (THPFunction_Check(obj)) return raw(reinterpret_cast<THPFunction*>(obj)->cdata);
  throw py::type_error("graphscale: native walker got a root that is not an autograd Node");
}

bool is_accumulate_grad(const Node* n) { return typeid(*n) == typeid(AccumulateGrad); }
// Custom-Function nodes.  PyNode's type_info is not exported by torch, so
// the dynamic type's name is compared, once per type: type_infos already
// known not to be PyNode's sit in a small direct-mapped cache (a graph has a
// few dozen node types; a miss only costs the comparison again).
bool is_py_node(const Node* n) {
  static std::atomic<const std::type_info*> pynode{nullptr};
  static thread_local const std::type_info* not_py[64] = {};
  const std::type_info* ti = &typeid(*n);
  if (ti == pynode.load(std::memory_order_relaxed)) return true;
  const size_t slot = (reinterpret_cast<uintptr_t>(ti) >> 4) & 63;
  if (not_py[slot] == ti) return false;
  if (std::strcmp(ti->name(), "N5torch8autograd6PyNodeE") == 0) {
    pynode.store(ti, std::memory_order_relaxed);
    return true;
  }
  not_py[slot] = ti;
  return false;
}

// The distinct non-null roots, first in discovery order.
void seed_roots(const std::vector<Node*>& roots, NodeIndex* index, std::vector<Node*>* found) {
  bool ins;
  for (Node* r : roots) {
    if (r == nullptr) continue;
    index->get_or_insert(r, static_cast<int64_t>(found->size()), &ins);
    if (ins) found->push_back(r);
  }
}

py::object py_of(Node* n) {
  auto ptr = n->getptr();
  return py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(ptr));
}

// What unowned leaves of a top-level backward must end at
// (graphscale/_core/snapshot.py UNOWNED_POLICIES, in that order).
enum Policy : int { kAny = 0, kPlainParams = 1, kPlain = 2 };

// Is `var` an nn.Parameter, as isinstance(var, nn.Parameter) says?  Only
// unowned leaves are asked.  Parameter's metaclass answers isinstance in
// Python (also True for a tensor flagged _is_param); the C type check first
// spares that call for real Parameters, the flag is read for the others.
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

// Owned leaves of the installed groups: TensorImpl* -> group position.
// Built once per installed state, reused by every backward.
struct Owners {
  PtrMap<c10::TensorImpl, int64_t> group_of;  // -1: not owned
  Owners(const std::vector<uintptr_t>& impls, const std::vector<int>& groups) {
    if (impls.size() != groups.size()) throw std::invalid_argument("graphscale: Owners sizes differ");
    group_of.reserve(impls.size());
    bool ins;
    for (size_t i = 0; i < impls.size(); ++i)
      group_of.get_or_insert(reinterpret_cast<const c10::TensorImpl*>(impls[i]), groups[i], &ins);
  }
  // The group position owning the leaf `acc` accumulates into, or -1.
  int64_t group(const Node* acc) const {
    return group_of.get(static_cast<const AccumulateGrad*>(acc)->variable.unsafeGetTensorImpl());
  }
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
