/// \file triattn/policies/snapkv.hpp
/// \brief SnapKV (Li et al. 2024): the last w queries vote for the older keys they attend to.
///
/// **Score** (baselines.md §3, cli.md `score snapkv`), per (layer, kv_head g) of n slots, with
/// the window's m <= w observed queries of each q-head h of the group (query_window.hpp):
///
///     P_h    = softmax over all n keys of Q_h Kᵀ/√D, −inf where the key is after the query (fp32),
///     v_h[j] = Σ_i P_h[i, j]                        for the prefix j < n − w,
///     s[j]   = GQA aggregation over h of pool(v_h)[j],  pooling kernel k, stride 1, pad k/2,
///
/// and s = +inf on the last w slots (the window, always kept; the budget counts it). Max
/// pooling pads with −inf, avg pooling counts the zero padding (PyTorch `avg_pool1d`).
///
/// **GQA.** `aggregate` combines the pooled votes of the group with `gqa` (mean: kvpress and
/// KVCache-Factory; max; sum). The reference SnapKV selects per *query* head and stores H_q
/// heads (`repeat_kv` before compression); a cache of H_kv heads holds one keep set per KV
/// head, so `per_q_head` is the closest honest rule: every q-head of the group ranks the
/// prefix by its own pooled votes, and the KV head takes their picks round-robin (each q-head's
/// best, then each one's second best, ..., in q-head order, skipping slots already taken)
/// until the budget is full. Each q-head so gets an equal share of its own top tokens; with
/// G = 1 it is the reference exactly. Its `score` is that merge order as a number, −(r·G + i)
/// for a slot first picked by the group's i-th q-head at rank r (exact below 2^24 slots x G).
///
/// **When.** The reference runs once, at the end of prefill: the default schedule is
/// `schedule::once_after_prompt()` (`maybe_compress` with the round's prompt length); the
/// decode-time variant the TriAttention paper compares against (`decode()`) compresses every
/// 128 generated tokens, here the slack schedule: when the cache reaches budget + 128, cut it
/// to budget (prompt included).
///
/// **Differences from the reference code** (all in favour of fp32): probabilities and votes
/// stay fp32 (the reference casts the softmax back to the model dtype before summing); ties go
/// to the lower slot and kept slots stay in order (the reference gathers in top-k order).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/policies/query_window.hpp"
#include "triattn/policies/window_config.hpp"

TRIATTN_NAMESPACE_BEGIN

namespace detail {

/// `per_q_head` merge order of pooled votes `pooled` [group, p] into `out` [p]: −(r·G + i) for
/// the slot first reached at rank r of q-head i. Ranks follow the library order (higher vote
/// first, ties to the lower slot), so a top-k of `out` is the round-robin merge.
inline void snapkv_merge_rank(const row_matrix& pooled, std::span<float> out) {
  const auto group = pooled.rows();
  const auto p = static_cast<std::int32_t>(pooled.cols());
  std::vector<std::int64_t> first(static_cast<std::size_t>(p), std::numeric_limits<std::int64_t>::max());
  std::vector<std::int32_t> order(static_cast<std::size_t>(p));
  for (Eigen::Index i = 0; i < group; ++i) {
    const float* v = pooled.row(i).data();
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return ranks_before(v[a], a, v[b], b); });
    for (std::int32_t r = 0; r < p; ++r) first[order[r]] = std::min<std::int64_t>(first[order[r]], r * group + i);
  }
  for (std::int32_t j = 0; j < p; ++j) out[j] = -static_cast<float>(first[j]);
}

/// Prefix scores `out` [p] from the per-q-head votes `votes` [group, p]: pool each row, then
/// combine the group. Shared by the recomputed and the materialised paths.
inline void snapkv_finish(const row_matrix& votes, const snapkv_config& c, std::span<float> out) {
  const auto group = static_cast<int>(votes.rows());
  const auto p = static_cast<std::size_t>(votes.cols());
  row_matrix pooled(votes.rows(), votes.cols());
  for (int i = 0; i < group; ++i)
    pool1d({votes.row(i).data(), p}, {pooled.row(i).data(), p}, c.kernel, c.pool);
  if (c.grouping == snapkv_grouping::per_q_head) {
    snapkv_merge_rank(pooled, out);
  } else {
    gqa_combine(pooled.data(), group, static_cast<std::int64_t>(p), static_cast<std::int64_t>(p), c.gqa, out.data());
  }
}

}  // namespace detail

/// SnapKV scores of one (layer, kv_head) of `n` slots from materialised probabilities `probs`
/// [group, rows, n] (each row a softmax over the n keys, as an eager engine computes it) into
/// `out` [n], +inf on the last `c.window` slots. What the policy computes from its kept
/// queries when attention is not materialised; exposed so the two paths can be compared.
inline void snapkv_scores_from_probs(std::span<const float> probs, int group, int rows, std::int64_t n,
                                     const snapkv_config& c, std::span<float> out) {
  const char* api = "triattn::snapkv_scores_from_probs";
  detail::validate_snapkv_config(api, c);
  TRIATTN_CHECK(group >= 1 && rows >= 1 && n >= 0, api, "group ", group, ", rows ", rows, ", n ", n,
                " must be >= 1, >= 1, >= 0");
  TRIATTN_CHECK(probs.size() == static_cast<std::size_t>(group) * static_cast<std::size_t>(rows) * static_cast<std::size_t>(n),
                api, "probs holds ", probs.size(), " values, expected group ", group, " x rows ", rows, " x n ", n);
  TRIATTN_CHECK(out.size() == static_cast<std::size_t>(n), api, "output holds ", out.size(), " scores, expected n ", n);
  const std::int64_t p = recent_window_begin(n, c.window);
  std::fill(out.begin() + p, out.end(), std::numeric_limits<float>::infinity());
  if (p == 0) return;
  const Eigen::Map<const row_matrix> all(probs.data(), static_cast<Eigen::Index>(group) * rows, n);  // [group * rows, n]
  row_matrix votes(group, p);
  for (int i = 0; i < group; ++i) add_rows(all.row(static_cast<Eigen::Index>(i) * rows).data(), n, rows, p, votes.row(i).data());
  detail::snapkv_finish(votes, c, out.first(static_cast<std::size_t>(p)));
}

class snapkv : public window_policy<snapkv> {
 public:
  static constexpr std::string_view name = "snapkv";
  static constexpr const char* plan_api = "triattn::snapkv::plan";
  snapkv_config config;

  snapkv() = default;
  explicit snapkv(snapkv_config c) : config(c) { detail::validate_snapkv_config("triattn::snapkv", config); }

 private:
  friend class window_policy<snapkv>;
  static constexpr window_policy_names names{"triattn::snapkv::attach", "triattn::snapkv::observe",
                                             "triattn::snapkv::score"};

  int window_size() const { return config.window; }
  void validate_config(const char* api) const { detail::validate_snapkv_config(api, config); }

  /// Votes of every q-head of the group from the recomputed window attention, then the
  /// shared finish.
  void score_prefix(const window_inputs& in, std::span<float> out) const {
    row_matrix votes(in.group, in.prefix), probs;  // probs [group * rows, n]: one product for the group
    window_logits(in.queries, in.query_positions, in.keys, in.key_positions, probs);
    softmax_rows(probs);
    for (int i = 0; i < in.group; ++i)
      add_rows(probs.row(static_cast<Eigen::Index>(i) * in.rows).data(), probs.outerStride(), in.rows, in.prefix,
               votes.row(i).data());
    detail::snapkv_finish(votes, config, out);
  }
};

TRIATTN_NAMESPACE_END
