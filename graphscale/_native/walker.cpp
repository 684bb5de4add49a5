// graphscale native walk + plan.
//
// The same computation as graphscale/_backward/pyplan.py build (the walk of
// graphscale/_core/walk.py, the pins) followed by graphscale/_core/plan.py (see NOTE [
// Potentials ] there), done on the C++ autograd Nodes directly:
// breadth-first discovery over next_edges, Kahn's topological order, pins on
// AccumulateGrad leaves, bottom-up reachable pin values and votes, top-down
// potentials.  Every order and tie-break mirrors the Python reference, so the
// two give identical plans (tests/test_native_walker.py checks this).
// Iterative throughout: graphs have 1e5 nodes.
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

// What the governed backward needs from a plan, and the nested-backward lookup.
struct NativePlan {
  // The roots' Python objects keep every walked node alive (so addresses stay
  // unique).  Not C++ NodePtrs: if the last owner of a deep graph were a
  // plain NodePtr, freeing it would recurse down the chain; torch frees
  // graphs owned by Python objects and tensors iteratively.
  py::object roots;
  // AccumulateGrad nodes of leaf roots given as tensors (nested_plan): the
  // tensor holds them only weakly.  They have no next edges, so holding them
  // here cannot make a free recurse.
  std::vector<NodePtr> leaf_roots;
  NodeIndex index;                              // Node* -> discovery position
  std::vector<double> phi_disc;                 // potential by discovery position
  std::vector<double> seeds;
  std::vector<int64_t> hook_nodes;              // discovery positions of nodes with edge multipliers
  std::vector<std::vector<std::pair<int64_t, double>>> hook_mults;
  std::vector<Node*> found;
  int64_t num_nodes = 0;
  int64_t multiplications = 0;
  double base = 1.0;
  // What a backward nested inside this one is planned with (nested_plan):
  // the same owners, factors, policy and checkpoint hint.
  py::object owners;  // the Owners object
  const Owners* owners_ptr = nullptr;  // its C++ side (the object keeps it alive)
  std::vector<double> factors;
  int policy = kAny;
  py::object hint;
  bool hint_positions = false;
  HintCache* hint_cache = nullptr;  // the governor's (alive while `governor` is)
  py::object governor = py::none();  // the Governor of a natively governed backward (None: planned for Python)
  // What the backward reached: owned leaves, and per group position whether
  // any of its leaves; unowned nn.Parameter leaves (counted where the policy
  // or a nested backward asks; their discovery positions).
  std::vector<int64_t> phase_ns;  // Clock: discover, pin, order, bottom_up, top_down, multipliers
  int64_t owned_leaves = 0;
  int64_t custom_nodes = 0;
  bool tensor_hooks = false;  // some non-leaf node has tensor hooks (a DeepSpeed output hook among them?)  // custom-Function nodes: they may run a nested backward over hidden leaves
  std::vector<char> reached;
  std::vector<int64_t> unowned_param_pos;

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

// What one plan is asked: graphscale/_core/request.py PlanRequest, in C++ terms.
struct Request {
  py::object owners_obj;                 // the Owners of the installed state
  const Owners* owners = nullptr;
  std::vector<double> factors;           // factors[g]: factor of group position g
  double base = 1.0;                     // potential the seeds already carry
  bool nested = false;                   // a carrier is given (nested backward)
  double carrier = 0.0;                  // pin of unseen unowned non-Parameter leaves when nested
  int policy = kAny;                     // Policy: which unowned leaves are pinned to 1
  py::handle param_type;                 // torch.nn.Parameter
  std::vector<Node*> extra_nodes;        // more pins (non-leaf inputs=), null where no node
  std::vector<double> extra_values;
  // The enclosing plans: native ones (innermost first) looked up by Node*,
  // else a Python callable (or None) asked per node.
  const std::vector<const NativePlan*>* outer_plans = nullptr;
  py::object outer_phi;
  py::object hint;                       // None, or a callable: custom Function node -> pin or None
  bool hint_positions = false;           // the hint answers a group position (or None), not a pin
  HintCache* hint_cache = nullptr;       // with hint_positions: answers kept per run_function module

  bool has_outer() const { return outer_plans != nullptr || !outer_phi.is_none(); }

  // The potential an enclosing plan gave `node`, if any.
  bool seen_phi(Node* node, double* out) const {
    if (outer_plans != nullptr) {
      for (const NativePlan* op : *outer_plans) {
        int64_t i = op->index.get(node);
        if (i >= 0) {
          *out = op->phi_disc[i];
          return true;
        }
      }
      return false;
    }
    if (outer_phi.is_none()) return false;
    py::object seen = outer_phi(py_of(node));
    if (seen.is_none()) return false;
    *out = seen.cast<double>();
    return true;
  }
};

// Scratch arrays of one plan, kept per thread so that a backward's plans
// (one per nested backward under reentrant checkpointing) do not allocate
// and clear them afresh.  A plan that starts while another is running on the
// same thread (a Python callback reentering) takes fresh ones.
struct Scratch {
  std::vector<int32_t> kid_start, kids, indeg, order, pinned, choice, vote_at, tallies;
  std::vector<int32_t> leaves, customs;  // discovery positions of AccumulateGrad and custom-Function nodes
  std::vector<int64_t> leaf_group;       // per entry of leaves: owning group position, or -1
  std::vector<char> is_leaf, pin_kind, has_pin, enclosed, mark, set;
  std::vector<double> pin_value;
  std::vector<int> pin_bit;
  std::vector<uint64_t> reach;
  bool busy = false;
};

// Nanoseconds of each phase of a plan (NativePlan.phase_ns: discover, pin,
// order, bottom_up, top_down, multipliers), for graphscale's phase recorder.
struct Clock {
  std::vector<int64_t>& out;
  std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
  explicit Clock(std::vector<int64_t>& o) : out(o) {}
  void lap() {
    auto now = std::chrono::steady_clock::now();
    out.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count());
    last = now;
  }
};

// One plan, in phases: discover -> pin -> order -> bottom_up -> top_down ->
// multipliers.  The same computation as graphscale/_backward/pyplan.py build
// (walk, pins) then graphscale/_core/plan.py make_plan, with the same orders and
// tie-breaks.  Nodes keep their discovery position throughout; the
// topological order is a permutation (order) walked where the Python planner
// walks its sorted list, so nothing is renumbered.
class Planner {
 public:
  Planner(const Request& req, Scratch& scratch, NativePlan& plan) : R(req), S(scratch), P(plan) {}

  void run(const std::vector<Node*>& root_nodes, size_t index_guess) {
    P.owners = R.owners_obj;
    P.owners_ptr = R.owners;
    P.factors = R.factors;
    P.policy = R.policy;
    P.reached.assign(R.factors.size(), 0);
    P.hint = R.hint;
    P.hint_positions = R.hint_positions;
    P.hint_cache = R.hint_cache;
    P.base = R.base;
    Clock clock(P.phase_ns);
    discover(root_nodes, index_guess);
    clock.lap();
    P.seeds.assign(root_nodes.size(), 1.0);
    const bool trivial = pin();
    clock.lap();
    if (trivial) {  // every pin equals base: every potential is base, nothing multiplied
      P.phi_disc.assign(n_, R.base);
      return;
    }
    order();
    clock.lap();
    bottom_up();
    clock.lap();
    top_down();
    clock.lap();
    multipliers(root_nodes);
    clock.lap();
  }

 private:
  const Request& R;
  Scratch& S;
  NativePlan& P;
  int32_t n_ = 0;
  std::vector<int32_t> extra_pos_;
  std::vector<double> values_;  // distinct pin values, by bit

