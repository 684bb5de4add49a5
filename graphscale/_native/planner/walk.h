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
  bool ins;
  auto& kid_start = S.kid_start;
  auto& kids = S.kids;
  auto& is_leaf = S.is_leaf;
  kid_start.clear();
  kids.clear();
  is_leaf.clear();
  S.leaves.clear();
  S.leaf_group.clear();
  S.customs.clear();
  constexpr size_t kAhead = 8;  // prefetch distance: the walk is bound by memory latency on a fresh graph
  for (size_t i = 0; i < found.size(); ++i) {
    if (i + kAhead < found.size()) {
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
      is_leaf.push_back(1);
      S.leaves.push_back(static_cast<int32_t>(i));
      S.leaf_group.push_back(R.owners->group(node));
      continue;
    }
    is_leaf.push_back(0);
    if (is_py_node(node)) S.customs.push_back(static_cast<int32_t>(i));
    if (!P.tensor_hooks && !node->tensor_pre_hooks().empty()) P.tensor_hooks = true;
    for (const auto& e : next) {
      Node* nxt = e.function.get();
      if (nxt == nullptr) {
        kids.push_back(-1);
        continue;
      }
      int64_t j = index.get_or_insert(nxt, static_cast<int64_t>(found.size()), &ins);
      if (ins) {
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
// value), so tie-breaks by bit match.
inline void Planner::order() {
  const int32_t n = n_;
  auto& indeg = S.indeg;
  auto& order = S.order;
  indeg.assign(n, 0);
  for (int32_t j : S.kids)
    if (j >= 0) ++indeg[j];
  order.clear();
  order.reserve(n);
  for (int32_t v = 0; v < n; ++v)
    if (indeg[v] == 0) order.push_back(v);
  for (size_t k = 0; k < order.size(); ++k) {
    int32_t o = order[k];
    for (int32_t e = S.kid_start[o]; e < S.kid_start[o + 1]; ++e) {
      int32_t j = S.kids[e];
      if (j >= 0 && --indeg[j] == 0) order.push_back(j);
    }
  }
  if (static_cast<int32_t>(order.size()) != n) throw BrokenInvariant("the grad_fn graph has a cycle");
  auto& pinned = S.pinned;
  auto& mark = S.mark;
  pinned.clear();
  mark.assign(n, 0);
  auto take = [&](int32_t o) {
    if (!mark[o]) {
      mark[o] = 1;
      pinned.push_back(o);
    }
  };
  for (int32_t o : order)
    if (S.pin_kind[o] == 1) take(o);
  for (int32_t o : order)
    if (S.pin_kind[o] == 2) take(o);
  for (int32_t j : extra_pos_)
    if (j >= 0) take(j);
  for (int32_t o : order)
    if (S.enclosed[o]) take(o);
  values_.clear();
  auto& pin_bit = S.pin_bit;
  pin_bit.assign(n, -1);
  for (int32_t o : pinned) {
    int b = bit_of(S.pin_value[o]);
    if (b < 0) {
      values_.push_back(S.pin_value[o]);
      b = static_cast<int>(values_.size() - 1);
    }
    pin_bit[o] = b;
  }
  if (values_.size() > 64) throw TooManyFactors();
}

}  // namespace graphscale::planner
