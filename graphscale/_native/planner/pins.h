// pins.h: the pins: owned leaves at their group's factor, unowned leaves
// by the policy, hinted custom-Function nodes, inputs=, nodes an enclosing
// plan governs.  Python twin: graphscale/_planner/pins.py pins and
// _unowned_pin (the pin dict).
#pragma once

#include <cstdint>

#include "nodes.h"
#include "phases.h"
#include "request.h"

namespace graphscale::planner {

inline bool Planner::has_outer() const { return R.outer_plans != nullptr || A.enclosing != nullptr; }

// The potential an enclosing plan gave `node`, if any: the enclosing Plans
// where the request has them, else the caller's answer.
inline bool Planner::seen_phi(Node* node, double* out) const {
  if (R.outer_plans != nullptr) {
    for (const Plan* op : *R.outer_plans) {
      int64_t i = op->index.get(node);
      if (i >= 0) {
        *out = op->phi_disc[i];
        return true;
      }
    }
    return false;
  }
  return A.enclosing != nullptr && A.enclosing->phi_of(node, out);
}

// The pin of an unowned leaf (NOTE [ Unowned leaves in nested backward ];
// NOTE [ Unowned leaves ] in graphscale/_core/snapshot.py), if any; counts it when
// it is an nn.Parameter.
inline bool Planner::unowned_pin(int32_t o, const at::Tensor& var, double* v) {
  if (has_outer() && seen_phi(P.found[o], v)) return true;
  if (R.policy == kAny && !R.nested) return false;
  const bool param = A.parameters->is_parameter(var);
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

// Pins, by discovery position: leaves and hinted custom-Function nodes, then
// inputs=, then nodes an enclosing plan governs (later ones overwrite, as
// later insertions into the Python planner's pin dict do).  pin_kind: 0
// none, 1 leaf, 2 hinted Function node.  True when every pin equals base.
inline bool Planner::pin() {
  const int32_t n = n_;
  S.pin_kind.assign(n, 0);
  S.pin_value.assign(n, 0.0);
  S.enclosed.assign(n, 0);
  P.custom_nodes = static_cast<int64_t>(S.customs.size());
  bool trivial = A.hint == nullptr || pin_hinted();
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
  if (has_outer()) {
    for (int32_t o = 0; o < n; ++o) {
      double seen;
      if (!is_leaf(o) && seen_phi(P.found[o], &seen)) {
        trivial = put(o, seen) && trivial;
        S.enclosed[o] = 1;
        ++P.enclosed_nodes;
      }
    }
  }
  return trivial;
}

// Pin `o` at `v` (a later pin overwrites an earlier one); true when v is base.
inline bool Planner::put(int32_t o, double v) {
  S.pin_value[o] = v;
  return v == R.base;
}

// The hinted custom-Function nodes (pin_kind 2); true when every pin is base.
inline bool Planner::pin_hinted() {
  bool trivial = true;
  for (int32_t o : S.customs) {
    const Hinted h = A.hint->at(P.found[o]);
    if (h.kind == Hinted::kNone) continue;
    const double v = h.kind == Hinted::kGroup ? R.factors.at(h.group) : h.pin;
    S.pin_kind[o] = 2;
    trivial = put(o, v) && trivial;
  }
  return trivial;
}

}  // namespace graphscale::planner