  int bit_of(double v) const {
    for (size_t b = 0; b < values_.size(); ++b)
      if (values_[b] == v) return static_cast<int>(b);
    return -1;
  }

  // Breadth-first discovery over next_edges, edges in CSR form by discovery position.
  void discover(const std::vector<Node*>& root_nodes, size_t index_guess) {
    std::vector<Node*>& found = P.found;
    NodeIndex& index = P.index;
    index.reserve(index_guess);  // grows when the guess is short
    found.reserve(index_guess + 16);
    seed_roots(root_nodes, &index, &found);
    bool ins;
    auto& kid_start = S.kid_start;
    auto& kids = S.kids;
    auto& is_leaf = S.is_leaf;
    kid_start.clear();
    kids.clear();
    is_leaf.clear();
    S.leaves.clear();
    S.leaf_group.clear();
    S.customs.clear();
    constexpr size_t kAhead = 8;  // prefetch distance: the walk is bound by memory latency on a fresh graph
    for (size_t i = 0; i < found.size(); ++i) {
      if (i + kAhead < found.size()) {
        const auto& ahead = found[i + kAhead]->next_edges();
        if (!ahead.empty()) __builtin_prefetch(ahead.data());
      }
      Node* node = found[i];
      kid_start.push_back(static_cast<int32_t>(kids.size()));
      const auto& next = node->next_edges();
      // AccumulateGrad has no next edges: test the type only where there are
      // none.  Everything pin() needs of a node is read here, while the node
      // is in cache: its owner (leaves), whether it is a custom Function.
      if (next.empty() && is_accumulate_grad(node)) {
        is_leaf.push_back(1);
        S.leaves.push_back(static_cast<int32_t>(i));
        S.leaf_group.push_back(R.owners->group(node));
        continue;
      }
      is_leaf.push_back(0);
      if (is_py_node(node)) S.customs.push_back(static_cast<int32_t>(i));
      if (!P.tensor_hooks && !node->tensor_pre_hooks().empty()) P.tensor_hooks = true;
      for (const auto& e : next) {
        Node* nxt = e.function.get();
        if (nxt == nullptr) {
          kids.push_back(-1);
          continue;
        }
        int64_t j = index.get_or_insert(nxt, static_cast<int64_t>(found.size()), &ins);
        if (ins) {
          found.push_back(nxt);
          __builtin_prefetch(nxt);
          __builtin_prefetch(reinterpret_cast<const char*>(nxt) + 64);
        }
        kids.push_back(static_cast<int32_t>(j));
      }
    }
    n_ = static_cast<int32_t>(found.size());
    kid_start.push_back(static_cast<int32_t>(kids.size()));
    P.num_nodes = n_;
  }

  // The pin of an unowned leaf (NOTE [ Unowned leaves in nested backward ];
  // NOTE [ Unowned leaves ] in graphscale/_core/snapshot.py), if any; counts it when
  // it is an nn.Parameter.
  bool unowned_pin(int32_t o, const at::Tensor& var, double* v) {
    if (R.has_outer() && R.seen_phi(P.found[o], v)) return true;
    if (R.policy == kAny && !R.nested) return false;
    const bool param = is_parameter(var, R.param_type);
    if (param) P.unowned_param_pos.push_back(o);
    if (R.nested) {
      *v = param ? 1.0 : R.carrier;
      return true;
    }
    if (R.policy == kPlain || param) {
      *v = 1.0;
      return true;
    }
    return false;
  }

  // The group position the hint gives custom-Function node `o`, or -1 (HintCache).
  int64_t cached_hint(int32_t o) {
    static PyObject* name = PyUnicode_InternFromString("run_function");
    py::object ctx = py_of(P.found[o]);
    PyObject* fn = PyObject_GetAttr(ctx.ptr(), name);
    if (fn == nullptr) PyErr_Clear();
    const bool cacheable = fn != nullptr && module_type != nullptr &&
                           PyObject_TypeCheck(fn, reinterpret_cast<PyTypeObject*>(module_type));
    if (cacheable) {
      auto it = R.hint_cache->by_fn.find(fn);
      if (it != R.hint_cache->by_fn.end()) {
        Py_DECREF(fn);
        return it->second;
      }
    }
    py::object v = R.hint(ctx);
    const int64_t pos = v.is_none() ? -1 : v.cast<int64_t>();
    if (cacheable) {
      R.hint_cache->by_fn.emplace(fn, pos);  // keeps the reference GetAttr gave
    } else {
      Py_XDECREF(fn);
    }
    return pos;
  }

  // Pins, by discovery position: leaves and hinted custom-Function nodes, then
  // inputs=, then nodes an enclosing plan governs (later ones overwrite, as
  // later insertions into the Python planner's pin dict do).  pin_kind: 0
  // none, 1 leaf, 2 hinted Function node.  True when every pin equals base.
  bool pin() {
    const int32_t n = n_;
    const auto& found = P.found;
    auto& pin_kind = S.pin_kind;
    auto& has_pin = S.has_pin;
    auto& pin_value = S.pin_value;
    auto& enclosed = S.enclosed;
    pin_kind.assign(n, 0);
    has_pin.assign(n, 0);
    pin_value.assign(n, 0.0);
    enclosed.assign(n, 0);
    bool trivial = true;
    auto put = [&](int32_t o, double v) {
      has_pin[o] = 1;
      pin_value[o] = v;
      if (v != R.base) trivial = false;
    };
    const bool want_hint = !R.hint.is_none();
    P.custom_nodes = static_cast<int64_t>(S.customs.size());
    if (want_hint) {
      for (int32_t o : S.customs) {
        if (R.hint_cache != nullptr) {
          const int64_t pos = cached_hint(o);
          if (pos >= 0) {
            pin_kind[o] = 2;
            put(o, R.factors.at(pos));
          }
          continue;
        }
        py::object v = R.hint(py_of(found[o]));
        if (!v.is_none()) {
          pin_kind[o] = 2;
          put(o, R.hint_positions ? R.factors.at(v.cast<int64_t>()) : v.cast<double>());
        }
      }
    }
    for (size_t k = 0; k < S.leaves.size(); ++k) {
      const int32_t o = S.leaves[k];
      const int64_t g = S.leaf_group[k];
      double v;
      if (g >= 0) {
        v = R.factors.at(g);
        ++P.owned_leaves;
        P.reached[g] = 1;
      } else if (!unowned_pin(o, static_cast<AccumulateGrad*>(found[o])->variable, &v)) {
        continue;
      }
      pin_kind[o] = 1;
      put(o, v);
    }
    extra_pos_.clear();
    for (size_t k = 0; k < R.extra_nodes.size(); ++k) {
      int64_t j = R.extra_nodes[k] ? P.index.get(R.extra_nodes[k]) : -1;
      extra_pos_.push_back(static_cast<int32_t>(j));
      if (j >= 0) put(static_cast<int32_t>(j), R.extra_values[k]);
    }
    // NOTE [ Nested backward through the enclosing graph ]: nodes an enclosing
    // plan already hooks keep its potential and get no edge multipliers here.
    if (R.has_outer()) {
      for (int32_t o = 0; o < n; ++o) {
        double seen;
        if (!S.is_leaf[o] && R.seen_phi(found[o], &seen)) {
          put(o, seen);
          enclosed[o] = 1;
        }
      }
    }
    return trivial;
  }

