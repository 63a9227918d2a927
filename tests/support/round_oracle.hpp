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
//   then the best candidates, ties to the lower slot; ascending. With S segments the m
//   candidates (slot order) form runs [j m / S, (j + 1) m / S), and run j takes
//   floor(end_j r / m) - floor(begin_j r / m) of the r slots left, its best;
//   budget split (head-adaptive): the decisions of a pool (a layer's kv heads, or the whole
//   sequence) that keep anything pool their counts (kept - protected kept); if their slots fit
//   the counts they keep everything; else each keeps its protected slots, floor(floor x its
//   share) of its best candidates, and the rest of the pool goes to the best of the remaining
//   candidates of the pool by normalised score ((score - min) / sum(score - min) over the
//   decision's finite candidates; 1 / count when they are all equal), ties to the lower
//   decision and slot; each decision then selects with its new count;
//   value-aware rounds: each row's candidate scores weighted by their value weights w before
//   the fold: times w for scores in proportion to attention, plus ln max(w, 1e-30) for logits.
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

/// Score `s` weighted by value weight `w` (a value-aware round), for a `logit` score or not.
inline double value_weighted(double s, double w, bool logit) {
  return logit ? s + std::log(std::max(w, 1e-30)) : s * w;
}

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
  std::int64_t segments = 1;
  int split = 0;  ///< 0: equal budgets; 1: pooled per layer; 2: pooled per sequence
  double split_floor = 0.2;
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
  std::int64_t kept = 0;           ///< the count the decision keeps (after a budget split)
  std::int64_t segments = 1;
  bool count_sure = true;  ///< false: a budget split's cut is too close for fp32 to agree on the count
};

/// The candidates of `d` (slot order) split into `segments` runs, and each run's quota of `r`.
inline std::vector<std::pair<std::vector<std::int32_t>, std::int64_t>> runs_of(const round_decision& d, std::int64_t r) {
  std::vector<std::int32_t> cand;
  for (std::size_t s = 0; s < d.prot.size(); ++s)
    if (!d.prot[s]) cand.push_back(static_cast<std::int32_t>(s));
  const auto m = static_cast<std::int64_t>(cand.size());
  std::vector<std::pair<std::vector<std::int32_t>, std::int64_t>> runs;
  for (std::int64_t j = 0; j < d.segments; ++j) {
    const std::int64_t b = j * m / d.segments, e = (j + 1) * m / d.segments;
    const std::int64_t quota = m == 0 ? 0 : e * r / m - b * r / m;
    runs.emplace_back(std::vector<std::int32_t>(cand.begin() + b, cand.begin() + e), quota);
  }
  return runs;
}

/// Chooses `d`'s keep set for count `k` from its protection and scores (see the file comment).
inline void choose(round_decision& d, std::int64_t k) {
  d.kept = k;
  d.keep.clear();
  const auto n = static_cast<std::int64_t>(d.prot.size());
  if (k <= 0) return;
  if (n <= k) {
    d.keep.resize(static_cast<std::size_t>(n));
    std::iota(d.keep.begin(), d.keep.end(), 0);
    return;
  }
  std::int64_t protected_slots = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    protected_slots += d.prot[s] ? 1 : 0;
    if (d.prot[s] && static_cast<std::int64_t>(d.keep.size()) < k) d.keep.push_back(static_cast<std::int32_t>(s));
  }
  if (protected_slots >= k) return;
  for (std::int64_t s = 0; s < n; ++s)
    if (!d.prot[s] && std::isfinite(d.score[s])) d.scale = std::max(d.scale, std::fabs(d.score[s]));
  for (auto& [order, take] : runs_of(d, k - protected_slots)) {
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return d.score[a] > d.score[b]; });
    d.keep.insert(d.keep.end(), order.begin(), order.begin() + take);
    if (take == 0 || take == static_cast<std::int64_t>(order.size())) continue;
    const double cut = d.score[order[take - 1]], next = d.score[order[take]];
    if (cut != next) {
      d.margin = std::min(d.margin, cut - next);
    } else {  // a tie group across the cut: how far it is from any other score of the run
      for (const auto s : order)
        if (d.score[s] != cut) d.margin = std::min(d.margin, std::fabs(d.score[s] - cut));
    }
  }
  std::sort(d.keep.begin(), d.keep.end());
}

