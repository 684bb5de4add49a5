// pins.h: the pins: owned leaves at their group's factor, unowned leaves
// by the policy, hinted custom-Function nodes, inputs=, nodes an enclosing
// plan governs.  Python twin: graphscale/_backward/pyplan.py (the pin dict).
// Included once, in order, by walker.cpp (one translation unit).
#pragma once

// The pin of an unowned leaf (NOTE [ Unowned leaves in nested backward ];
// NOTE [ Unowned leaves ] in graphscale/_core/snapshot.py), if any; counts it when
// it is an nn.Parameter.
bool Planner::unowned_pin(int32_t o, const at::Tensor& var, double* v) {
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
int64_t Planner::cached_hint(int32_t o) {
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
bool Planner::pin() {
  const int32_t n = n_;
  S.pin_kind.assign(n, 0);
  S.has_pin.assign(n, 0);
  S.pin_value.assign(n, 0.0);
  S.enclosed.assign(n, 0);
  P.custom_nodes = static_cast<int64_t>(S.customs.size());
  bool trivial = R.hint.is_none() || pin_hinted();
  for (size_t k = 0; k < S.leaves.size(); ++k) {
    const int32_t o = S.leaves[k];
    const int64_t g = S.leaf_group[k];
    double v;
    if (g >= 0) {
      v = R.factors.at(g);
      ++P.owned_leaves;
      P.reached[g] = 1;
    } else if (!unowned_pin(o, static_cast<AccumulateGrad*>(P.found[o])->variable, &v)) {
      continue;
    }
    S.pin_kind[o] = 1;
    trivial = put(o, v) && trivial;
  }
  extra_pos_.clear();
  for (size_t k = 0; k < R.extra_nodes.size(); ++k) {
    int64_t j = R.extra_nodes[k] ? P.index.get(R.extra_nodes[k]) : -1;
    extra_pos_.push_back(static_cast<int32_t>(j));
    if (j >= 0) trivial = put(static_cast<int32_t>(j), R.extra_values[k]) && trivial;
  }
  // NOTE [ Nested backward through the enclosing graph ]: nodes an enclosing
  // plan already hooks keep its potential and get no edge multipliers here.
  if (R.has_outer()) {
    for (int32_t o = 0; o < n; ++o) {
      double seen;
      if (!S.is_leaf[o] && R.seen_phi(P.found[o], &seen)) {
        trivial = put(o, seen) && trivial;
        S.enclosed[o] = 1;
      }
    }
  }
  return trivial;
}

// Pin `o` at `v` (a later pin overwrites an earlier one); true when v is base.
bool Planner::put(int32_t o, double v) {
  S.has_pin[o] = 1;
  S.pin_value[o] = v;
  return v == R.base;
}

// The hinted custom-Function nodes (pin_kind 2); true when every pin is base.
bool Planner::pin_hinted() {
  bool trivial = true;
  for (int32_t o : S.customs) {
    int64_t pos = -1;
    double v = 0.0;
    if (R.hint_cache != nullptr) {
      pos = cached_hint(o);
      if (pos < 0) continue;
      v = R.factors.at(pos);
    } else {
      py::object h = R.hint(py_of(P.found[o]));
      if (h.is_none()) continue;
      v = R.hint_positions ? R.factors.at(h.cast<int64_t>()) : h.cast<double>();
    }
    S.pin_kind[o] = 2;
    trivial = put(o, v) && trivial;
  }
  return trivial;
}