  // Kahn's algorithm, same queue discipline as the Python walker; then the
  // distinct pin values as bits, in the Python planner's pin-dict order
  // (leaves, hinted Function nodes, inputs=, enclosed; each with its final
  // value), so tie-breaks by bit match.
  void order() {
    const int32_t n = n_;
    auto& indeg = S.indeg;
    auto& order = S.order;
    indeg.assign(n, 0);
    for (int32_t j : S.kids)
      if (j >= 0) ++indeg[j];
    order.clear();
    order.reserve(n);
    for (int32_t v = 0; v < n; ++v)
      if (indeg[v] == 0) order.push_back(v);
    for (size_t k = 0; k < order.size(); ++k) {
      int32_t o = order[k];
      for (int32_t e = S.kid_start[o]; e < S.kid_start[o + 1]; ++e) {
        int32_t j = S.kids[e];
        if (j >= 0 && --indeg[j] == 0) order.push_back(j);
      }
    }
    if (static_cast<int32_t>(order.size()) != n)
      throw std::runtime_error("graphscale: internal invariant broken: the grad_fn graph has a cycle. "
                               "This is a bug in graphscale.");
    auto& pinned = S.pinned;
    auto& mark = S.mark;
    pinned.clear();
    mark.assign(n, 0);
    auto take = [&](int32_t o) {
      if (!mark[o]) {
        mark[o] = 1;
        pinned.push_back(o);
      }
    };
    for (int32_t o : order)
      if (S.pin_kind[o] == 1) take(o);
    for (int32_t o : order)
      if (S.pin_kind[o] == 2) take(o);
    for (int32_t j : extra_pos_)
      if (j >= 0) take(j);
    for (int32_t o : order)
      if (S.enclosed[o]) take(o);
    values_.clear();
    auto& pin_bit = S.pin_bit;
    pin_bit.assign(n, -1);
    for (int32_t o : pinned) {
      int b = bit_of(S.pin_value[o]);
      if (b < 0) {
        values_.push_back(S.pin_value[o]);
        b = static_cast<int>(values_.size() - 1);
      }
      pin_bit[o] = b;
    }
    if (values_.size() > 64) throw std::overflow_error("graphscale: more than 64 distinct factors; native planner declines");
  }

  // Bottom-up: the pin values reachable from each node (bitmask), and the
  // value it would take on its own (votes of its children where mixed).
  void bottom_up() {
    const int32_t n = n_;
    const int nvals = static_cast<int>(values_.size());
    auto& reach = S.reach;
    auto& choice = S.choice;
    auto& vote_at = S.vote_at;  // offset into tallies for mixed nodes
    auto& tallies = S.tallies;
    reach.assign(n, 0);
    choice.assign(n, -1);
    vote_at.assign(n, -1);
    tallies.clear();
    for (int32_t p = n - 1; p >= 0; --p) {
      const int32_t v = S.order[p];
      uint64_t m = 0;
      for (int32_t e = S.kid_start[v]; e < S.kid_start[v + 1]; ++e)
        if (S.kids[e] >= 0) m |= reach[S.kids[e]];
      int pb = S.pin_bit[v];
      if (pb >= 0) {
        m |= (uint64_t{1} << pb);
        choice[v] = pb;
      } else if ((m & (m - 1)) == 0) {
        choice[v] = m ? 63 - __builtin_clzll(m) : -1;
      } else {
        int32_t off = static_cast<int32_t>(tallies.size());
        tallies.resize(off + nvals, 0);
        for (int32_t e = S.kid_start[v]; e < S.kid_start[v + 1]; ++e) {
          int32_t c = S.kids[e];
          if (c >= 0 && choice[c] >= 0) ++tallies[off + choice[c]];
        }
        vote_at[v] = off;
        int best = 0;
        for (int b = 1; b < nvals; ++b)
          if (tallies[off + b] > tallies[off + best]) best = b;
        choice[v] = best;
      }
      reach[v] = m;
    }
  }

  double potential_of(int32_t v, double parent) const {
    int b = S.choice[v];
    if (b < 0) return parent;
    int32_t off = S.vote_at[v];
    if (off >= 0 && S.pin_bit[v] < 0) {
      int pb = bit_of(parent);
      if (pb >= 0 && S.tallies[off + pb] == S.tallies[off + b]) return parent;
    }
    return values_[b];
  }

  // Top-down: the first parent (in topological order) decides.
  void top_down() {
    std::vector<double>& phi = P.phi_disc;
    phi.assign(n_, 0.0);
    auto& set = S.set;
    set.assign(n_, 0);
    for (int32_t u : S.order) {
      if (!set[u]) {
        phi[u] = potential_of(u, R.base);
        set[u] = 1;
      }
      const double pu = phi[u];
      for (int32_t e = S.kid_start[u]; e < S.kid_start[u + 1]; ++e) {
        int32_t c = S.kids[e];
        if (c >= 0 && !set[c]) {
          phi[c] = potential_of(c, pu);
          set[c] = 1;
        }
      }
    }
  }

  // Edge multipliers, in topological order of their nodes, then the seeds.
  void multipliers(const std::vector<Node*>& root_nodes) {
    const std::vector<double>& phi = P.phi_disc;
    for (int32_t u : S.order) {
      const double pu = phi[u];
      const int32_t e0 = S.kid_start[u], e1 = S.kid_start[u + 1];
      int32_t e = e0;
      while (e < e1 && (S.kids[e] < 0 || phi[S.kids[e]] == pu)) ++e;
      if (e == e1 || S.enclosed[u]) continue;
      std::vector<std::pair<int64_t, double>> row;
      for (; e < e1; ++e) {
        int32_t c = S.kids[e];
        if (c >= 0 && phi[c] != pu) row.emplace_back(e - e0, phi[c] / pu);
      }
      P.multiplications += static_cast<int64_t>(row.size());
      P.hook_nodes.push_back(u);
      P.hook_mults.push_back(std::move(row));
    }
    for (size_t r = 0; r < root_nodes.size(); ++r) {
      if (root_nodes[r] == nullptr) continue;
      P.seeds[r] = phi[P.index.get(root_nodes[r])] / R.base;
      if (P.seeds[r] != 1.0) ++P.multiplications;
    }
  }
};

// Plan `root_nodes` for `req` with this thread's scratch arrays.
static NativePlan plan_core(py::object roots, const std::vector<Node*>& root_nodes, const Request& req) {
  static thread_local Scratch tls_scratch;
  static thread_local size_t last_top = 0, last_nested = 0;  // node counts: first guess of the index size
  Scratch local;
  Scratch& S = tls_scratch.busy ? local : tls_scratch;
  struct Busy {
    Scratch& s;
    explicit Busy(Scratch& s_) : s(s_) { s.busy = true; }
    ~Busy() { s.busy = false; }
  } busy(S);
  NativePlan P;
  P.roots = std::move(roots);
  size_t& last = req.nested ? last_nested : last_top;
  Planner(req, S, P).run(root_nodes, last);
  last = static_cast<size_t>(P.num_nodes);
  return P;
}

