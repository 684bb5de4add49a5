// planner.h: one plan of one backward, the planner's entry: plan() runs the
// Planner's phases (phases.h) for a Request, with this thread's scratch
// arrays, into a Plan.  What the caller must know of Python (is a leaf an
// nn.Parameter, the checkpoint hint, a Python plan's potentials) it
// answers through Answers (request.h).  Python twin:
// graphscale/_planner/plan.py build.
#pragma once

#include <cstddef>
#include <vector>

#include "nodes.h"
#include "phases.h"
#include "pins.h"
#include "plan.h"
#include "potentials.h"
#include "request.h"
#include "walk.h"

namespace graphscale::planner {

inline void Planner::run(const std::vector<Node*>& root_nodes, size_t index_guess) {
  P.owners_ptr = R.owners;
  P.factors = R.factors;
  P.policy = R.policy;
  P.reached.assign(R.factors.size(), 0);
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

// Plan `root_nodes` (null where a root has no node) for `req` into `out`
// (a fresh Plan, or a caller's type derived from it) with this thread's
// scratch arrays.  Throws TooManyFactors past 64 distinct pin values.
inline void plan(const std::vector<Node*>& root_nodes, const Request& req, const Answers& answers, Plan* out) {
  static thread_local Scratch tls_scratch;
  static thread_local size_t last_top = 0, last_nested = 0;  // node counts: first guess of the index size
  Scratch local;
  Scratch& S = tls_scratch.busy ? local : tls_scratch;
  struct Busy {
    Scratch& s;
    explicit Busy(Scratch& s_) : s(s_) { s.busy = true; }
    ~Busy() { s.busy = false; }
  } busy(S);
  size_t& last = req.nested ? last_nested : last_top;
  Planner(req, answers, S, *out).run(root_nodes, last);
  last = static_cast<size_t>(out->num_nodes);
}

}  // namespace graphscale::planner
