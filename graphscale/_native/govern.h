// govern.h: one governed backward in one call: decide, plan, seeds, hooks,
// bind, run torch (top, govern_nested), and the Python
// route's nested plan and binding through the same code.  Python twin:
// graphscale/_routes/python.py (govern_in_python, govern_nested_in_python) with
// graphscale/_backward/decide.py decide.
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// What top and govern_nested return when asked for stats:
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
  bool inherit = true;  // read the rows of the task it runs inside (false: its graph meets none of their nodes)
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
  Undo undo;
  undo.off_ns = &oc->ns[5];
  if (a.plan != nullptr) {
    const NativePlan& P = *a.plan;
    for (size_t h = 0; h < P.hook_nodes.size(); ++h)
      undo.add_row(P.found[P.hook_nodes[h]], P.hook_mults[h]);  // NOTE [ Multipliers per graph task ]
    undo.token = push_running(a.plan_owner, py::object(), a.reading);
  }
  oc->ns[2] = ns_since(t0);
  t0 = Clock_::now();
  py::tuple roots = a.call.roots;
  // Bound where a binding is needed, or where a task's hooks must find its
  // rows or the rows of the task it runs inside (NOTE [ Multipliers per graph task ]).
  const Keys inherited = a.inherit ? keys_of_task(torch::autograd::get_current_graph_task_id()) : Keys();
  if (!a.binding.is_none() || undo.key != 0 || !inherited.empty())
    roots = undo.bind_roots(a.call.roots, std::move(a.binding), &inherited);
  oc->ns[3] = ns_since(t0);
  call_torch(a.call.roots, roots, a.seeds, a.call.retain_graph, a.call.create_graph, a.call.inputs);
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
  } catch (const planner::TooManyFactors&) {
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

// The probe's verdict for a top-level backward whose groups all have factor
// `f` (NOTE [ Fast path ] in graphscale/_entry/entry.py): the fast path
// fills a.mults; *potential is what a bound task carries (NaN: none); true
// when it must be planned after all.
static bool fast_or_plan(Apply& a, const Governor& g, double f, const std::vector<double>& carries,
                         double* potential, Outcome* oc) {
  bool carry_nothing = true;
  for (double c : carries) carry_nothing = carry_nothing && c == 1.0;
  if (f == 1.0 && carry_nothing) return false;
  const int code = probe_nodes(a.call.nodes, *g.owners, g.policy, PyParameterTest(registry->param_type));
  const int verdict = code & 3;
  const bool hidden = code & 4;
  if (verdict == 0 && !hidden) return false;
  if (verdict == 0 && carry_nothing) {
    *potential = 1.0;
    return false;
  }
  if (verdict != 1) return true;  // (no owned leaf visible but a hidden one may carry a factor: plan)
  oc->kind = kFast;
  if (hidden && g.policy != kAny) *potential = f;
  a.mults.resize(carries.size());
  for (size_t r = 0; r < carries.size(); ++r) a.mults[r] = f / carries[r];
  return false;
}

// How many multiplications the backward does (the stats' count), and the
// warning about groups a plan missed.
static void count_multiplications(const Apply& a, const Governor& g, Outcome* oc) {
  int64_t scaled = 0;
  for (double m : a.mults) scaled += m != 1.0;
  if (oc->kind != kPlanned) {
    oc->multiplications = scaled;
    return;
  }
  const NativePlan& P = *a.plan;
  int64_t seed_mults = 0;
  for (double s : P.seeds) seed_mults += s != 1.0;
  oc->multiplications = P.multiplications - seed_mults + scaled;
  if (P.unowned_param_pos.size() && !P.custom_nodes && !g.warn.is_none()) g.warn(py::cast(a.plan_owner));
}

// What a top-level backward hands govern_top besides its call: the
// Reading (kept for nested backwards and bindings, never read here), its
// factors by group position (graphscale/_core/snapshot.py Reading.factor_list),
// and from its frame (graphscale/_backward/frames.py Frame) what the seeds
// carry by default and the backward's on_failure list.
struct TopCall {
  py::object reading;
  std::vector<double> factors;
  double carries = 1.0;
  py::object on_failure;
};

// top(governor, ...): a top-level governed backward (graphscale/_entry/entry.py
// and _routes/python.py govern_in_python from the decision on).
static py::object govern_top(py::object self, const py::tuple& roots, const py::list& grads, const TopCall& t,
                             const py::tuple& flags, bool want_stats) {
  const Governor& g = self.cast<const Governor&>();
  Outcome oc;
  Apply a;
  if (!a.call.read(roots, grads, flags)) return declined("call");
  a.reading = t.reading;
  auto t0 = Clock_::now();
  const std::vector<double>& factors = t.factors;
  const std::vector<double> carries = carries_of(roots, t.carries);
  bool same = true;
  for (double f : factors) same = same && f == factors[0];
  double potential = std::nan("");
  if (!same || fast_or_plan(a, g, factors.empty() ? 1.0 : factors[0], carries, &potential, &oc)) {
    if (!plan_into(a, request_of(g, factors), self, &oc)) return declined("factors");
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
  count_multiplications(a, g, &oc);
  const bool has_potential = !std::isnan(potential);
  if (has_potential || (g.hook_owners && (oc.kind != kPlanned || a.plan->tensor_hooks)))
    a.binding = make_binding(t.reading, has_potential ? py::object(py::float_(potential)) : py::none(),
                             t.on_failure, false, has_potential ? self : py::none(), factors);
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

// A backward called from inside `current`'s backward (plan_nested then the
// Python route's plan step, natively).
// (See NOTE [ Nested backward ] in graphscale/_entry/entry.py.)
static py::object govern_nested(Node* current, const py::tuple& roots, const py::list& grads, const py::tuple& flags,
                                bool want_stats) {
  if (registry == nullptr) return declined("native walker not ready");
  Outcome oc;
  Apply a;
  if (!a.call.read(roots, grads, flags)) return declined("call");
  auto t0 = Clock_::now();
  const Enclosing e = find_enclosing(current);
  if (e.kind == Enclosing::kPython) return declined("factors");
  if (e.kind == Enclosing::kNone) {  // ungoverned (or left alone): untouched, unbound
    call_torch(roots, roots, grads, a.call.retain_graph, a.call.create_graph, a.call.inputs);
    return want_stats ? oc.stats() : py::none();
  }
  a.reading = e.reading;
  py::object gov_obj;
  const Request req = nested_request(e, &gov_obj);
  if (!plan_into(a, req, gov_obj, &oc)) return declined("factors");
  const NativePlan& P = *a.plan;
  a.inherit = P.enclosed_nodes > 0;  // (a recompute's graph, a checkpoint's: nodes of its own only)
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