// The plan of graphscale/_backward/pyplan.py build (_backward/decide.py native_plan builds
// this call).  roots: Python Nodes or None.  outer_phi: None, a callable
// (node -> potential or None), or a list of the enclosing NativePlans,
// innermost last.
static NativePlan plan(const py::list& roots, py::object owners, const std::vector<double>& factors,
                       double base, py::object carrier, int policy, py::object param_type,
                       const py::list& extra_nodes, const std::vector<double>& extra_values,
                       py::object outer_phi, py::object hint) {
  if (extra_nodes.size() != extra_values.size()) throw std::invalid_argument("graphscale: extra pins sizes differ");
  Request req;
  req.owners_obj = owners;
  req.owners = &owners.cast<const Owners&>();
  req.factors = factors;
  req.base = base;
  req.nested = !carrier.is_none();
  req.carrier = req.nested ? carrier.cast<double>() : 0.0;
  if (policy < kAny || policy > kPlain) throw std::invalid_argument("graphscale: unknown unowned policy");
  req.policy = policy;
  req.param_type = param_type;
  for (size_t k = 0; k < extra_nodes.size(); ++k) req.extra_nodes.push_back(node_of(extra_nodes[k].ptr()));
  req.extra_values = extra_values;
  req.hint = hint;
  std::vector<const NativePlan*> outer_plans;
  if (py::isinstance<py::list>(outer_phi)) {
    py::list lst = outer_phi.cast<py::list>();
    for (size_t k = lst.size(); k-- > 0;) outer_plans.push_back(lst[k].cast<const NativePlan*>());
    req.outer_plans = &outer_plans;
    req.outer_phi = py::none();
  } else {
    req.outer_phi = outer_phi;
  }
  std::vector<Node*> root_nodes(roots.size(), nullptr);
  for (size_t r = 0; r < roots.size(); ++r) root_nodes[r] = node_of(roots[r].ptr());
  return plan_core(roots, root_nodes, req);
}

// Root nodes as graphscale/_core/walk.py root_node reads them: an edge's node,
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

// Before the fast path (NOTE [ Fast path ] in graphscale/_backward/entry.py): does a
// backward of `roots` reach an owned leaf, and may it skip planning?  A
// breadth-first walk that stops as soon as the answer is known: at the first
// owned leaf under unowned="any"; under "plain_params" once an owned leaf and
// an unowned nn.Parameter are both seen (else it walks everything); under
// "plain" once an owned leaf and any unowned leaf are.  Returns 0: no owned
// leaf, 1: the fast path is exact, 2: plan; plus 4 when a custom-Function
// node was seen (it may run a nested backward over leaves no walk can see:
// reentrant checkpointing; the backward then binds its task so that such a
// nested backward is planned, NOTE [ Fast path ]).
static int probe_nodes(const std::vector<Node*>& root_nodes, const Owners& owners, int policy,
                       py::handle param_type) {
  static thread_local NodeIndex index;
  static thread_local std::vector<Node*> found;
  static thread_local size_t last = 0;
  index.reserve(last);
  found.clear();
  seed_roots(root_nodes, &index, &found);
  bool ins, owned = false, unowned = false, hidden = false;
  int result = -1;
  constexpr size_t kAhead = 8;  // as in discover(): a fresh graph's walk waits on memory
  for (size_t i = 0; i < found.size() && result < 0; ++i) {
    if (i + kAhead < found.size()) {
      const auto& ahead = found[i + kAhead]->next_edges();
      if (!ahead.empty()) __builtin_prefetch(ahead.data());
    }
    Node* node = found[i];
    const auto& next = node->next_edges();
    if (next.empty() && is_accumulate_grad(node)) {
      const auto& var = static_cast<AccumulateGrad*>(node)->variable;
      if (owners.group(node) >= 0) {
        owned = true;
        if (policy == kAny) result = 1;
      } else if (policy == kPlain || (policy == kPlainParams && is_parameter(var, param_type))) {
        unowned = true;
      }
      if (owned && unowned) result = 2;
      continue;
    }
    if (!hidden && is_py_node(node)) hidden = true;
    for (const auto& e : next) {
      Node* nxt = e.function.get();
      if (nxt == nullptr) continue;
      index.get_or_insert(nxt, static_cast<int64_t>(found.size()), &ins);
      if (ins) {
        found.push_back(nxt);
        __builtin_prefetch(nxt);
        __builtin_prefetch(reinterpret_cast<const char*>(nxt) + 64);
      }
    }
  }
  last = found.size();
  found.clear();
  if (result < 0) result = owned ? 1 : 0;
  return result | (hidden ? 4 : 0);
}

static int probe(const py::tuple& roots, py::object owners_obj, int policy, py::handle param_type) {
  const Owners& owners = owners_obj.cast<const Owners&>();
  std::vector<Node*> root_nodes;
  std::vector<NodePtr> leaf_roots;
  if (!root_nodes_of(roots, &root_nodes, &leaf_roots)) throw py::type_error("graphscale: probe got a root that is neither a tensor nor an edge");
  return probe_nodes(root_nodes, owners, policy, param_type);
}

// ===================================================================== the governed backward, natively
//
// NOTE [ One native call per backward ]
// graphscale/_backward/entry.py reads the call and the factors (Python: GAS
// may be a callable, an engine's attribute) and graphscale/_backward/route.py
// hands the rest to one call here: Governor.top for a top-level backward,
// govern_nested for one called from inside a node's backward (NOTE [ Nested
// backward ] in graphscale/_backward/entry.py).  That call decides (left
// alone, the fast path, a plan: graphscale/_backward/decide.py decide),
// walks and plans, scales the seeds, puts each edge multiplier on its node as
// a C++ FunctionPostHook (ScaleHook: no Python when it fires), binds the
// graph task (BindNode, a node of its own in front of the roots, so before
// any output hook: NOTE [ Which snapshot an output hook obeys ] in
// graphscale/_backward/running.py; NOTE [ Binding without touching a shared
// node ]), registers the plan for nested backwards,
// calls the original torch.autograd.backward, and takes every hook, binding
// and registration back in a destructor (Undo), on every exit.  It declines
// (returns the reason as a short str, having touched nothing) what the
// Python route handles: a call it cannot read ("call"), a seed it cannot
// make ("seed"), more than 64 factors ("factors").  Python declines before
// the call what the native hooks cannot do (inputs=, compiled autograd: NOTE
// [ Which route governs a backward ] in graphscale/_backward/route.py).  Same
// decisions, same plans, same seeds as the Python route
// (tests/test_native_route.py runs the suite's graphs through both).
//
// NOTE [ One running state, both routes ]
// What is running is kept once, here, for both routes while this module is
// loaded: the registry of walked plans whose backward runs (RunningEntry:
// NativePlans, or a Python route's plan past 64 factors), the lookup of the
// plan a nested backward runs inside (find_enclosing: the registry, else the
// task's binding), the Binding class, and the binding node (BindNode).  The
// Python route registers, looks up and binds through the same functions
// (graphscale/_backward/running.py dispatches to them); running.py's Python
// equivalents run only where this module is not loaded, and its Python
// binding hook also under compiled autograd, which lifts Python hooks only.
// The graph task -> Binding map is one Python dict (running._by_task) that
// both kinds of hook write, so output hooks read one map either way.

// Process-wide Python objects the route needs (native.configure, once).
struct Registry {
  py::object by_task;      // graphscale._backward.running._by_task: graph task id -> Binding
  py::object call_module;  // graphscale._backward.call: ORIGINAL_BACKWARD is torch.autograd.backward as torch defined it
  py::object param_type;   // torch.nn.Parameter
  py::object carries_attr; // graphscale._backward.frames.CARRIES_ATTR: what a root's seed carries already
  py::object innermost;    // graphscale._backward.frames.innermost: this thread's top-level on_failure list
};

// A decline: the reason (a short str) the Python route takes the backward
// for, having touched nothing (graphscale/_backward/route.py counts it: NOTE [ Which
// route governs a backward ] there).
static py::object declined(const char* why) { return py::str(why); }
static Registry* registry = nullptr;  // leaked on purpose: outlives the interpreter's teardown order

static void configure(py::object by_task, py::object call_module, py::object param_type, py::object module_type_,
                      py::object carries_attr, py::object innermost) {
  if (registry == nullptr) registry = new Registry();
  Py_XDECREF(module_type);
  module_type = module_type_.inc_ref().ptr();
  *registry = Registry{by_task, call_module, param_type, carries_attr, innermost};
}

