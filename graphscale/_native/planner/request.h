// request.h: what one plan is asked (Request: plain values) and the two
// questions only the caller can answer (Answers: the checkpoint hint, the
// potential an enclosing plan the planner cannot see gave a node).  Python
// twin: graphscale/_planner/request.py PlanRequest (its hint and outer_phi are
// the callables Answers stands for).
#pragma once

#include <cstdint>
#include <vector>

#include "nodes.h"
#include "plan.h"

namespace graphscale::planner {

// What a checkpoint hint says of a custom-Function node: nothing, a group
// position (the pin is that group's factor) or a pin itself.
// (See NOTE [ Checkpoint hints ] in graphscale/_backward/hints.py.)
struct Hinted {
  enum Kind { kNone, kGroup, kPin } kind = kNone;
  int64_t group = -1;  // kGroup
  double pin = 0.0;    // kPin
};

// The checkpoint hint, asked once per custom-Function node of a plan.
class CheckpointHint {
 public:
  virtual ~CheckpointHint() = default;
  virtual Hinted at(Node* node) = 0;
};

// The potential an enclosing plan that is not a Plan (the Python route's)
// gave `node`, if any; asked per node of a nested plan.
class EnclosingPotentials {
 public:
  virtual ~EnclosingPotentials() = default;
  virtual bool phi_of(Node* node, double* out) const = 0;
};

// Who answers what the planner cannot know.  `parameters` is required (every
// plan may ask about an unowned leaf); null `hint`: no hint; null
// `enclosing`: no enclosing plan but those in Request::outer_plans.
struct Answers {
  const ParameterTest* parameters = nullptr;
  CheckpointHint* hint = nullptr;
  const EnclosingPotentials* enclosing = nullptr;
};

// What one plan is asked: graphscale/_planner/request.py PlanRequest, in C++ terms.
struct Request {
  const Owners* owners = nullptr;        // the installed state's owned leaves
  std::vector<double> factors;           // factors[g]: factor of group position g
  double base = 1.0;                     // potential the seeds already carry
  bool nested = false;                   // a carrier is given (nested backward)
  double carrier = 0.0;                  // pin of unseen unowned non-Parameter leaves when nested
  int policy = kAny;                     // Policy: which unowned leaves are pinned to 1
  std::vector<Node*> extra_nodes;        // more pins (non-leaf inputs=), null where no node
  std::vector<double> extra_values;
  // The enclosing Plans, innermost first, looked up by Node* (else
  // Answers::enclosing is asked, where given).
  const std::vector<const Plan*>* outer_plans = nullptr;
};

}  // namespace graphscale::planner
