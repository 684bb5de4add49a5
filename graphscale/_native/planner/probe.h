// probe.h: the probe before the fast path: does a backward reach an owned
// leaf, may it skip planning.  Python twin: graphscale/_planner/probe.py
// probe_python (graphscale/_backward/decide.py probe asks it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "nodes.h"

namespace graphscale::planner {

// NOTE [ No thread-local lookup per node ]
// The native module is a shared library loaded by dlopen, so the address of
// a thread_local is the result of a call to __tls_get_addr (general-dynamic
// TLS), and the compiler recomputes it at each use rather than keep it in a
// register, a reference to it included: the probe's scratch, used in its
// loop, cost about four such calls per node (W1's 739 nodes: 32 thousand
// instructions per backward, callgrind at ed80663).  probe_scratch() hands
// the address out of a call the compiler cannot repeat or see through, so
// the loop keeps it; is_py_node's type cache is no thread_local (nodes.h);
// the walk's scratch reaches it through the Planner's reference members
// (planner.h plan()).
struct ProbeScratch {
  NodeIndex index;
  std::vector<Node*> found;
  size_t last = 0;
};

// This thread's probe scratch (NOTE [ No thread-local lookup per node ]).
__attribute__((noinline)) inline ProbeScratch* probe_scratch() {
  static thread_local ProbeScratch tls;
  return &tls;
}

// Before the fast path (NOTE [ Fast path ] in graphscale/_entry/entry.py): does a
// backward of `roots` reach an owned leaf, and may it skip planning?  A
// breadth-first walk that stops as soon as the answer is known: at the first
// owned leaf under unowned="any"; under "plain_params" once an owned leaf and
// an unowned nn.Parameter are both seen (else it walks everything); under
// "plain" once an owned leaf and any unowned leaf are.  Returns 0: no owned
// leaf, 1: the fast path is exact, 2: plan; plus 4 when a custom-Function
// node was seen (it may run a nested backward over leaves no walk can see:
// reentrant checkpointing; the backward then binds its task so that such a
// nested backward is planned, NOTE [ Fast path ]).
inline int probe_nodes(const std::vector<Node*>& root_nodes, const Owners& owners, int policy,
                       const ParameterTest& parameters) {
  ProbeScratch& scratch = *probe_scratch();  // one lookup (NOTE [ No thread-local lookup per node ])
  NodeIndex& index = scratch.index;
  std::vector<Node*>& found = scratch.found;
  size_t& last = scratch.last;
  index.reserve(last);
  found.clear();
  seed_roots(root_nodes, &index, &found);
  bool ins, owned = false, unowned = false, hidden = false;
  int result = -1;
  constexpr size_t kAhead = 8;  // as in discover(): a fresh graph's walk waits on memory
  for (size_t i = 0; i < found.size() && result < 0; ++i) {
    if (i + kAhead < found.size()) {
      const auto& ahead = found[i + kAhead]->next_edges();
      if (!ahead.empty()) __builtin_prefetch(ahead.data());
    }
    Node* node = found[i];
    const auto& next = node->next_edges();
    if (next.empty() && is_accumulate_grad(node)) {
      const auto& var = static_cast<AccumulateGrad*>(node)->variable;
      if (owners.group(node) >= 0) {
        owned = true;
        if (policy == kAny) result = 1;
      } else if (policy == kPlain || (policy == kPlainParams && parameters.is_parameter(var))) {
        unowned = true;
      }
      if (owned && unowned) result = 2;
      continue;
    }
    if (!hidden && is_py_node(node)) hidden = true;
    for (const auto& e : next) {
      Node* nxt = e.function.get();
      if (nxt == nullptr) continue;
      index.get_or_insert(nxt, static_cast<int64_t>(found.size()), &ins);
      if (ins) {
        found.push_back(nxt);
        __builtin_prefetch(nxt);
        __builtin_prefetch(reinterpret_cast<const char*>(nxt) + 64);
      }
    }
  }
  last = found.size();
  found.clear();
  if (result < 0) result = owned ? 1 : 0;
  return result | (hidden ? 4 : 0);
}

}  // namespace graphscale::planner
