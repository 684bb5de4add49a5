// plan.h: one plan of one backward: what is asked (Request), what comes
// out (NativePlan), and the Planner that runs the phases (discover, pin,
// order, bottom_up, top_down, multipliers; defined in walk.h, pins.h and
// potentials.h).  Python twin: graphscale/_backward/pyplan.py build and the
// request of graphscale/_core/request.py.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

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

  // Defined in walk.h (the discovery, the topological order), pins.h (the
  // pins) and potentials.h (the potentials, the edge multipliers), in the
  // order run() calls them.
  void discover(const std::vector<Node*>& root_nodes, size_t index_guess);
  bool unowned_pin(int32_t o, const at::Tensor& var, double* v);
  int64_t cached_hint(int32_t o);
  bool pin();
  bool put(int32_t o, double v);
  bool pin_hinted();
  void order();
  void bottom_up();
  double potential_of(int32_t v, double parent) const;
  void top_down();
  void multipliers(const std::vector<Node*>& root_nodes);
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

// The plan of graphscale/_backward/pyplan.py build (_backward/native_backend.py NativeBackend.plan builds
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
