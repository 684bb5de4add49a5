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
class NodeIndex {
 public:
  void reserve(size_t n) {
    size_t cap = 64;
    while (cap < 2 * n) cap <<= 1;
    keys_.assign(cap, nullptr);
    vals_.assign(cap, -1);
    mask_ = cap - 1;
    size_ = 0;
  }
  // Index of `key`, or -1.
  int64_t get(const Node* key) const {
    if (keys_.empty()) return -1;
    size_t h = hash(key) & mask_;
    while (true) {
      const Node* k = keys_[h];
      if (k == key) return vals_[h];
      if (k == nullptr) return -1;
      h = (h + 1) & mask_;
    }
  }
  // Index of `key`; inserts `fresh` when absent (then *inserted = true).
  int64_t get_or_insert(const Node* key, int64_t fresh, bool* inserted) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    size_t h = hash(key) & mask_;
    while (true) {
      const Node* k = keys_[h];
      if (k == key) {
        *inserted = false;
        return vals_[h];
      }
      if (k == nullptr) {
        keys_[h] = key;
        vals_[h] = fresh;
        ++size_;
        *inserted = true;
        return fresh;
      }
      h = (h + 1) & mask_;
    }
  }

 private:
  static size_t hash(const Node* p) {
    uint64_t x = reinterpret_cast<uintptr_t>(p);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<size_t>(x);
  }
  void grow() {
    std::vector<const Node*> keys = std::move(keys_);
    std::vector<int64_t> vals = std::move(vals_);
    size_t cap = keys.empty() ? 64 : keys.size() * 2;
    keys_.assign(cap, nullptr);
    vals_.assign(cap, -1);
    mask_ = cap - 1;
    size_ = 0;
    bool ins;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != nullptr) get_or_insert(keys[i], vals[i], &ins);
  }
  std::vector<const Node*> keys_;
  std::vector<int64_t> vals_;
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
  py::list roots;
  NodeIndex index;                              // Node* -> discovery position
  std::vector<double> phi_disc;                 // potential by discovery position
  std::vector<double> seeds;
  std::vector<int64_t> hook_nodes;              // discovery positions of nodes with edge multipliers
  std::vector<std::vector<std::pair<int64_t, double>>> hook_mults;
  std::vector<Node*> found;
  int64_t num_nodes = 0;
  int64_t multiplications = 0;

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
static NativePlan plan(const py::list& roots, const Owners& owners, const std::vector<double>& factors,
                       double base, py::object carrier, bool raw, py::object param_type,
                       const py::list& extra_nodes, const std::vector<double>& extra_values,
                       py::object outer_phi, py::object hint) {
  NativePlan P;
  P.roots = roots;
  const size_t nroots = roots.size();
  std::vector<Node*> root_nodes(nroots, nullptr);
  std::vector<Node*>& found = P.found;
  NodeIndex& index = P.index;
  index.reserve(128);  // grows; nested plans (one checkpointed block) stay small
  bool ins;
  for (size_t r = 0; r < nroots; ++r) {
    Node* n = node_of(roots[r].ptr());
    root_nodes[r] = n;
    if (n == nullptr) continue;
    index.get_or_insert(n, static_cast<int64_t>(found.size()), &ins);
    if (ins) found.push_back(n);
  }
  // Breadth-first discovery (edges in CSR form, discovery positions).
  std::vector<int64_t> kid_start;
  std::vector<int64_t> kids;
  std::vector<char> is_leaf;
  kid_start.reserve(256);
  kids.reserve(512);
  constexpr size_t kAhead = 8;  // prefetch distance: the walk is bound by memory latency on a fresh graph
  for (size_t i = 0; i < found.size(); ++i) {
    if (i + kAhead < found.size()) {
      const auto& ahead = found[i + kAhead]->next_edges();
      if (!ahead.empty()) __builtin_prefetch(ahead.data());
    }
    Node* node = found[i];
    kid_start.push_back(static_cast<int64_t>(kids.size()));
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
      kids.push_back(j);
    }
  }
  const int64_t n = static_cast<int64_t>(found.size());
  kid_start.push_back(static_cast<int64_t>(kids.size()));
  P.num_nodes = n;

  // Kahn's algorithm, same queue discipline as the Python walker.
  std::vector<int64_t> indeg(n, 0);
  for (int64_t j : kids)
    if (j >= 0) ++indeg[j];
  std::vector<int64_t> order;
  order.reserve(n);
  for (int64_t v = 0; v < n; ++v)
    if (indeg[v] == 0) order.push_back(v);
  for (size_t k = 0; k < order.size(); ++k) {
    int64_t o = order[k];
    for (int64_t e = kid_start[o]; e < kid_start[o + 1]; ++e) {
      int64_t j = kids[e];
      if (j >= 0 && --indeg[j] == 0) order.push_back(j);
    }
  }
  if (static_cast<int64_t>(order.size()) != n)
    throw std::runtime_error("graphscale: the grad_fn graph has a cycle; please report this.");
  std::vector<int64_t> pos(n);
  for (int64_t p = 0; p < n; ++p) pos[order[p]] = p;
  // Edges in topological positions (CSR again).
  std::vector<int64_t> estart(n + 1);
  std::vector<int64_t> edges;
  edges.reserve(kids.size());
  for (int64_t p = 0; p < n; ++p) {
    int64_t o = order[p];
    estart[p] = static_cast<int64_t>(edges.size());
    for (int64_t e = kid_start[o]; e < kid_start[o + 1]; ++e) edges.push_back(kids[e] >= 0 ? pos[kids[e]] : -1);
  }
  estart[n] = static_cast<int64_t>(edges.size());

  // Pins: leaves in topological order, then extra pins; bits in that order.
  std::vector<double> values;
  auto bit = [&values](double v) -> int {
    for (size_t b = 0; b < values.size(); ++b)
      if (values[b] == v) return static_cast<int>(b);
    values.push_back(v);
    return static_cast<int>(values.size() - 1);
  };
  auto bit_get = [&values](double v) -> int {
    for (size_t b = 0; b < values.size(); ++b)
      if (values[b] == v) return static_cast<int>(b);
    return -1;
  };
  const bool nested = !carrier.is_none();
  // Enclosing plans: native ones are looked up by Node*, others through Python.
  std::vector<const NativePlan*> outer_plans;
  const bool outer_native = py::isinstance<py::list>(outer_phi);
  if (outer_native) {
    py::list lst = outer_phi.cast<py::list>();
    for (size_t k = lst.size(); k-- > 0;) outer_plans.push_back(lst[k].cast<const NativePlan*>());
  }
  auto seen_phi = [&](Node* node, double* out) -> bool {
    if (outer_native) {
      for (const NativePlan* op : outer_plans) {
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
  const double carrier_v = nested ? carrier.cast<double>() : 0.0;
  // Pin values first, in the Python planner's insertion order (leaves, then
  // hinted Function nodes, both in topological order, then inputs=); bits are
  // then given in that order, so tie-breaks by bit match.
  std::vector<int64_t> pinned;  // topological positions, insertion order
  std::vector<double> pin_value(n, 0.0);
  std::vector<char> has_pin(n, 0);
  auto put = [&](int64_t p, double v) {
    if (!has_pin[p]) pinned.push_back(p);
    has_pin[p] = 1;
    pin_value[p] = v;
  };
  std::vector<int64_t> py_nodes;
  for (int64_t p = 0; p < n; ++p) {
    int64_t o = order[p];
    if (!is_leaf[o]) {
      if (!hint.is_none() && is_py_node(found[o])) py_nodes.push_back(p);
      continue;
    }
    const auto& var = static_cast<AccumulateGrad*>(found[o])->variable;
    auto it = owners.group_of.find(var.unsafeGetTensorImpl());
    if (it != owners.group_of.end()) {
      put(p, factors.at(it->second));
      continue;
    }
    double seen;
    if (!outer_phi.is_none() && seen_phi(found[o], &seen)) {
      put(p, seen);
      continue;
    }
    if (nested) {
      PyObject* obj = THPVariable_Wrap(var);
      if (obj == nullptr) throw py::error_already_set();
      int isparam = PyObject_IsInstance(obj, param_type.ptr());
      Py_DECREF(obj);
      if (isparam < 0) throw py::error_already_set();
      put(p, isparam ? 1.0 : carrier_v);
    } else if (raw) {
      put(p, 1.0);
    }
  }
  for (int64_t p : py_nodes) {
    py::object v = hint(py_of(found[order[p]]));
    if (!v.is_none()) put(p, v.cast<double>());
  }
  if (extra_nodes.size() != extra_values.size()) throw std::invalid_argument("graphscale: extra pins sizes differ");
  for (size_t k = 0; k < extra_nodes.size(); ++k) {
    Node* en = node_of(extra_nodes[k].ptr());
    int64_t j = en ? index.get(en) : -1;
    if (j >= 0) put(pos[j], extra_values[k]);
  }
  // NOTE [ Nested backward through the enclosing graph ]: nodes an enclosing
  // plan already hooks keep its potential and get no edge multipliers here.
  std::vector<char> enclosed(n, 0);
  if (!outer_phi.is_none()) {
    for (int64_t p = 0; p < n; ++p) {
      if (is_leaf[order[p]]) continue;
      double seen;
      if (seen_phi(found[order[p]], &seen)) {
        put(p, seen);
        enclosed[p] = 1;
      }
    }
  }
  std::vector<int> pin_bit(n, -1);
  for (int64_t p : pinned) pin_bit[p] = bit(pin_value[p]);
  const int nvals = static_cast<int>(values.size());
  if (nvals > 64) throw std::overflow_error("graphscale: more than 64 distinct factors; native planner declines");

  // Bottom-up: reachable pin values and each node's preferred value.
  std::vector<uint64_t> reach(n, 0);
  std::vector<int> choice(n, -1);
  std::vector<int64_t> vote_at(n, -1);  // offset into tallies for mixed nodes
  std::vector<int64_t> tallies;
  for (int64_t v = n - 1; v >= 0; --v) {
    uint64_t m = 0;
    for (int64_t e = estart[v]; e < estart[v + 1]; ++e)
      if (edges[e] >= 0) m |= reach[edges[e]];
    int pb = pin_bit[v];
    if (pb >= 0) {
      m |= (uint64_t{1} << pb);
      choice[v] = pb;
    } else if ((m & (m - 1)) == 0) {
      choice[v] = m ? 63 - __builtin_clzll(m) : -1;
    } else {
      int64_t off = static_cast<int64_t>(tallies.size());
      tallies.resize(off + nvals, 0);
      for (int64_t e = estart[v]; e < estart[v + 1]; ++e) {
        int64_t c = edges[e];
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
  auto decide = [&](int64_t v, double parent) -> double {
    int b = choice[v];
    if (b < 0) return parent;
    int64_t off = vote_at[v];
    if (off >= 0 && pin_bit[v] < 0) {
      int pb = bit_get(parent);
      if (pb >= 0 && tallies[off + pb] == tallies[off + b]) return parent;
    }
    return values[b];
  };
  // Top-down: the first parent decides.
  std::vector<double> phi(n, 0.0);
  std::vector<char> set(n, 0);
  for (int64_t u = 0; u < n; ++u) {
    if (!set[u]) {
      phi[u] = decide(u, base);
      set[u] = 1;
    }
    const double pu = phi[u];
    for (int64_t e = estart[u]; e < estart[u + 1]; ++e) {
      int64_t c = edges[e];
      if (c >= 0 && !set[c]) {
        phi[c] = decide(c, pu);
        set[c] = 1;
      }
    }
  }
  // Edge multipliers, in topological order of their nodes.
  for (int64_t u = 0; u < n; ++u) {
    const double pu = phi[u];
    std::vector<std::pair<int64_t, double>> row;
    for (int64_t e = estart[u]; e < estart[u + 1]; ++e) {
      int64_t c = edges[e];
      if (c >= 0 && phi[c] != pu) row.emplace_back(e - estart[u], phi[c] / pu);
    }
    if (!row.empty() && !enclosed[u]) {
      P.multiplications += static_cast<int64_t>(row.size());
      P.hook_nodes.push_back(order[u]);
      P.hook_mults.push_back(std::move(row));
    }
  }
  P.seeds.resize(nroots, 1.0);
  for (size_t r = 0; r < nroots; ++r) {
    if (root_nodes[r] == nullptr) continue;
    P.seeds[r] = phi[pos[index.get(root_nodes[r])]] / base;
    if (P.seeds[r] != 1.0) ++P.multiplications;
  }
  P.phi_disc.resize(n);
  for (int64_t o = 0; o < n; ++o) P.phi_disc[o] = phi[pos[o]];
  return P;
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
      .def("hooks", &NativePlan::hooks)
      .def("phi_of", &NativePlan::phi_of);
  m.def("plan", &plan);
  m.def("count_nodes", &count_nodes);
}