#ifdef GRAPHSCALE_TEST_SEAMS
// The test build only (graphscale/_native/build.py, variant "seams";
// tests/_seams.py loads it): hooks made and alive of each kind, ScaleHook
// calls (hook_tally); the ScaleHook call that takes inject_failure_in to 0
// throws (0: none does); may_bind False: no graph task is bound (tests that
// break the binding on purpose).
static std::atomic<int64_t> inject_failure_in{0};
static std::atomic<int64_t> scale_made{0}, scale_live{0}, bind_made{0}, bind_live{0}, scale_calls{0};
static std::atomic<bool> may_bind{true};
#define GS_SEAM(...) __VA_ARGS__
#else
#define GS_SEAM(...)
#endif

using Clock_ = std::chrono::steady_clock;
static int64_t ns_since(Clock_::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock_::now() - t0).count();
}

// One edge multiplier row on one node: grad_inputs[k] (flowing along
// next_edges[k]) times m.  What graphscale/_backward/hooks.py post_hook does.
class ScaleHook : public torch::autograd::FunctionPostHook {
 public:
  ScaleHook(std::vector<std::pair<int64_t, double>> mults, std::shared_ptr<std::atomic<int64_t>> ns)
      : mults_(std::move(mults)), ns_(std::move(ns)) {
    GS_SEAM(++scale_made; ++scale_live;)
  }
  ~ScaleHook() override { GS_SEAM(--scale_live;) }
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    const auto t0 = Clock_::now();
    GS_SEAM(++scale_calls;
            if (inject_failure_in.load(std::memory_order_relaxed) > 0 && inject_failure_in.fetch_sub(1) == 1)
                throw std::runtime_error("graphscale: a hook failure injected by a test");)
    torch::autograd::variable_list out(outputs);
    for (const auto& km : mults_) {
      const size_t k = static_cast<size_t>(km.first);
      if (k < out.size() && out[k].defined()) out[k] = out[k].mul(km.second);
    }
    ns_->fetch_add(ns_since(t0), std::memory_order_relaxed);
    return out;
  }

 private:
  std::vector<std::pair<int64_t, double>> mults_;
  std::shared_ptr<std::atomic<int64_t>> ns_;
};

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

// A running graph task's binding (NOTE [ Which snapshot an output hook
// obeys ] in graphscale/_backward/running.py; NOTE [ One running state, both
// routes ]): the Reading that governs the task; where no plan of it exists,
// the potential everything in it carries (None: nested backwards are left
// alone; NOTE [ Fast path ] in graphscale/_backward/entry.py), with the
// snapshot's Governor and the factors to plan them natively; `once` and
// `on_failure` shared with the binding of the task it runs inside (NOTE [
// Once per backward ] in running.py, NOTE [ A backward that raised ] in
// graphscale/_backward/frames.py); `reference`: a reference pass (audit).
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
  if (enclosing != nullptr) {  // a native Binding, or running.py's Python one (a reference pass)
    py::handle e(enclosing);
    b.once = e.attr("once");
    b.on_failure = e.attr("on_failure");
    b.reference = b.reference || e.attr("reference").cast<bool>();
  } else {
    b.once = py::reinterpret_steal<py::object>(PySet_New(nullptr));
    b.on_failure = on_failure.is_none() ? registry->innermost() : on_failure;
  }
  return py::cast(std::move(b));
}

// What one backward's binding hooks share: the Binding, the tasks they bound.
struct BindState {
  PyObject* binding = nullptr;  // strong; released by Undo, with the GIL
  std::mutex mu;
  std::vector<int> tasks;
};

// NOTE [ Binding without touching a shared node ]
// A graph task is bound when it runs its first node.  This used to be a
// pre-hook put first in the root nodes' tensor_pre_hooks and erased after
// the backward.  Those lists are plain std::vectors that torch's engine
// iterates with no lock and no GIL (call_tensor_pre_hooks), and a root node
// is shared by every backward of the same graph: a backward on another
// thread (retain_graph, one graph, torch's TestMultithreadAutograd
// test_multi_grad_all_hooks) iterated the vector while this thread inserted
// or erased, and read a freed or moved-from hook (SIGSEGV in
// call_tensor_pre_hooks, 7 runs in 25 of that test; issue 38).  Now the
// binding is a node of its own, made for this one backward (BindNode): its
// next edges are the roots' edges, its input metadata theirs, and torch is
// handed GradientEdges to it in place of the roots.  It runs before every
// root node, so before any output hook, as the pre-hook did; no other
// backward can reach it, so nothing any other thread runs is changed.
// Freed with the roots handed to torch, once the backward is over.
namespace {
class BindNode : public Node {
 public:
  BindNode(std::shared_ptr<BindState> st, torch::autograd::edge_list&& next)
      : Node(std::move(next)), st_(std::move(st)) {
    GS_SEAM(++bind_made; ++bind_live;)
  }
  ~BindNode() override { GS_SEAM(--bind_live;) }
  std::string name() const override { return "GraphscaleBindBackward"; }
  // Records graph task id -> Binding in graphscale._backward.running._by_task
  // (running.py's Python hook does the same) and passes the seeds on.
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const int tid = torch::autograd::get_current_graph_task_id();
    if (tid < 0) return std::move(grads);
    py::gil_scoped_acquire gil;
    PyObject* key = PyLong_FromLong(tid);
    if (key != nullptr && st_->binding != nullptr) {
      PyObject* dict = registry->by_task.ptr();
      if (PyDict_Contains(dict, key) == 0 && PyDict_SetItem(dict, key, st_->binding) == 0) {
        std::lock_guard<std::mutex> lock(st_->mu);
        st_->tasks.push_back(tid);  // only what this binding put there is taken out again
      }
    }
    Py_XDECREF(key);
    PyErr_Clear();
    return std::move(grads);
  }

 private:
  std::shared_ptr<BindState> st_;
};

PyTypeObject bind_node_type{};  // its Python type (registered at import: GradientEdge needs a Python node)

template <typename P>
struct MakeNode;
template <typename T>
struct MakeNode<std::shared_ptr<T>> {
  template <typename N, typename... A>
  static std::shared_ptr<T> make(A&&... a) { return std::make_shared<N>(std::forward<A>(a)...); }
};
template <typename T>
struct MakeNode<c10::intrusive_ptr<T>> {
  template <typename N, typename... A>
  static c10::intrusive_ptr<T> make(A&&... a) { return c10::make_intrusive<N>(std::forward<A>(a)...); }
};
}  // namespace

// The registry of walked plans whose backward is running, any thread,
// innermost last (NOTE [ One running state, both routes ]).  `plan` is null
// for a Python route's Python plan (past 64 factors: asked through
// phi_of).  Changed and read with the GIL held only.
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
};
static std::vector<RunningEntry> native_running;
static uint64_t next_token = 1;

static uint64_t push_running(PlanPtr plan, py::object plan_obj, py::object reading) {
  const uint64_t token = next_token++;
  native_running.push_back(RunningEntry{std::move(plan), plan_obj.release().ptr(), reading.release().ptr(), token});
  return token;
}

static void pop_running(uint64_t token) {
  for (size_t i = native_running.size(); i-- > 0;)
    if (native_running[i].token == token) {
      PlanPtr plan = std::move(native_running[i].plan);  // freed last: freeing may run Python
      PyObject* plan_obj = native_running[i].plan_obj;
      PyObject* reading = native_running[i].reading;
      native_running.erase(native_running.begin() + static_cast<std::ptrdiff_t>(i));
      Py_XDECREF(plan_obj);
      Py_DECREF(reading);
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
  std::vector<const NativePlan*> outer_plans;  // every running NativePlan, innermost first (the kPlan one too)
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
      py::object plan = py::reinterpret_borrow<py::object>(e.plan_obj);
      if (plan.attr("phi_of")(py_of(node)).is_none()) continue;
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
      py::object plan = py::reinterpret_borrow<py::object>(e.plan_obj);
      py::object phi = plan.attr("phi_of")(obj);
      if (!phi.is_none()) return phi;
      continue;
    }
    const int64_t i = e.plan->index.get(node);
    if (i >= 0) return py::float_(e.plan->phi_disc[i]);
  }
  return py::none();
}

