// phases.h: the Planner, one plan's state and its phases, declared here
// and defined one concept a file: discover and order (walk.h), the pins
// (pins.h), the potentials and multipliers (potentials.h); run() and plan()
// in planner.h.  Its scratch arrays (Scratch) and phase clock (Clock).
// Python twin: the locals of graphscale/_planner/plan.py build, which
// runs the same phases (graphscale/_planner/walk.py walk,
// graphscale/_planner/pins.py pins, graphscale/_planner/potentials.py
// make_plan).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "nodes.h"
#include "plan.h"
#include "request.h"

namespace graphscale::planner {

// Scratch arrays of one plan, kept per thread so that a backward's plans
// (one per nested backward under reentrant checkpointing) do not allocate
// and clear them afresh.  A plan that starts while another is running on the
// same thread (a caller's answer reentering) takes fresh ones.
struct Scratch {
  std::vector<int32_t> kid_start, kids, indeg, order, choice, vote_at, tallies;
  std::vector<int32_t> pinned_leaves, pinned_hinted;  // order(): pin_kind 1 and 2 nodes, in topological order
  std::vector<int32_t> leaves, customs;  // discovery positions of AccumulateGrad and custom-Function nodes
  std::vector<int64_t> leaf_group;       // per entry of leaves: owning group position, or -1
  std::vector<char> pin_kind, enclosed, set;
  std::vector<double> pin_value;
  std::vector<int> pin_bit;
  std::vector<uint64_t> reach;
  bool busy = false;
};

// Nanoseconds of each phase of a plan (Plan::phase_ns: discover, pin,
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
// multipliers.  The same computation as graphscale/_planner/plan.py build
// (walk, pins) then graphscale/_planner/potentials.py make_plan, with the same orders and
// tie-breaks.  Nodes keep their discovery position throughout; the
// topological order is a permutation (order) walked where the Python planner
// walks its sorted list, so nothing is renumbered.
class Planner {
 public:
  Planner(const Request& req, const Answers& answers, Scratch& scratch, Plan& plan)
      : R(req), A(answers), S(scratch), P(plan) {}

  void run(const std::vector<Node*>& root_nodes, size_t index_guess);  // planner.h

 private:
  const Request& R;
  const Answers& A;
  Scratch& S;
  Plan& P;
  int32_t n_ = 0;
  int32_t n_roots_ = 0;  // distinct roots: discovery positions 0 .. n_roots_ - 1
  std::vector<int32_t> extra_pos_;
  std::vector<double> values_;  // distinct pin values, by bit

  // An AccumulateGrad node (after discover: it has no kids).
  bool is_leaf(int32_t o) const { return S.kid_start[o] == S.kid_start[o + 1] && is_accumulate_grad(P.found[o]); }

  int bit_of(double v) const {
    for (size_t b = 0; b < values_.size(); ++b)
      if (values_[b] == v) return static_cast<int>(b);
    return -1;
  }

  // In the order run() calls them.
  void discover(const std::vector<Node*>& root_nodes, size_t index_guess);  // walk.h
  bool pin();                                                              // pins.h
  bool has_outer() const;
  bool seen_phi(Node* node, double* out) const;
  bool unowned_pin(int32_t o, const at::Tensor& var, double* v);
  bool put(int32_t o, double v);
  bool pin_hinted();
  void order();                                                            // walk.h
  void bottom_up();                                                        // potentials.h
  double potential_of(int32_t v, double parent) const;
  void top_down();
  void multipliers(const std::vector<Node*>& root_nodes);
};

}  // namespace graphscale::planner