/// The decision over `rows` whose (shared) slots hold `positions`, prepared: protection, the
/// count before any split, and the folded scores when `scored(n, protected, k)` says so.
/// `row_score(l, h, candidate)` returns the policy's double-precision score of every slot of
/// row (l, h).
template <class RowScore, class Scored>
round_decision prepare(const std::vector<std::pair<int, int>>& rows, const std::vector<std::int32_t>& positions,
                       const round_rule& rule, const round_spec& spec, RowScore&& row_score, Scored&& scored) {
  round_decision d;
  d.rows = rows;
  d.segments = spec.segments;
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
  d.kept = rule.kept + (spec.beyond_prompt ? prompt_slots : 0);
  if (!scored(n, protected_slots, d.kept)) return d;
  std::vector<bool> candidate(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) candidate[s] = !d.prot[s];
  d.score.assign(static_cast<std::size_t>(n), spec.max_reduction ? -std::numeric_limits<double>::infinity() : 0.0);
  for (const auto& [l, h] : rows) {
    const std::vector<double> x = row_score(l, h, candidate);
    for (std::int64_t s = 0; s < n; ++s)
      d.score[s] = spec.max_reduction ? std::max(d.score[s], x[s]) : d.score[s] + x[s];
  }
  return d;
}

/// One decision without a budget split: scored only when protection and length leave a choice.
template <class RowScore>
round_decision decide(const std::vector<std::pair<int, int>>& rows, const std::vector<std::int32_t>& positions,
                      const round_rule& rule, const round_spec& spec, RowScore&& row_score) {
  round_decision d = prepare(rows, positions, rule, spec, row_score,
                             [](std::int64_t n, std::int64_t prot, std::int64_t k) { return k > 0 && n > k && prot < k; });
  choose(d, d.kept);
  return d;
}

/// A budget split over one pool of prepared decisions (scored wherever they have candidates
/// and keep anything): sets each one's count and keep set (see the file comment). `rel_tol`
/// marks the counts unsure when the pool's cut is within fp32's reach.
inline void split_pool(std::vector<round_decision*> pool, double floor, double rel_tol) {
  std::int64_t held = 0, kept = 0, rest = 0;
  for (const round_decision* d : pool)
    if (d->kept > 0) {
      held += static_cast<std::int64_t>(d->prot.size());
      kept += d->kept;
      const auto p = static_cast<std::int64_t>(std::count(d->prot.begin(), d->prot.end(), true));
      rest += d->kept - std::min(p, d->kept);
    }
  if (held <= kept) {
    for (round_decision* d : pool) choose(*d, d->kept > 0 ? static_cast<std::int64_t>(d->prot.size()) : 0);
    return;
  }
  struct item {
    double value;
    std::size_t decision;
    std::int32_t slot;
  };
  std::vector<item> items;
  std::vector<std::int64_t> counts(pool.size(), 0);
  double tol = 1e-12;
  for (std::size_t i = 0; i < pool.size(); ++i) {
    round_decision& d = *pool[i];
    if (d.kept <= 0) continue;
    const auto p = static_cast<std::int64_t>(std::count(d.prot.begin(), d.prot.end(), true));
    counts[i] = std::min(p, d.kept);
    if (d.score.empty()) continue;
    std::vector<std::int32_t> cand;
    double lowest = std::numeric_limits<double>::infinity(), sum = 0.0, scale = 0.0;
    std::int64_t finite = 0;
    for (std::size_t s = 0; s < d.prot.size(); ++s)
      if (!d.prot[s]) {
        cand.push_back(static_cast<std::int32_t>(s));
        if (std::isfinite(d.score[s])) lowest = std::min(lowest, d.score[s]), ++finite, scale = std::max(scale, std::fabs(d.score[s]));
      }
    for (const auto s : cand)
      if (std::isfinite(d.score[s])) sum += d.score[s] - lowest;
    // fp32's error on a normalised score: its raw error (as `decisive`) over the sum; a lone
    // finite candidate normalises to exactly 1 either way
    if (finite > 1) tol = std::max(tol, sum > 0.0 ? (rel_tol * scale + 1e-9) / sum : std::numeric_limits<double>::infinity());
    std::stable_sort(cand.begin(), cand.end(), [&](std::int32_t a, std::int32_t b) { return d.score[a] > d.score[b]; });
    const auto share = d.kept - counts[i];
    const auto floor_take = std::min<std::int64_t>(static_cast<std::int64_t>(std::floor(floor * static_cast<double>(share))),
                                                   static_cast<std::int64_t>(cand.size()));
    counts[i] += floor_take;
    rest -= floor_take;
    for (std::size_t j = static_cast<std::size_t>(floor_take); j < cand.size(); ++j) {
      const double x = d.score[cand[j]];
      items.push_back({std::isfinite(x) ? (sum > 0.0 ? (x - lowest) / sum : 1.0 / static_cast<double>(finite)) : x, i,
                       cand[j]});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const item& a, const item& b) {
    if (a.value != b.value) return a.value > b.value;
    return a.decision != b.decision ? a.decision < b.decision : a.slot < b.slot;
  });
  const auto take = static_cast<std::size_t>(std::min<std::int64_t>(rest, static_cast<std::int64_t>(items.size())));
  for (std::size_t j = 0; j < take; ++j) ++counts[items[j].decision];
  // The cut: items within fp32's reach of it may swap; when they are all of one decision the
  // counts stand, otherwise those decisions' counts are unsure.
  std::vector<bool> sure(pool.size(), true);
  if (take > 0 && take < items.size()) {
    const double cut = items[take - 1].value, next = items[take].value;
    if (!(cut == next && std::isinf(cut)) && !(cut - next > 2 * tol)) {
      std::vector<std::size_t> near;
      for (const item& it : items)
        if (std::fabs(it.value - cut) <= 2 * tol || std::fabs(it.value - next) <= 2 * tol) near.push_back(it.decision);
      if (std::any_of(near.begin(), near.end(), [&](std::size_t d) { return d != near.front(); }))
        for (const std::size_t d : near) sure[d] = false;
    }
  }
  for (std::size_t i = 0; i < pool.size(); ++i) {
    choose(*pool[i], counts[i]);
    pool[i]->count_sure = sure[i];
  }
}

