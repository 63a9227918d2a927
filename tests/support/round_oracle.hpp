// The double-precision oracle of one round's decisions (core/round.hpp), written once for
// every policy and granularity from the documented pipeline, sharing no code with it:
//
//   decisions: per_layer: one per (layer, kv_head); per_kv_head: one per kv_head, rows = every
//   layer; whole_sequence ("union"): one, rows = every (layer, kv_head), in row order;
//   protected: the policy's first / last slots or the round's (its sinks and recent window),
//   whichever reach further, plus the prompt's slots (positions below the prompt length) when
//   the prompt is protected or kept beyond the budget;
//   keep count: the policy's keep, plus the prompt's slots under beyond_prompt;
//   score: each row scored by the policy's own oracle (its per-row score, given the candidate
//   mask), folded by the sum (the mean's order) or the max over the decision's rows, in double;
//   selection: the protected slots first (the lowest ones when they alone exceed the count),
//   then the best candidates, ties to the lower slot; ascending.
//
// A decision's `margin` is the oracle's score gap at the cut (for a group of exactly tied
// scores across the cut: its distance to the nearest other score), so that a test can skip
// the comparisons an fp32 scorer may legitimately cut either way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "triattn/core/granularity.hpp"  // the enum, as a parameter container

namespace triattn_test::ref {

/// The policy's own part of a decision: protected first / last slots and the kept count.
struct round_rule {
  std::int64_t first = 0;
  std::int64_t last = 0;
  std::int64_t kept = 0;
};

/// The round options and context the oracle needs.
struct round_spec {
  triattn::granularity grain = triattn::granularity::per_layer;
  bool max_reduction = false;
  bool beyond_prompt = false;
  bool protect_prompt = false;
  std::int64_t prompt_length = 0;
  std::int64_t sinks = 0;   ///< the round's own first slots
  std::int64_t recent = 0;  ///< the round's own last slots
};

/// Decisions of a sequence of `layers` x `kv_heads` rows.
inline int decision_count(triattn::granularity g, int layers, int kv_heads) {
  switch (g) {
    case triattn::granularity::per_layer: return layers * kv_heads;
    case triattn::granularity::per_kv_head: return kv_heads;
    case triattn::granularity::whole_sequence: return 1;
  }
  return 0;
}

/// The (layer, kv_head) rows of decision `d`, in fold order.
inline std::vector<std::pair<int, int>> decision_rows(triattn::granularity g, int layers, int kv_heads, int d) {
  std::vector<std::pair<int, int>> rows;
  switch (g) {
    case triattn::granularity::per_layer: rows.emplace_back(d / kv_heads, d % kv_heads); break;
    case triattn::granularity::per_kv_head:
      for (int l = 0; l < layers; ++l) rows.emplace_back(l, d);
      break;
    case triattn::granularity::whole_sequence:
      for (int l = 0; l < layers; ++l)
        for (int h = 0; h < kv_heads; ++h) rows.emplace_back(l, h);
      break;
  }
  return rows;
}

/// One decision of the oracle.
struct round_decision {
  std::vector<std::pair<int, int>> rows;
  std::vector<std::int32_t> keep;  ///< ascending
  std::vector<bool> prot;          ///< [n] protected slots
  std::vector<double> score;       ///< [n] folded scores; empty when protection or length settled it
  double margin = std::numeric_limits<double>::infinity();
  double scale = 0.0;  ///< largest finite |score| of a candidate
};

/// The decision over `rows` whose (shared) slots hold `positions`. `row_score(l, h,
/// candidate)` returns the policy's double-precision score of every slot of row (l, h).
template <class RowScore>
round_decision decide(const std::vector<std::pair<int, int>>& rows, const std::vector<std::int32_t>& positions,
                      const round_rule& rule, const round_spec& spec, RowScore&& row_score) {
  round_decision d;
  d.rows = rows;
  const auto n = static_cast<std::int64_t>(positions.size());
  const bool prompt_kept = spec.protect_prompt || spec.beyond_prompt;
  std::int64_t prompt_slots = 0, protected_slots = 0;
  d.prot.resize(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) {
    const bool in_prompt = positions[s] < spec.prompt_length;
    prompt_slots += in_prompt ? 1 : 0;
    d.prot[s] = s < rule.first || s < spec.sinks || s >= n - rule.last || s >= n - spec.recent ||
                (prompt_kept && in_prompt);
    protected_slots += d.prot[s] ? 1 : 0;
  }
  const std::int64_t k = rule.kept + (spec.beyond_prompt ? prompt_slots : 0);
  if (k <= 0) return d;
  if (n <= k) {
    d.keep.resize(static_cast<std::size_t>(n));
    std::iota(d.keep.begin(), d.keep.end(), 0);
    return d;
  }
  for (std::int64_t s = 0; s < n && static_cast<std::int64_t>(d.keep.size()) < k; ++s)
    if (d.prot[s]) d.keep.push_back(static_cast<std::int32_t>(s));
  if (protected_slots >= k) return d;
  std::vector<bool> candidate(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) candidate[s] = !d.prot[s];
  d.score.assign(static_cast<std::size_t>(n), spec.max_reduction ? -std::numeric_limits<double>::infinity() : 0.0);
  for (const auto& [l, h] : rows) {
    const std::vector<double> x = row_score(l, h, candidate);
    for (std::int64_t s = 0; s < n; ++s)
      d.score[s] = spec.max_reduction ? std::max(d.score[s], x[s]) : d.score[s] + x[s];
  }
  std::vector<std::int32_t> order;
  for (std::int64_t s = 0; s < n; ++s)
    if (candidate[s]) {
      order.push_back(static_cast<std::int32_t>(s));
      if (std::isfinite(d.score[s])) d.scale = std::max(d.scale, std::fabs(d.score[s]));
    }
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return d.score[a] > d.score[b]; });
  const auto take = static_cast<std::size_t>(k - protected_slots);  // < order.size() since n > k
  d.keep.insert(d.keep.end(), order.begin(), order.begin() + static_cast<std::ptrdiff_t>(take));
  std::sort(d.keep.begin(), d.keep.end());
  const double cut = d.score[order[take - 1]], next = d.score[order[take]];
  if (cut != next) {
    d.margin = cut - next;
  } else {  // a tie group across the cut: how far it is from any other score
    for (const auto s : order)
      if (d.score[s] != cut) d.margin = std::min(d.margin, std::fabs(d.score[s] - cut));
  }
  return d;
}