// NOTE [ Hooks on shared nodes ]
// A node's hook lists are plain std::vectors that torch's engine iterates
// with no lock and no GIL, on every thread that runs the node, and a hook on
// a node applies to every graph task that runs it.  A backward whose plan
// puts edge multipliers on nodes (several factors among the leaves one graph
// reaches) adds them to those nodes' post-hooks and removes them after: were
// another backward running over the same nodes at that moment, on another
// thread (retain_graph, one graph), it would read the vector while it moves
// (SIGSEGV: 5 threads on one two-factor graph died within 40 rounds) and
// take those multipliers as its own (wrong gradients, on both routes).  So
// every top-level backward graphscale sees (governed, untouched, and every
// torch.autograd.grad while installed: graphscale/_backward/sharing.py)
// holds this process-wide lock while torch runs it: shared by a backward
// that changes no shared node, exclusive by one that hooks nodes.  Backwards
// over separate graphs, and every backward of a graph with one factor, run
// together as before; one that hooks runs alone.  A backward called from
// inside a running graph task (reentrant checkpointing's recompute) takes
// nothing: the backward it runs inside holds the lock for it, and waiting
// there could wait for itself.  The nodes such a nested backward hooks are
// those of the graph its node built, which no other backward reaches.  A
// waiting thread lets go of the GIL; an exclusive waiter stops new shared
// holders (a stream of overlapping backwards on other threads cannot starve
// it).  The Python route holds the same lock (hold() below) once this
// module is loaded, and a lock of its own before (sharing.py).
struct HookLock {
  std::mutex mu;
  std::condition_variable cv;
  int64_t shared = 0;
  int64_t waiting = 0;  // exclusive waiters
  bool exclusive = false;
};
HookLock hook_lock;

struct Hold {
  bool exclusive = false;
  bool held = false;

  explicit Hold(bool exclusive_) : exclusive(exclusive_) {}
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
  ~Hold() { leave(); }

  bool free_now() const {
    return !hook_lock.exclusive && (exclusive ? hook_lock.shared == 0 : hook_lock.waiting == 0);
  }
  void take() { exclusive ? (void)(hook_lock.exclusive = true) : (void)++hook_lock.shared; }

  // Call with the GIL held; returns with it held.
  void enter() {
    if (held || torch::autograd::get_current_graph_task_id() >= 0) return;
    {
      std::lock_guard<std::mutex> lock(hook_lock.mu);
      if (free_now()) {
        take();
        held = true;
        return;
      }
    }
    py::gil_scoped_release nogil;  // the holder may need it to finish
    std::unique_lock<std::mutex> lock(hook_lock.mu);
    if (exclusive) ++hook_lock.waiting;
    hook_lock.cv.wait(lock, [this] {
      return !hook_lock.exclusive && (exclusive ? hook_lock.shared == 0 : hook_lock.waiting == 0);
    });
    if (exclusive) --hook_lock.waiting;
    take();
    held = true;
  }
  void leave() {
    if (!held) return;
    held = false;
    {
      std::lock_guard<std::mutex> lock(hook_lock.mu);
      exclusive ? (void)(hook_lock.exclusive = false) : (void)--hook_lock.shared;
    }
    hook_lock.cv.notify_all();
  }
};

// Everything one governed backward added, taken back when it goes out of
// scope (normal return or exception); runs with the GIL held.
struct Undo {
  std::vector<std::pair<Node*, uintptr_t>> posts;
  std::vector<NodePtr> keep;  // the nodes hooked, alive until unhooked
  std::shared_ptr<BindState> bind;
  uint64_t token = 0;  // the registry entry (0: none)
  std::shared_ptr<std::atomic<int64_t>> hook_ns = std::make_shared<std::atomic<int64_t>>(0);
  int64_t* off_ns = nullptr;

  Undo() = default;
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  ~Undo() {
    const auto t0 = Clock_::now();
    for (auto& pk : posts) pk.first->del_post_hook(pk.second);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);  // a pending Python error survives the clean-up
    if (token != 0) pop_running(token);
    if (bind) {
      std::vector<int> tasks;
      {
        std::lock_guard<std::mutex> lock(bind->mu);
        tasks.swap(bind->tasks);
      }
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

  // Bind the graph task of a backward of `roots` to `binding`: the roots to
  // hand torch instead, GradientEdges to a BindNode of this backward's own
  // (NOTE [ Binding without touching a shared node ]).  `roots`: tensors
  // that need a gradient, or GradientEdges.
  py::tuple bind_roots(const py::tuple& roots, py::object binding) {
    GS_SEAM(if (!may_bind.load()) return roots;)
    static PyObject* edge_type =
        py::object(py::module_::import("torch.autograd.graph").attr("GradientEdge")).release().ptr();
    bind = std::make_shared<BindState>();
    bind->binding = binding.release().ptr();
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
      PyObject* edge = PyObject_CallFunction(edge_type, "On", pynode.ptr(), static_cast<Py_ssize_t>(r));
      if (edge == nullptr) throw py::error_already_set();
      out[r] = py::reinterpret_steal<py::object>(edge);
    }
    return out;
  }
};

// What Governor.top and govern_nested return when asked for stats:
// (kind: 0 left alone, 1 fast path, 2 planned; nodes walked; multiplications;
// ns of walk+plan, seeds, hooks on, bind, hook calls, hooks off).
enum Kind : int { kUntouched = 0, kFast = 1, kPlanned = 2 };
struct Outcome {
  int kind = kUntouched;
  int64_t nodes = 0, multiplications = 0;
  int64_t ns[6] = {0, 0, 0, 0, 0, 0};
  py::object stats() const {
    return py::make_tuple(kind, nodes, multiplications, ns[0], ns[1], ns[2], ns[3], ns[4], ns[5]);
  }
};

// Seeds: grads[r] times mults[r] (None where the seed is torch's implicit
// one of a scalar tensor: full of mults[r]).  False where a seed cannot be
// made here (a non-tensor seed, a non-scalar implicit seed, an edge's
// implicit seed): the Python route handles those.
static bool scaled_seeds(const py::tuple& roots, const py::list& grads, const std::vector<double>& mults,
                         py::list* out) {
  for (size_t r = 0; r < mults.size(); ++r) {
    py::object g = grads[r];
    if (mults[r] == 1.0) {
      out->append(g);
      continue;
    }
    if (g.is_none()) {
      PyObject* t = roots[r].ptr();
      if (!THPVariable_Check(t)) return false;
      const auto& var = THPVariable_Unpack(t);
      if (var.numel() != 1) return false;
      out->append(py::reinterpret_steal<py::object>(
          THPVariable_Wrap(at::full_like(var, mults[r], var.options(), at::MemoryFormat::Preserve))));
      continue;
    }
    if (!THPVariable_Check(g.ptr())) return false;
    out->append(py::reinterpret_steal<py::object>(THPVariable_Wrap(THPVariable_Unpack(g.ptr()).mul(mults[r]))));
  }
  return true;
}