/// Whether a scored decision is far enough from a near-tie for an fp32 scorer to agree:
/// margin above `rel_tol` x its scale (and `abs_tol`).
inline bool decisive(const round_decision& d, double rel_tol, double abs_tol = 1e-9) {
  return d.score.empty() || d.margin > rel_tol * d.scale + abs_tol;
}

/// Near a tie: a keep set `got` is still valid when it has the oracle's size (any size when the
/// count is unsure) and protected slots, and in every run no dropped candidate beats a kept
/// one by more than the tolerance, each run holding its quota of what `got` chose.
inline bool valid_top_set(const round_decision& d, const std::vector<std::int32_t>& got, double rel_tol,
                          double abs_tol = 1e-9) {
  if ((d.count_sure && got.size() != d.keep.size()) || !std::is_sorted(got.begin(), got.end())) return false;
  // the protected slots kept: all of them, or the lowest ones when they fill the count
  const auto protected_total = static_cast<std::int64_t>(std::count(d.prot.begin(), d.prot.end(), true));
  const std::int64_t protected_kept = std::min<std::int64_t>(protected_total, static_cast<std::int64_t>(got.size()));
  for (std::size_t s = 0, seen = 0; s < d.prot.size(); ++s)
    if (d.prot[s]) {
      const bool in_got = std::binary_search(got.begin(), got.end(), static_cast<std::int32_t>(s));
      if (in_got != (static_cast<std::int64_t>(seen++) < protected_kept)) return false;
    }
  if (d.score.empty()) return got == d.keep;
  const std::int64_t r = static_cast<std::int64_t>(got.size()) - protected_kept;
  for (const auto& [run, quota] : runs_of(d, r)) {
    double worst_kept = std::numeric_limits<double>::infinity(), best_dropped = -worst_kept;
    std::int64_t in_run = 0;
    for (const auto s : run) {
      if (std::binary_search(got.begin(), got.end(), s)) {
        ++in_run;
        worst_kept = std::min(worst_kept, d.score[s]);
      } else {
        best_dropped = std::max(best_dropped, d.score[s]);
      }
    }
    if (in_run != quota || best_dropped > worst_kept + rel_tol * d.scale + abs_tol) return false;
  }
  return true;
}

}  // namespace triattn_test::ref
