// graphscale native walk + plan.
//
// The same computation as graphscale/_walk.py followed by graphscale/_plan.py
// (see NOTE [ Potentials ] there), done on the C++ autograd Nodes directly:
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
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::Node;

namespace {

// Node* -> dense index, open addressing (the walk's only per-node lookup).
// Key and value share a 16-byte slot: a probe touches one cache line.
class NodeIndex {
 public:
  void reserve(size_t n) {
    size_t cap = 64;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Slot{nullptr, -1});
    mask_ = cap - 1;
    size_ = 0;
  }
  // Index of `key`, or -1.
  int64_t get(const Node* key) const {
    if (slots_.empty()) return -1;
    size_t h = hash(key) & mask_;
    while (true) {
      const Slot& s = slots_[h];
      if (s.key == key) return s.val;
      if (s.key == nullptr) return -1;
      h = (h + 1) & mask_;
    }
  }
  // Index of `key`; inserts `fresh` when absent (then *inserted = true).
  int64_t get_or_insert(const Node* key, int64_t fresh, bool* inserted) {
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

 private:
  struct Slot {
    const Node* key;
    int64_t val;
  };
  static size_t hash(const Node* p) {
    uint64_t x = reinterpret_cast<uintptr_t>(p);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    size_t cap = old.empty() ? 64 : old.size() * 2;
    slots_.assign(cap, Slot{nullptr, -1});
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

// The C++ Node behind a Python grad_fn object (borrowed), or nullptr.
Node* node_of(PyObject* obj) {
  if (obj == Py_None) return nullptr;
  if (torch::autograd::THPCppFunction_Check(obj))
    return reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get();
  if (THPFunction_Check(obj)) return reinterpret_cast<THPFunction*>(obj)->cdata.get();
  throw py::type_error("graphscale: native walker got a root that is not an autograd Node");
}

bool is_accumulate_grad(const Node* n) { return typeid(*n) == typeid(AccumulateGrad); }
// Custom-Function nodes.  PyNode's type_info is not exported by torch, so
// compare the dynamic type's name, and remember its type_info once seen.
bool is_py_node(const Node* n) {
  static const std::type_info* pynode = nullptr;
  const std::type_info& ti = typeid(*n);
  if (&ti == pynode) return true;
  if (pynode != nullptr) return false;
  if (std::strcmp(ti.name(), "N5torch8autograd6PyNodeE") != 0) return false;
  pynode = &ti;
  return true;
}

py::object py_of(Node* n) {
  auto ptr = c10::intrusive_ptr<Node>::reclaim_copy(n);
  return py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(ptr));
}

}  // namespace

// Owned leaves of the installed groups: TensorImpl* -> group position.
// Built once per installed state, reused by every backward.
struct Owners {
  std::unordered_map<const c10::TensorImpl*, int> group_of;
  Owners(const std::vector<uintptr_t>& impls, const std::vector<int>& groups) {
    if (impls.size() != groups.size()) throw std::invalid_argument("graphscale: Owners sizes differ");
    group_of.reserve(impls.size() * 2);
    for (size_t i = 0; i < impls.size(); ++i)
      group_of.emplace(reinterpret_cast<const c10::TensorImpl*>(impls[i]), groups[i]);
  }
};

// What the governed backward needs from a plan, and the nested-backward lookup.
struct NativePlan {
  // The roots' Python objects keep every walked node alive (so addresses stay
  // unique).  Not C++ intrusive_ptrs: if the last owner of a deep graph were a
  // plain intrusive_ptr, freeing it would recurse down the chain; torch frees
  // graphs owned by Python objects and tensors iteratively.
  py::object roots;
  // AccumulateGrad nodes of leaf roots given as tensors (nested_plan): the
  // tensor holds them only weakly.  They have no next edges, so holding them
  // here cannot make a free recurse.
  std::vector<c10::intrusive_ptr<Node>> leaf_roots;
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
  std::vector<double> factors;
  bool raw = false;
  py::object hint;

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

// Scratch arrays of one plan, kept per thread so that a backward's plans
// (one per nested backward under reentrant checkpointing) do not allocate
// and clear them afresh.  A plan that starts while another is running on the
// same thread (a Python callback reentering) takes fresh ones.
struct Scratch {
  std::vector<int32_t> kid_start, kids, indeg, order, pinned, choice, vote_at, tallies;
  std::vector<char> is_leaf, pin_kind, has_pin, enclosed, mark, set;
  std::vector<double> pin_value;
  std::vector<int> pin_bit;
  std::vector<uint64_t> reach;
  bool busy = false;
};

// roots: Python Nodes or None.  factors[g]: factor of group g.  carrier: pin
// of unseen unowned non-Parameter leaves (nested backward) or None.  raw:
// unowned leaves pinned to 1.  extra_nodes/extra_values: more pins (non-leaf
// inputs=).  outer_phi: None, or a callable giving the potential an
// enclosing plan gave a node (None if unseen), or a list of the enclosing
// NativePlans, innermost last, asked directly; as in graphscale/_backward.py
// build_plan (NOTE [ Unowned leaves in nested backward ] and NOTE [ Nested
// backward through the enclosing graph ]).
// hint: None, or a callable giving a custom Function node's pin (or None),
// asked for every custom-Function node (NOTE [ Checkpoint hints ]).
//
// Nodes keep their discovery position throughout; the topological order is
// a permutation (order) walked where the Python planner walks its sorted
// list, so every order and tie-break is the same without renumbering edges.
// Where every pin equals base (no pin at all included), every node's
// potential is base and nothing is multiplied: the plan stops after the pins
// (the usual nested backward of a checkpointed block, NOTE [ Checkpoint
// hints ]), with the potentials the full computation would give.
// outer_plans: the enclosing NativePlans, innermost first, or null (then
// outer_phi, a callable or None, is asked).
static NativePlan plan_core(py::object roots, std::vector<Node*> root_nodes, py::object owners_obj, const std::vector<double>& factors,
                            double base, bool nested, double carrier_v, bool raw, py::handle param_type,
                            const py::list& extra_nodes, const std::vector<double>& extra_values,
                            const std::vector<const NativePlan*>* outer_plans, py::object outer_phi,
                            py::object hint) {
  const Owners& owners = owners_obj.cast<const Owners&>();
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
  P.roots = roots;
  P.owners = owners_obj;
  P.factors = factors;
  P.raw = raw;
  P.hint = hint;
  P.base = base;
  size_t& last = nested ? last_nested : last_top;
  const size_t nroots = root_nodes.size();
  std::vector<Node*>& found = P.found;
  NodeIndex& index = P.index;
  index.reserve(last);  // grows when the guess is short
  found.reserve(last + 16);
  bool ins;
  for (size_t r = 0; r < nroots; ++r) {
    Node* n = root_nodes[r];
    if (n == nullptr) continue;
    index.get_or_insert(n, static_cast<int64_t>(found.size()), &ins);
    if (ins) found.push_back(n);
  }
  // Breadth-first discovery (edges in CSR form, discovery positions).
  auto& kid_start = S.kid_start;
  auto& kids = S.kids;
  auto& is_leaf = S.is_leaf;
  kid_start.clear();
  kids.clear();
  is_leaf.clear();
  constexpr size_t kAhead = 8;  // prefetch distance: the walk is bound by memory latency on a fresh graph
  for (size_t i = 0; i < found.size(); ++i) {
    if (i + kAhead < found.size()) {
      const auto& ahead = found[i + kAhead]->next_edges();
      if (!ahead.empty()) __builtin_prefetch(ahead.data());
    }
    Node* node = found[i];
    kid_start.push_back(static_cast<int32_t>(kids.size()));
    const auto& next = node->next_edges();
    // AccumulateGrad has no next edges: test the type only where there are none.
    if (next.empty() && is_accumulate_grad(node)) {
      is_leaf.push_back(1);
      continue;
    }
    is_leaf.push_back(0);
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
  const int32_t n = static_cast<int32_t>(found.size());
  kid_start.push_back(static_cast<int32_t>(kids.size()));
  P.num_nodes = n;
  last = static_cast<size_t>(n);

  // Enclosing plans: native ones are looked up by Node*, others through Python.
  const bool outer_native = outer_plans != nullptr;
  const bool has_outer = outer_native || !outer_phi.is_none();
  auto seen_phi = [&](Node* node, double* out) -> bool {
    if (outer_native) {
      for (const NativePlan* op : *outer_plans) {
        int64_t i = op->index.get(node);
        if (i >= 0) {
          *out = op->phi_disc[i];
          return true;
        }
      }
      return false;
    }
    py::object seen = outer_phi(py_of(node));
    if (seen.is_none()) return false;
    *out = seen.cast<double>();
    return true;
  };

  // Pins, by discovery position.  pin_kind: 0 none, 1 leaf, 2 hinted Function
  // node; has_pin/pin_value: the final value (inputs= and enclosing plans
  // overwrite, as later insertions into the Python planner's pin dict do).
  auto& pin_kind = S.pin_kind;
  auto& has_pin = S.has_pin;
  auto& pin_value = S.pin_value;
  auto& enclosed = S.enclosed;
  pin_kind.assign(n, 0);
  has_pin.assign(n, 0);
  pin_value.assign(n, 0.0);
  enclosed.assign(n, 0);
  const bool want_hint = !hint.is_none();
  bool trivial = true;  // every pin so far equals base
  auto put = [&](int32_t o, double v) {
    has_pin[o] = 1;
    pin_value[o] = v;
    if (v != base) trivial = false;
  };
  for (int32_t o = 0; o < n; ++o) {
    if (!is_leaf[o]) {
      if (want_hint && is_py_node(found[o])) {
        py::object v = hint(py_of(found[o]));
        if (!v.is_none()) {
          pin_kind[o] = 2;
          put(o, v.cast<double>());
        }
      }
      continue;
    }
    const auto& var = static_cast<AccumulateGrad*>(found[o])->variable;
    auto it = owners.group_of.find(var.unsafeGetTensorImpl());
    double v;
    if (it != owners.group_of.end()) {
      v = factors.at(it->second);
    } else if (has_outer && seen_phi(found[o], &v)) {
    } else if (nested) {
      PyObject* obj = THPVariable_Wrap(var);
      if (obj == nullptr) throw py::error_already_set();
      int isparam = PyObject_IsInstance(obj, param_type.ptr());
      Py_DECREF(obj);
      if (isparam < 0) throw py::error_already_set();
      v = isparam ? 1.0 : carrier_v;
    } else if (raw) {
      v = 1.0;
    } else {
      continue;
    }
    pin_kind[o] = 1;
    put(o, v);
  }
  if (extra_nodes.size() != extra_values.size()) throw std::invalid_argument("graphscale: extra pins sizes differ");
  std::vector<int32_t> extra_pos;
  for (size_t k = 0; k < extra_nodes.size(); ++k) {
    Node* en = node_of(extra_nodes[k].ptr());
    int64_t j = en ? index.get(en) : -1;
    extra_pos.push_back(static_cast<int32_t>(j));
    if (j >= 0) put(static_cast<int32_t>(j), extra_values[k]);
  }
  // NOTE [ Nested backward through the enclosing graph ]: nodes an enclosing
  // plan already hooks keep its potential and get no edge multipliers here.
  if (has_outer) {
    for (int32_t o = 0; o < n; ++o) {
      if (is_leaf[o]) continue;
      double seen;
      if (seen_phi(found[o], &seen)) {
        put(o, seen);
        enclosed[o] = 1;
      }
    }
  }
  P.seeds.assign(nroots, 1.0);
  if (trivial) {  // every potential is base: no multiplication anywhere
    P.phi_disc.assign(n, base);
    return P;
  }

  // Kahn's algorithm, same queue discipline as the Python walker.
  auto& indeg = S.indeg;
  auto& order = S.order;
  indeg.assign(n, 0);
  for (int32_t j : kids)
    if (j >= 0) ++indeg[j];
  order.clear();
  order.reserve(n);
  for (int32_t v = 0; v < n; ++v)
    if (indeg[v] == 0) order.push_back(v);
  for (size_t k = 0; k < order.size(); ++k) {
    int32_t o = order[k];
    for (int32_t e = kid_start[o]; e < kid_start[o + 1]; ++e) {
      int32_t j = kids[e];
      if (j >= 0 && --indeg[j] == 0) order.push_back(j);
    }
  }
  if (static_cast<int32_t>(order.size()) != n)
    throw std::runtime_error("graphscale: the grad_fn graph has a cycle; please report this.");

  // Bits in the Python planner's pin-dict order: leaves, then hinted Function
  // nodes (both in topological order), then inputs=, then enclosed nodes;
  // each with its final value.  Tie-breaks by bit then match.
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
    if (pin_kind[o] == 1) take(o);
  for (int32_t o : order)
    if (pin_kind[o] == 2) take(o);
  for (int32_t j : extra_pos)
    if (j >= 0) take(j);
  for (int32_t o : order)
    if (enclosed[o]) take(o);
  std::vector<double> values;
  auto bit_get = [&values](double v) -> int {
    for (size_t b = 0; b < values.size(); ++b)
      if (values[b] == v) return static_cast<int>(b);
    return -1;
  };
  auto& pin_bit = S.pin_bit;
  pin_bit.assign(n, -1);
  for (int32_t o : pinned) {
    int b = bit_get(pin_value[o]);
    if (b < 0) {
      values.push_back(pin_value[o]);
      b = static_cast<int>(values.size() - 1);
    }
    pin_bit[o] = b;
  }
  const int nvals = static_cast<int>(values.size());
  if (nvals > 64) throw std::overflow_error("graphscale: more than 64 distinct factors; native planner declines");

  // Bottom-up: reachable pin values and each node's preferred value.
  auto& reach = S.reach;
  auto& choice = S.choice;
  auto& vote_at = S.vote_at;  // offset into tallies for mixed nodes
  auto& tallies = S.tallies;
  reach.assign(n, 0);
  choice.assign(n, -1);
  vote_at.assign(n, -1);
  tallies.clear();
  for (int32_t p = n - 1; p >= 0; --p) {
    const int32_t v = order[p];
    uint64_t m = 0;
    for (int32_t e = kid_start[v]; e < kid_start[v + 1]; ++e)
      if (kids[e] >= 0) m |= reach[kids[e]];
    int pb = pin_bit[v];
    if (pb >= 0) {
      m |= (uint64_t{1} << pb);
      choice[v] = pb;
    } else if ((m & (m - 1)) == 0) {
      choice[v] = m ? 63 - __builtin_clzll(m) : -1;
    } else {
      int32_t off = static_cast<int32_t>(tallies.size());
      tallies.resize(off + nvals, 0);
      for (int32_t e = kid_start[v]; e < kid_start[v + 1]; ++e) {
        int32_t c = kids[e];
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
  auto decide = [&](int32_t v, double parent) -> double {
    int b = choice[v];
    if (b < 0) return parent;
    int32_t off = vote_at[v];
    if (off >= 0 && pin_bit[v] < 0) {
      int pb = bit_get(parent);
      if (pb >= 0 && tallies[off + pb] == tallies[off + b]) return parent;
    }
    return values[b];
  };
  // Top-down: the first parent (in topological order) decides.
  std::vector<double>& phi = P.phi_disc;
  phi.assign(n, 0.0);
  auto& set = S.set;
  set.assign(n, 0);
  for (int32_t u : order) {
    if (!set[u]) {
      phi[u] = decide(u, base);
      set[u] = 1;
    }
    const double pu = phi[u];
    for (int32_t e = kid_start[u]; e < kid_start[u + 1]; ++e) {
      int32_t c = kids[e];
      if (c >= 0 && !set[c]) {
        phi[c] = decide(c, pu);
        set[c] = 1;
      }
    }
  }
  // Edge multipliers, in topological order of their nodes.
  for (int32_t u : order) {
    const double pu = phi[u];
    const int32_t e0 = kid_start[u], e1 = kid_start[u + 1];
    int32_t e = e0;
    while (e < e1 && (kids[e] < 0 || phi[kids[e]] == pu)) ++e;
    if (e == e1 || enclosed[u]) continue;
    std::vector<std::pair<int64_t, double>> row;
    for (; e < e1; ++e) {
      int32_t c = kids[e];
      if (c >= 0 && phi[c] != pu) row.emplace_back(e - e0, phi[c] / pu);
    }
    P.multiplications += static_cast<int64_t>(row.size());
    P.hook_nodes.push_back(u);
    P.hook_mults.push_back(std::move(row));
  }
  for (size_t r = 0; r < nroots; ++r) {
    if (root_nodes[r] == nullptr) continue;
    P.seeds[r] = phi[index.get(root_nodes[r])] / base;
    if (P.seeds[r] != 1.0) ++P.multiplications;
  }
  return P;
}

static NativePlan plan(const py::list& roots, py::object owners, const std::vector<double>& factors,
                       double base, py::object carrier, bool raw, py::object param_type,
                       const py::list& extra_nodes, const std::vector<double>& extra_values,
                       py::object outer_phi, py::object hint) {
  const bool nested = !carrier.is_none();
  const double carrier_v = nested ? carrier.cast<double>() : 0.0;
  std::vector<Node*> root_nodes(roots.size(), nullptr);
  for (size_t r = 0; r < roots.size(); ++r) root_nodes[r] = node_of(roots[r].ptr());
  if (py::isinstance<py::list>(outer_phi)) {
    py::list lst = outer_phi.cast<py::list>();
    std::vector<const NativePlan*> outer_plans;
    for (size_t k = lst.size(); k-- > 0;) outer_plans.push_back(lst[k].cast<const NativePlan*>());
    return plan_core(roots, std::move(root_nodes), owners, factors, base, nested, carrier_v, raw, param_type,
                     extra_nodes, extra_values, &outer_plans, py::none(), hint);
  }
  return plan_core(roots, std::move(root_nodes), owners, factors, base, nested, carrier_v, raw, param_type,
                   extra_nodes, extra_values, nullptr, outer_phi, hint);
}

// The plan of a backward nested in a node's backward (NOTE [ Nested
// backward ] in graphscale/_backward.py), in one call: finds `current` in the
// running plans (`acts`: graphscale's _Active entries, their .plan, innermost
// last, searched innermost first), and plans `roots` (tensors or
// GradientEdges, as graphscale/_backward.py _root_node reads them) with that
// plan's owners, factors, policy and hint, base and carrier its potential,
// every running plan as outer_phi, no inputs=.  Returns (position of that
// entry in `acts`, NativePlan); None when no running plan has `current`
// (pass through); NotImplemented when a running plan is not a NativePlan or a
// root is neither (the caller plans through Python).
static py::object nested_plan(py::handle current, const py::tuple& acts, const py::tuple& roots,
                              py::object param_type) {
  const size_t m = acts.size();
  std::vector<py::object> keep;  // the plans stay alive while a hint may release the GIL
  std::vector<const NativePlan*> outer_plans;  // innermost first
  keep.reserve(m);
  outer_plans.reserve(m);
  for (size_t k = m; k-- > 0;) {
    py::object obj = acts[k].attr("plan");
    if (!py::isinstance<NativePlan>(obj)) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
    outer_plans.push_back(obj.cast<const NativePlan*>());
    keep.push_back(std::move(obj));
  }
  Node* node = node_of(current.ptr());
  if (node == nullptr) return py::none();
  for (size_t q = 0; q < m; ++q) {
    const NativePlan* op = outer_plans[q];
    int64_t i = op->index.get(node);
    if (i < 0) continue;
    const double p = op->phi_disc[i];
    // Root nodes, as _root_node: an edge's node, a tensor's grad_fn, a leaf's
    // AccumulateGrad, or none.
    std::vector<Node*> root_nodes(roots.size(), nullptr);
    std::vector<c10::intrusive_ptr<Node>> leaf_roots;
    for (size_t r = 0; r < roots.size(); ++r) {
      PyObject* obj = roots[r].ptr();
      if (THPVariable_Check(obj)) {
        const auto& var = THPVariable_Unpack(obj);
        if (auto fn = var.grad_fn()) {
          root_nodes[r] = fn.get();
        } else if (var.requires_grad()) {
          auto acc = torch::autograd::impl::grad_accumulator(var);
          root_nodes[r] = acc.get();
          leaf_roots.push_back(std::move(acc));
        }
      } else if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) >= 1) {  // GradientEdge(node, output_nr)
        root_nodes[r] = node_of(PyTuple_GET_ITEM(obj, 0));
      } else {
        return py::reinterpret_borrow<py::object>(Py_NotImplemented);
      }
    }
    static const std::vector<double> no_values;
    NativePlan P = plan_core(roots, std::move(root_nodes), op->owners, op->factors, p, true, p, op->raw, param_type,
                             py::list(), no_values, &outer_plans, py::none(), op->hint);
    P.leaf_roots = std::move(leaf_roots);
    return py::make_tuple(static_cast<int64_t>(m - 1 - q), py::cast(std::move(P)));
  }
  return py::none();
}

// Node count only (for benchmarks and tests): the same walk, no plan.
static int64_t count_nodes(const py::list& roots) {
  NodeIndex index;
  index.reserve(1024);
  std::vector<Node*> found;
  bool ins;
  for (auto r : roots) {
    Node* n = node_of(r.ptr());
    if (n == nullptr) continue;
    index.get_or_insert(n, static_cast<int64_t>(found.size()), &ins);
    if (ins) found.push_back(n);
  }
  for (size_t i = 0; i < found.size(); ++i) {
    if (is_accumulate_grad(found[i])) continue;
    for (const auto& e : found[i]->next_edges()) {
      Node* nxt = e.function.get();
      if (nxt == nullptr) continue;
      index.get_or_insert(nxt, static_cast<int64_t>(found.size()), &ins);
      if (ins) found.push_back(nxt);
    }
  }
  return static_cast<int64_t>(found.size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "graphscale native walk + plan (see graphscale/_plan.py NOTE [ Potentials ])";
  py::class_<Owners>(m, "Owners").def(py::init<const std::vector<uintptr_t>&, const std::vector<int>&>());
  py::class_<NativePlan>(m, "NativePlan")
      .def_readonly("seeds", &NativePlan::seeds)
      .def_readonly("num_nodes", &NativePlan::num_nodes)
      .def_readonly("multiplications", &NativePlan::multiplications)
      .def_readonly("base", &NativePlan::base)
      .def("hooks", &NativePlan::hooks)
      .def("phi_of", &NativePlan::phi_of);
  m.def("plan", &plan);
  m.def("nested_plan", &nested_plan);
  m.def("count_nodes", &count_nodes);
}