// torch.autograd.backward as torch defined it, called positionally (tensors,
// grad_tensors, retain_graph, create_graph, grad_variables=None, inputs).
static void call_original(py::handle roots, py::handle seeds, py::handle retain, py::handle create,
                          py::handle inputs) {
  static PyObject* name = PyUnicode_InternFromString("ORIGINAL_BACKWARD");
  PyObject* fn = PyObject_GetAttr(registry->call_module.ptr(), name);
  if (fn == nullptr) throw py::error_already_set();
  PyObject* args[6] = {roots.ptr(), seeds.ptr(), retain.ptr(), create.ptr(), Py_None, inputs.ptr()};
  PyObject* out = PyObject_Vectorcall(fn, args, 6, nullptr);
  Py_DECREF(fn);
  if (out == nullptr) throw py::error_already_set();
  Py_DECREF(out);
}

// Root nodes of a call, kept alive, and the call's flags (retain_graph,
// create_graph, inputs).  False where the native route declines it: a seed
// count that differs, a root neither a tensor nor an edge, or one that needs
// no grad (torch raises its own error; the Python route lets it).
struct Roots {
  py::tuple roots;
  py::list grads;
  std::vector<Node*> nodes;
  std::vector<NodePtr> leaf_roots;
  py::object retain_graph, create_graph, inputs;

  bool read(const py::tuple& roots_, const py::list& grads_, const py::tuple& flags) {
    roots = roots_;
    grads = grads_;
    retain_graph = flags[0];
    create_graph = flags[1];
    inputs = flags[2];
    if (py::len(grads) != roots.size() || !root_nodes_of(roots, &nodes, &leaf_roots)) return false;
    for (Node* n : nodes)
      if (n == nullptr) return false;
    return true;
  }
};

// Everything but the decision: seeds, hooks, registration, binding, the
// original backward.  `plan_owner`: the NativePlan (null unless planned);
// `binding`: the task's Binding (None: not bound).
struct Apply {
  Roots call;
  py::object reading;
  PlanPtr plan_owner;
  NativePlan* plan = nullptr;
  std::vector<double> mults;  // per root
  py::object binding = py::none();
  py::list seeds;  // what torch is handed (make_seeds)
};

// The seeds of `a.mults` into `a.seeds`, before anything is touched; false
// where one cannot be made here (the Python route makes or refuses it).
static bool make_seeds(Apply& a, Outcome* oc) {
  const auto t0 = Clock_::now();
  bool scaled = false;
  for (double m : a.mults) scaled = scaled || m != 1.0;
  if (!scaled) {
    a.seeds = a.call.grads;
  } else if (!scaled_seeds(a.call.roots, a.call.grads, a.mults, &a.seeds)) {
    return false;
  }
  oc->ns[1] = ns_since(t0);
  return true;
}

static void run_applied(Apply& a, Outcome* oc) {
  auto t0 = Clock_::now();
  Hold hold(a.plan != nullptr && !a.plan->hook_nodes.empty());  // NOTE [ Hooks on shared nodes ]
  hold.enter();
  Undo undo;  // (unhooks before `hold` lets go)
  undo.off_ns = &oc->ns[5];
  if (a.plan != nullptr) {
    const NativePlan& P = *a.plan;
    for (size_t h = 0; h < P.hook_nodes.size(); ++h) {
      Node* node = P.found[P.hook_nodes[h]];
      undo.keep.push_back(node->getptr());
      undo.posts.emplace_back(node, node->add_post_hook(std::make_unique<ScaleHook>(P.hook_mults[h], undo.hook_ns)));
    }
    undo.token = push_running(a.plan_owner, py::object(), a.reading);
  }
  oc->ns[2] = ns_since(t0);
  t0 = Clock_::now();
  py::tuple roots = a.call.roots;
  if (!a.binding.is_none()) roots = undo.bind_roots(a.call.roots, std::move(a.binding));
  oc->ns[3] = ns_since(t0);
  call_original(roots, a.seeds, a.call.retain_graph, a.call.create_graph, a.call.inputs);
  oc->ns[4] = undo.hook_ns->load();
}

static Request request_of(const Governor& g, const std::vector<double>& factors) {
  Request req;
  req.owners_obj = g.owners_obj;
  req.owners = g.owners;
  req.factors = factors;
  req.policy = g.policy;
  req.param_type = registry->param_type;
  req.hint = g.hint;
  req.hint_positions = true;
  req.hint_cache = g.hints.get();
  req.outer_phi = py::none();
  return req;
}

// Plan with `req`; false when the native planner declines (> 64 factors).
static bool plan_into(Apply& a, const Request& req, py::object gov_obj, Outcome* oc) {
  NativePlan P;
  try {
    P = plan_core(a.call.roots, a.call.nodes, req);
  } catch (const std::overflow_error&) {
    return false;
  }
  P.leaf_roots = std::move(a.call.leaf_roots);
  P.governor = gov_obj;
  a.plan_owner = std::make_shared<NativePlan>(std::move(P));
  a.plan = a.plan_owner.get();
  oc->nodes = a.plan->num_nodes;
  return true;
}