/// Whether a scored decision is far enough from a near-tie for an fp32 scorer to agree:
/// margin above `rel_tol` x its scale (and `abs_tol`).
inline bool decisive(const round_decision& d, double rel_tol, double abs_tol = 1e-9) {
  return d.score.empty() || d.margin > rel_tol * d.scale + abs_tol;
}

/// Near a tie: a keep set `got` is still valid when it has the oracle's size and protected
/// slots, and no dropped candidate beats a kept one by more than the tolerance.
inline bool valid_top_set(const round_decision& d, const std::vector<std::int32_t>& got, double rel_tol,
                          double abs_tol = 1e-9) {
  if (got.size() != d.keep.size() || !std::is_sorted(got.begin(), got.end())) return false;
  double worst_kept = std::numeric_limits<double>::infinity(), best_dropped = -worst_kept;
  for (std::size_t s = 0; s < d.prot.size(); ++s) {
    const bool in_got = std::binary_search(got.begin(), got.end(), static_cast<std::int32_t>(s));
    const bool in_want = std::binary_search(d.keep.begin(), d.keep.end(), static_cast<std::int32_t>(s));
    if (d.prot[s]) {
      if (in_got != in_want) return false;
    } else if (in_got) {
      worst_kept = std::min(worst_kept, d.score[s]);
    } else {
      best_dropped = std::max(best_dropped, d.score[s]);
    }
  }
  return best_dropped <= worst_kept + rel_tol * d.scale + abs_tol;
}

}  // namespace triattn_test::ref
