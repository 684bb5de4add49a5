// plan.h: what one plan of one backward says (Plan): each walked node's
// potential, the seeds' and the edges' multipliers, and what the walk
// reached.  Plain data: the caller applies it.  Python twin:
// graphscale/_planner/plan.py PyPlan (over graphscale/_planner/potentials.py
// Plan and graphscale/_planner/pins.py Reached).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "nodes.h"

namespace graphscale::planner {

// Walked nodes are known by their discovery position (breadth-first from
// the roots, as graphscale/_planner/walk.py discovers them).  The caller keeps
// every walked node alive while the plan is used (so addresses stay unique).
struct Plan {
  NodeIndex index;                              // Node* -> discovery position
  std::vector<Node*> found;                     // discovery position -> Node*
  std::vector<double> phi_disc;                 // potential by discovery position
  std::vector<double> seeds;                    // per root: its seed's multiplier
  std::vector<int64_t> hook_nodes;              // discovery positions of nodes with edge multipliers
  std::vector<std::vector<std::pair<int64_t, double>>> hook_mults;  // per hook node: (edge, multiplier)
  int64_t num_nodes = 0;
  int64_t multiplications = 0;
  double base = 1.0;
  // What a backward nested inside this one is planned with (the same
  // owners, factors and policy).
  const Owners* owners_ptr = nullptr;  // the caller keeps it alive
  std::vector<double> factors;
  int policy = kAny;
  // What the backward reached: owned leaves, and per group position whether
  // any of its leaves; custom-Function nodes (they may run a nested backward
  // over hidden leaves); unowned nn.Parameter leaves (counted where the
  // policy or a nested backward asks; their discovery positions).
  std::vector<int64_t> phase_ns;  // Clock: discover, pin, order, bottom_up, top_down, multipliers
  int64_t owned_leaves = 0;
  int64_t custom_nodes = 0;
  int64_t enclosed_nodes = 0;  // non-leaf nodes an enclosing plan hooks already (a nested backward through its graph)
  bool tensor_hooks = false;  // some non-leaf node has tensor hooks (a DeepSpeed output hook among them?)
  std::vector<char> reached;
  std::vector<int64_t> unowned_param_pos;
};

}  // namespace graphscale::planner