// What each root's seed carries already: the tag an fp16 engine.scale()
// left on it (graphscale/_backward/frames.py CARRIES_ATTR), else `dflt` (an
// fp16 engine.backward's loss scale).
static std::vector<double> carries_of(const py::tuple& roots, double dflt) {
  std::vector<double> out(roots.size(), dflt);
  for (size_t r = 0; r < roots.size(); ++r) {
    PyObject* t = roots[r].ptr();
    if (!THPVariable_Check(t)) continue;
    PyObject** dictptr = _PyObject_GetDictPtr(t);
    if (dictptr == nullptr || *dictptr == nullptr) continue;
    PyObject* tag = PyDict_GetItem(*dictptr, registry->carries_attr.ptr());  // borrowed
    if (tag != nullptr) out[r] = PyFloat_AsDouble(tag);
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  return out;
}

// Governor.top: a top-level governed backward (graphscale/_backward/entry.py
// and python.py from the decision on).  factors: by group position;
// frame: (scaling, what the seeds carry by default, the backward's
// on_failure list), graphscale/_backward/frames.py.
static py::object govern_top(py::object self, const py::tuple& roots, const py::list& grads, py::object reading,
                             const py::tuple& flags, py::object frame, bool want_stats) {
  const Governor& g = self.cast<const Governor&>();
  Outcome oc;
  Apply a;
  if (!a.call.read(roots, grads, flags)) return declined("call");
  a.reading = reading;
  auto t0 = Clock_::now();
  const std::vector<double> factors = reading.attr("factor_list").cast<std::vector<double>>();
  const std::vector<double> carries = carries_of(roots, frame.attr("carries").cast<double>());
  bool same = true;
  for (double f : factors) same = same && f == factors[0];
  const double f = factors.empty() ? 1.0 : factors[0];
  bool carry_nothing = true;
  for (double c : carries) carry_nothing = carry_nothing && c == 1.0;
  bool plan_it = !same;
  double potential = std::nan("");
  if (same && !(f == 1.0 && carry_nothing)) {
    const int code = probe_nodes(a.call.nodes, *g.owners, g.policy, registry->param_type);
    const int verdict = code & 3;
    const bool hidden = code & 4;
    if (verdict == 0 && !hidden) {
    } else if (verdict == 0 && carry_nothing) {
      potential = 1.0;
    } else if (verdict == 1) {
      oc.kind = kFast;
      if (hidden && g.policy != kAny) potential = f;
      a.mults.resize(roots.size());
      for (size_t r = 0; r < carries.size(); ++r) a.mults[r] = f / carries[r];
    } else {
      plan_it = true;
    }
  }
  if (plan_it) {
    Request req = request_of(g, factors);
    if (!plan_into(a, req, self, &oc)) return declined("factors");
    const NativePlan& P = *a.plan;
    if (P.owned_leaves || P.custom_nodes) {
      oc.kind = kPlanned;
      a.mults.resize(roots.size());
      for (size_t r = 0; r < carries.size(); ++r) a.mults[r] = P.seeds[r] * P.base / carries[r];
    } else {
      a.plan = nullptr;
      a.plan_owner.reset();
    }
  }
  if (a.mults.empty()) a.mults.assign(roots.size(), 1.0);
  if (!make_seeds(a, &oc)) return declined("seed");
  oc.ns[0] = ns_since(t0) - oc.ns[1];  // the seeds are their own phase
  int64_t scaled = 0;
  for (double m : a.mults) scaled += m != 1.0;
  if (oc.kind == kPlanned) {
    const NativePlan& P = *a.plan;
    int64_t seed_mults = 0;
    for (double s : P.seeds) seed_mults += s != 1.0;
    oc.multiplications = P.multiplications - seed_mults + scaled;
    if (P.unowned_param_pos.size() && !P.custom_nodes && !g.warn.is_none()) g.warn(py::cast(a.plan_owner));
  } else {
    oc.multiplications = scaled;
  }
  const bool has_potential = !std::isnan(potential);
  if (has_potential || (g.hook_owners && (oc.kind != kPlanned || a.plan->tensor_hooks)))
    a.binding = make_binding(reading, has_potential ? py::object(py::float_(potential)) : py::none(),
                             frame.attr("on_failure"), false, has_potential ? self : py::none(), factors);
  run_applied(a, &oc);
  return want_stats ? oc.stats() : py::none();
}

// A request for a backward nested where `e` says (kPlan or kBound).
static Request nested_request(const Enclosing& e, py::object* gov_obj) {
  Request req;
  if (e.kind == Enclosing::kPlan) {
    const NativePlan* op = e.plan;
    *gov_obj = op->governor;
    req.owners_obj = op->owners;
    req.owners = op->owners_ptr;
    req.factors = op->factors;
    req.policy = op->policy;
    req.param_type = registry->param_type;
    req.hint = op->hint;
    req.hint_positions = op->hint_positions;
    req.hint_cache = op->hint_cache;
  } else {
    *gov_obj = e.binding->governor;
    req = request_of(gov_obj->cast<const Governor&>(), e.binding->factors);
  }
  req.base = req.carrier = e.phi;
  req.nested = true;
  req.outer_plans = &e.outer_plans;
  req.outer_phi = py::none();
  return req;
}

// A backward called from inside `current`'s backward (NOTE [ Nested
// backward ] in graphscale/_backward/entry.py; plan_nested then the Python
// route's plan step, natively).
static py::object govern_nested(py::handle current, const py::tuple& roots, const py::list& grads,
                                const py::tuple& flags, bool want_stats) {
  if (registry == nullptr) return declined("native walker not ready");
  Outcome oc;
  Apply a;
  if (!a.call.read(roots, grads, flags)) return declined("call");
  auto t0 = Clock_::now();
  const Enclosing e = find_enclosing(node_of(current.ptr()));
  if (e.kind == Enclosing::kPython) return declined("factors");
  if (e.kind == Enclosing::kNone) {  // ungoverned (or left alone): untouched, unbound
    call_original(roots, grads, a.call.retain_graph, a.call.create_graph, a.call.inputs);
    return want_stats ? oc.stats() : py::none();
  }
  a.reading = e.reading;
  py::object gov_obj;
  const Request req = nested_request(e, &gov_obj);
  if (!plan_into(a, req, gov_obj, &oc)) return declined("factors");
  const NativePlan& P = *a.plan;
  a.mults.assign(P.seeds.begin(), P.seeds.end());
  if (!make_seeds(a, &oc)) return declined("seed");
  oc.kind = kPlanned;
  oc.multiplications = P.multiplications;
  oc.ns[0] = ns_since(t0) - oc.ns[1];  // the seeds are their own phase
  if (gov_obj.cast<const Governor&>().hook_owners && P.tensor_hooks)
    a.binding = make_binding(e.reading, py::none(), py::none(), false, py::none(), {});
  run_applied(a, &oc);
  return want_stats ? oc.stats() : py::none();
}

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

static Bound make_bound(const py::tuple& roots, py::object binding) {
  Bound b;
  b.roots = roots;
  Roots call;
  if (!root_nodes_of(roots, &call.nodes, &call.leaf_roots))
    throw std::invalid_argument("graphscale: bound() got a root that is neither a tensor nor an edge");
  b.undo = std::make_unique<Undo>();
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "graphscale native walk + plan + governed backward (see graphscale/_core/plan.py NOTE [ Potentials ])";
  // module_local: the test build (tests/_seams.py) may be loaded beside this one.
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
  py::class_<Governor>(m, "Governor", py::module_local())
      .def(py::init<py::object, int, py::object, bool, py::object>())
      .def("top", [](py::object self, const py::tuple& roots, const py::list& grads, py::object reading,
                     const py::tuple& flags, py::object frame, bool stats) {
        return govern_top(self, roots, grads, reading, flags, frame, stats);
      });
  py::class_<Binding>(m, "Binding", py::module_local())
      .def_readonly("reading", &Binding::reading)
      .def_readonly("potential", &Binding::potential)
      .def_readonly("once", &Binding::once)
      .def_readonly("on_failure", &Binding::on_failure)
      .def_readonly("reference", &Binding::reference)
      .def_property_readonly("state", [](const Binding& b) { return b.reading.attr("state"); });
  py::class_<RunningPlan>(m, "RunningPlan", py::module_local())
      .def("__enter__", [](RunningPlan& self) {})
      .def("__exit__", [](RunningPlan& self, py::args) {
        if (self.token != 0) pop_running(self.token);
        self.token = 0;
      });
  torch::autograd::_initFunctionPyTypeObject(bind_node_type, "GraphscaleBindBackward", nullptr, nullptr);
  Py_INCREF(&bind_node_type);  // static: never freed
  torch::autograd::registerCppFunction(typeid(BindNode), &bind_node_type);
  m.def("configure", &configure);
  m.def("binding", &make_binding);
  m.def("running_plan", [](py::object plan, py::object reading) {
    RunningPlan r;
    PlanPtr native = py::isinstance<NativePlan>(plan) ? plan.cast<PlanPtr>() : nullptr;
    r.token = push_running(std::move(native), std::move(plan), std::move(reading));
    return r;
  });
  m.def("running", &running_entries);
  m.def("enclosing_phi", &enclosing_phi);
  m.def("nested_plan", &nested_plan);
  py::class_<Bound>(m, "Bound", py::module_local())
      .def("__enter__", [](Bound& self) { return self.roots; })
      .def("__exit__", [](Bound& self, py::args) {
        self.undo.reset();
        self.roots = py::tuple();  // the BindNode goes with the last reference to them
      });
  m.def("bound", &make_bound);
  py::class_<Hold>(m, "Hold", py::module_local())  // NOTE [ Hooks on shared nodes ], for the Python route
      .def(py::init<bool>())
      .def("__enter__", [](Hold& self) { self.enter(); })
      .def("__exit__", [](Hold& self, py::args) { self.leave(); });
  m.def("govern_nested", &govern_nested);
#ifdef GRAPHSCALE_TEST_SEAMS
  m.attr("seams") = true;
  m.def("hook_tally", []() {
    return py::make_tuple(scale_made.load(), scale_live.load(), bind_made.load(), bind_live.load(), scale_calls.load());
  });
  m.def("_inject_hook_failure", [](int64_t call) { inject_failure_in.store(call); });  // the call-th from now throws
  m.def("_set_may_bind", [](bool on) { may_bind.store(on); });
#else
  m.attr("seams") = false;
#endif
}
