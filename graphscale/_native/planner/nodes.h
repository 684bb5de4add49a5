// nodes.h: what every part of the planner reads of autograd's graph: a
// pointer map (PtrMap, the walk's one per-node lookup), node kinds
// (AccumulateGrad, a custom Function's PyNode), the question whether a leaf
// is an nn.Parameter (ParameterTest, answered by the caller), the unowned
// leaves' policy and the installed groups' owned leaves (Owners).
// Python twin: graphscale/_planner/nodes.py (ACCUMULATE_GRAD,
// CUSTOM_FUNCTION, root_node); the owner table and UNOWNED_POLICIES are
// graphscale/_core/snapshot.py's.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <typeinfo>
#include <utility>
#include <vector>

#include "errors.h"

namespace graphscale::planner {

using torch::autograd::AccumulateGrad;
using torch::autograd::Node;

// Pointer -> value, open addressing (the walk's only per-node lookup, and
// the owned-leaf lookup).  Key and value share a 16-byte slot: a probe
// touches one cache line.
template <typename K, typename V>
class PtrMap {
 public:
  void reserve(size_t n) {
    size_t cap = 64;
    while (cap < 2 * n) cap <<= 1;
    fresh_slots(cap);
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
    if (size_ >= limit_) grow();
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
  void fresh_slots(size_t cap) {
    slots_.assign(cap, Slot{nullptr, V(-1)});
    mask_ = cap - 1;
    limit_ = cap / 2;  // at most half full
    size_ = 0;
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    fresh_slots(old.empty() ? 64 : old.size() * 2);
    bool ins;
    for (const Slot& s : old)
      if (s.key != nullptr) get_or_insert(s.key, s.val, &ins);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t limit_ = 0;  // size_ at which the next insert grows first (0: nothing allocated yet)
  size_t size_ = 0;
};

using NodeIndex = PtrMap<Node, int64_t>;  // Node* -> discovery position

// torch's owning pointer to a Node: std::shared_ptr before torch 2.10 or so,
// c10::intrusive_ptr since.  Node::getptr() returns it in both.
using NodePtr = decltype(std::declval<Node&>().getptr());

// The raw Node of an owning or weak pointer, whichever pointer type this
// torch uses (a custom Function's is a weak_ptr in older torch; the graph
// keeps the node alive meanwhile).
template <typename T>
Node* raw(const std::weak_ptr<T>& p) { return p.lock().get(); }
template <typename P>
Node* raw(const P& p) { return p.get(); }

inline bool is_accumulate_grad(const Node* n) { return typeid(*n) == typeid(AccumulateGrad); }

// Custom-Function nodes.  PyNode's type_info is not exported by torch, so
// the dynamic type's name is compared, once per type: type_infos already
// known not to be PyNode's sit in a small direct-mapped cache (a graph has a
// few dozen node types; a miss only costs the comparison again).  The cache
// is shared by every thread, each slot a relaxed atomic: a slot only ever
// holds a type_info whose name was compared (a reader sees that one or an
// older one), and a thread_local array in a dlopen'ed module costs a
// __tls_get_addr call per node (NOTE [ No thread-local lookup per node ] in
// probe.h).
inline bool is_py_node(const Node* n) {
  static std::atomic<const std::type_info*> pynode{nullptr};
  static std::atomic<const std::type_info*> not_py[64] = {};
  const std::type_info* ti = &typeid(*n);
  if (ti == pynode.load(std::memory_order_relaxed)) return true;
  const size_t slot = (reinterpret_cast<uintptr_t>(ti) >> 4) & 63;
  if (not_py[slot].load(std::memory_order_relaxed) == ti) return false;
  if (std::strcmp(ti->name(), "N5torch8autograd6PyNodeE") == 0) {
    pynode.store(ti, std::memory_order_relaxed);
    return true;
  }
  not_py[slot].store(ti, std::memory_order_relaxed);
  return false;
}

// The distinct non-null roots, first in discovery order.
inline void seed_roots(const std::vector<Node*>& roots, NodeIndex* index, std::vector<Node*>* found) {
  bool ins;
  for (Node* r : roots) {
    if (r == nullptr) continue;
    index->get_or_insert(r, static_cast<int64_t>(found->size()), &ins);
    if (ins) found->push_back(r);
  }
}

// What unowned leaves of a top-level backward must end at
// (graphscale/_core/snapshot.py UNOWNED_POLICIES, in that order).
enum Policy : int { kAny = 0, kPlainParams = 1, kPlain = 2 };

// Is a leaf an nn.Parameter, as isinstance(var, nn.Parameter) says?  Only
// the caller knows (a Python type); asked of unowned leaves only, where the
// policy or a nested backward needs the answer.
class ParameterTest {
 public:
  virtual ~ParameterTest() = default;
  virtual bool is_parameter(const at::Tensor& leaf) const = 0;
};

// Owned leaves of the installed groups: TensorImpl* -> group position.
// Built once per installed state, reused by every backward.
struct Owners {
  PtrMap<c10::TensorImpl, int64_t> group_of;  // -1: not owned
  Owners(const std::vector<uintptr_t>& impls, const std::vector<int>& groups) {
    if (impls.size() != groups.size()) throw BadInput("Owners sizes differ");
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

}  // namespace graphscale::planner
