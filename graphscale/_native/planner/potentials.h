// potentials.h: the potentials (bottom-up reachable pin values and votes,
// top-down the first parent decides) and the edge multipliers and seeds.
// Python twin: graphscale/_planner/potentials.py make_plan, _bottom_up, _top_down
// (NOTE [ Potentials ]).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "nodes.h"
#include "phases.h"

namespace graphscale::planner {

// Bottom-up: the pin values reachable from each node (bitmask), and the
// value it would take on its own (votes of its children where mixed).
inline void Planner::bottom_up() {
  const int32_t n = n_;
  const int nvals = static_cast<int>(values_.size());
  const int32_t* kid_start = S.kid_start.data();
  const int32_t* kids = S.kids.data();
  const int32_t* order = S.order.data();
  const int* pin_bit = S.pin_bit.data();
  auto& tallies = S.tallies;
  S.reach.assign(n, 0);
  S.choice.assign(n, -1);
  S.vote_at.assign(n, -1);  // offset into tallies for mixed nodes
  uint64_t* reach = S.reach.data();
  int32_t* choice = S.choice.data();
  int32_t* vote_at = S.vote_at.data();
  tallies.clear();
  for (int32_t p = n - 1; p >= 0; --p) {
    const int32_t v = order[p];
    const int32_t e0 = kid_start[v], e1 = kid_start[v + 1];
    uint64_t m = 0;
    for (int32_t e = e0; e < e1; ++e)
      if (kids[e] >= 0) m |= reach[kids[e]];
    const int pb = pin_bit[v];
    if (pb >= 0) {
      m |= (uint64_t{1} << pb);
      choice[v] = pb;
    } else if ((m & (m - 1)) == 0) {
      choice[v] = m ? 63 - __builtin_clzll(m) : -1;
    } else {
      const int32_t off = static_cast<int32_t>(tallies.size());
      tallies.resize(off + nvals, 0);
      for (int32_t e = e0; e < e1; ++e) {
        const int32_t c = kids[e];
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

inline double Planner::potential_of(int32_t v, double parent) const {
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
inline void Planner::top_down() {
  const int32_t* kid_start = S.kid_start.data();
  const int32_t* kids = S.kids.data();
  P.phi_disc.assign(n_, 0.0);
  S.set.assign(n_, 0);
  double* phi = P.phi_disc.data();
  char* set = S.set.data();
  for (int32_t u : S.order) {
    if (!set[u]) {
      phi[u] = potential_of(u, R.base);
      set[u] = 1;
    }
    const double pu = phi[u];
    for (int32_t e = kid_start[u]; e < kid_start[u + 1]; ++e) {
      const int32_t c = kids[e];
      if (c >= 0 && !set[c]) {
        phi[c] = potential_of(c, pu);
        set[c] = 1;
      }
    }
  }
}

// Edge multipliers, in topological order of their nodes, then the seeds.
inline void Planner::multipliers(const std::vector<Node*>& root_nodes) {
  const double* phi = P.phi_disc.data();
  const int32_t* kid_start = S.kid_start.data();
  const int32_t* kids = S.kids.data();
  for (int32_t u : S.order) {
    const double pu = phi[u];
    const int32_t e0 = kid_start[u], e1 = kid_start[u + 1];
    int32_t e = e0;
    while (e < e1 && (kids[e] < 0 || phi[kids[e]] == pu)) ++e;
    if (e == e1 || S.enclosed[u]) continue;
    std::vector<std::pair<int64_t, double>> row;
    for (; e < e1; ++e) {
      const int32_t c = kids[e];
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

}  // namespace graphscale::planner
