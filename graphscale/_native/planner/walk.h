// walk.h: the discovery (breadth-first over next_edges, edges in CSR form)
// and the topological order (Kahn's algorithm, the same queue discipline).
// Python twin: graphscale/_planner/walk.py walk (discovery, topological order).
#pragma once

#include <cstdint>
#include <vector>

#include "errors.h"
#include "nodes.h"
#include "phases.h"

namespace graphscale::planner {

// Breadth-first discovery over next_edges, edges in CSR form by discovery position.
inline void Planner::discover(const std::vector<Node*>& root_nodes, size_t index_guess) {
  std::vector<Node*>& found = P.found;
  NodeIndex& index = P.index;
  index.reserve(index_guess);  // grows when the guess is short
  found.reserve(index_guess + 16);
  seed_roots(root_nodes, &index, &found);
  n_roots_ = static_cast<int32_t>(found.size());
  bool ins;
  auto& kid_start = S.kid_start;
  auto& kids = S.kids;
  kid_start.clear();
  kids.clear();
  S.leaves.clear();
  S.leaf_group.clear();
  S.customs.clear();
  constexpr int64_t kAhead = 8;  // prefetch distance: the walk is bound by memory latency on a fresh graph
  int64_t count = static_cast<int64_t>(found.size());  // found.size(), kept in a register
  for (int64_t i = 0; i < count; ++i) {
    if (i + kAhead < count) {
      const auto& ahead = found[i + kAhead]->next_edges();
      if (!ahead.empty()) __builtin_prefetch(ahead.data());
    }
    Node* node = found[i];
    kid_start.push_back(static_cast<int32_t>(kids.size()));
    const auto& next = node->next_edges();
    // AccumulateGrad has no next edges: test the type only where there are
    // none.  Everything pin() needs of a node is read here, while the node
    // is in cache: its owner (leaves), whether it is a custom Function.
    if (next.empty() && is_accumulate_grad(node)) {
      S.leaves.push_back(static_cast<int32_t>(i));
      S.leaf_group.push_back(R.owners->group(node));
      continue;
    }
    if (is_py_node(node)) S.customs.push_back(static_cast<int32_t>(i));
    if (!P.tensor_hooks && !node->tensor_pre_hooks().empty()) P.tensor_hooks = true;
    for (const auto& e : next) {
      Node* nxt = e.function.get();
      if (nxt == nullptr) {
        kids.push_back(-1);
        continue;
      }
      int64_t j = index.get_or_insert(nxt, count, &ins);
      if (ins) {
        ++count;
        found.push_back(nxt);
        __builtin_prefetch(nxt);
        __builtin_prefetch(reinterpret_cast<const char*>(nxt) + 64);
      }
      kids.push_back(static_cast<int32_t>(j));
    }
  }
  n_ = static_cast<int32_t>(found.size());
  kid_start.push_back(static_cast<int32_t>(kids.size()));
  P.num_nodes = n_;
}

// Kahn's algorithm, same queue discipline as the Python walker; then the
// distinct pin values as bits, in the Python planner's pin-dict order
// (leaves, hinted Function nodes, inputs=, enclosed; each with its final
// value), so tie-breaks by bit match.  The queue's own pass collects the
// leaves and hinted nodes in topological order (one pass over the order for
// each kind cost 5 instructions a node); a node pinned twice takes the bit
// of its first place, as a key keeps its first place in the Python dict.
inline void Planner::order() {
  const int32_t n = n_;
  const int32_t* kid_start = S.kid_start.data();
  const int32_t* kids = S.kids.data();
  const size_t num_kids = S.kids.size();
  S.indeg.assign(n, 0);
  int32_t* indeg = S.indeg.data();
  for (size_t e = 0; e < num_kids; ++e)
    if (kids[e] >= 0) ++indeg[kids[e]];
  S.order.resize(n);
  int32_t* queue = S.order.data();
  int32_t tail = 0;
  // Every node but the roots was found along an edge: only a root can start
  // with no parent.
  for (int32_t v = 0; v < n_roots_; ++v)
    if (indeg[v] == 0) queue[tail++] = v;
  const char* kind = S.pin_kind.data();
  auto& leaves = S.pinned_leaves;
  auto& hinted = S.pinned_hinted;
  leaves.clear();
  hinted.clear();
  for (int32_t k = 0; k < tail; ++k) {
    const int32_t o = queue[k];
    if (kind[o] == 1) leaves.push_back(o);
    else if (kind[o] == 2) hinted.push_back(o);
    for (int32_t e = kid_start[o]; e < kid_start[o + 1]; ++e) {
      const int32_t j = kids[e];
      if (j >= 0 && --indeg[j] == 0) queue[tail++] = j;
    }
  }
  if (tail != n) throw BrokenInvariant("the grad_fn graph has a cycle");
  values_.clear();
  S.pin_bit.assign(n, -1);
  int* pin_bit = S.pin_bit.data();
  auto take = [&](int32_t o) {
    if (pin_bit[o] >= 0) return;
    const double v = S.pin_value[o];
    int b = bit_of(v);
    if (b < 0) {
      values_.push_back(v);
      b = static_cast<int>(values_.size() - 1);
    }
    pin_bit[o] = b;
  };
  for (int32_t o : leaves) take(o);
  for (int32_t o : hinted) take(o);
  for (int32_t j : extra_pos_)
    if (j >= 0) take(j);
  if (P.enclosed_nodes > 0)
    for (int32_t k = 0; k < n; ++k)
      if (S.enclosed[queue[k]]) take(queue[k]);
  if (values_.size() > 64) throw TooManyFactors();
}

}  // namespace graphscale::planner
