/// \file triattn/policies/rkv.hpp
/// \brief R-KV (Cai et al. 2025): importance minus redundancy, for long generated reasoning.
///
/// **Score** (baselines.md §5, cli.md `score rkv`), per (layer, kv_head g) of n slots, with
/// α = `window`, the prefix [0, p = n − α) and the m <= α observed queries of each q-head:
///
///     importance  M[i, j] = max over the group's q-heads of Q[i]·K[j]/√D      (j < p, pre-softmax)
///                 A       = softmax over the prefix of each row of M          (fp32)
///                 I       = maxpool_k( mean over the rows of A )
///     redundancy  S       = K̂ K̂ᵀ over all n keys, K̂ = K / (‖K‖ + 1e-8), diagonal set to 0
///                 per row i: S[i, j*] = 0 for j* = the largest j with S[i, j] > threshold
///                 R       = softmax over all n of the column means (1/n) Σ_i S[i, j]
///     score       Z[j]    = λ I[j] − (1 − λ) R[j]   for j < p,   +inf on the last α slots.
///
/// The newest near-duplicate of each key is spared and older copies are penalised. Quirk of
/// the reference kept on purpose (`torch.where(mask, arange, 0).max()`): a row with no entry
/// above the threshold picks j* = 0, so S[i, 0] is zeroed for it, which lowers token 0's
/// redundancy a little (a soft sink). Redundancy is computed over all n keys and only then
/// restricted to the prefix (not renormalised), as the reference does. The causal mask of
/// query_window.hpp applies to the importance logits too; prefix keys precede the window's
/// queries, so it never fires for an engine's own window.
///
/// **Defaults** are the paper's table and TriAttention's copy: α = 8, kernel 7, λ = 0.1, a
/// round when the cache reaches budget + 128 (buffer 128, cut to budget, α counted in the
/// budget; no sinks). `reference_code()` uses the reference repository's λ = 0.07.
///
/// **Differences from the reference code** (all in favour of fp32): importance, cosine
/// similarities and the redundancy softmax stay fp32 (the reference casts the mean attention
/// to the model dtype and computes similarities in it); ties go to the lower slot and kept
/// slots stay in order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/core/value_weighting.hpp"
#include "triattn/policies/query_window.hpp"
#include "triattn/policies/redundancy.hpp"
#include "triattn/policies/window_config.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN

namespace detail {

/// Importance `out` [p] from the group-max logits `max_logits` [m, p] (softmaxed in place).
/// Shared by the recomputed and the materialised paths.
inline void rkv_importance(row_matrix& max_logits, int kernel, std::span<float> out) {
  softmax_rows(max_logits);
  Eigen::RowVectorXf mean(max_logits.cols());
  add_rows(max_logits.data(), max_logits.cols(), max_logits.rows(), max_logits.cols(), mean.data());
  for (Eigen::Index j = 0; j < mean.size(); ++j) mean[j] = rkv_attention_mean(mean[j], static_cast<int>(max_logits.rows()));
  pool1d({mean.data(), out.size()}, out, kernel, pooling::max);
}

/// Z = λ I − (1 − λ) R on the prefix: `out` [p] from `importance` [p] and `redundancy` [>= p].
inline void rkv_mix_prefix(std::span<const float> importance, std::span<const float> redundancy, float lambda,
                    std::span<float> out) {
  for (std::size_t j = 0; j < out.size(); ++j) out[j] = rkv_mix(importance[j], redundancy[j], lambda);
}

}  // namespace detail

/// R-KV importance of one (layer, kv_head) of `n` slots from materialised logits `logits`
/// [group, rows, n] (Q·Kᵀ/√D of the window queries over all n keys) into `out` [n − c.window].
inline void rkv_importance_from_logits(std::span<const float> logits, int group, int rows, std::int64_t n,
                                       const rkv_config& c, std::span<float> out) {
  const char* api = "triattn::rkv_importance_from_logits";
  detail::validate_rkv_config(api, c);
  TRIATTN_CHECK(group >= 1 && rows >= 1 && n > c.window, api, "group ", group, ", rows ", rows, ", n ", n,
                " must be >= 1, >= 1, > window ", c.window);
  TRIATTN_CHECK(logits.size() == static_cast<std::size_t>(group) * static_cast<std::size_t>(rows) * static_cast<std::size_t>(n),
                api, "logits holds ", logits.size(), " values, expected group ", group, " x rows ", rows, " x n ", n);
  const std::int64_t p = recent_window_begin(n, c.window);
  TRIATTN_CHECK(out.size() == static_cast<std::size_t>(p), api, "output holds ", out.size(), " values, expected n - window ", p);
  const Eigen::Map<const row_matrix> all(logits.data(), static_cast<Eigen::Index>(group) * rows, n);  // [group * rows, n]
  row_matrix max_logits = all.topRows(rows).leftCols(p);
  for (int i = 1; i < group; ++i)
    max_logits = max_logits.cwiseMax(all.middleRows(static_cast<Eigen::Index>(i) * rows, rows).leftCols(p));
  detail::rkv_importance(max_logits, c.kernel, out);
}

/// R-KV scores of one (layer, kv_head) from materialised logits [group, rows, n] and the keys
/// `keys` [n, head_dim] into `out` [n], +inf on the last `c.window` slots.
inline void rkv_scores_from_logits(std::span<const float> logits, int group, int rows, std::span<const float> keys,
                                   int head_dim, const rkv_config& c, std::span<float> out) {
  const char* api = "triattn::rkv_scores_from_logits";
  TRIATTN_CHECK(head_dim >= 1 && keys.size() % static_cast<std::size_t>(head_dim) == 0, api, "keys hold ",
                keys.size(), " values, not a whole number of rows of head_dim ", head_dim);
  const auto n = static_cast<std::int64_t>(keys.size() / static_cast<std::size_t>(head_dim));
  TRIATTN_CHECK(out.size() == static_cast<std::size_t>(n), api, "output holds ", out.size(), " scores, expected n ", n);
  const std::int64_t p = recent_window_begin(n, c.window);
  std::fill(out.begin() + p, out.end(), std::numeric_limits<float>::infinity());
  if (p == 0) return;
  Eigen::RowVectorXf importance(p), redundancy(n);
  rkv_importance_from_logits(logits, group, rows, n, c, {importance.data(), static_cast<std::size_t>(p)});
  rkv_redundancy(Eigen::Map<const row_matrix>(keys.data(), n, head_dim), c.threshold,
                 {redundancy.data(), static_cast<std::size_t>(n)});
  detail::rkv_mix_prefix({importance.data(), static_cast<std::size_t>(p)}, {redundancy.data(), static_cast<std::size_t>(n)},
                  c.lambda, out.first(static_cast<std::size_t>(p)));
}

class rkv : public window_policy<rkv> {
 public:
  static constexpr std::string_view name = "rkv";
  static constexpr const char* plan_api = "triattn::rkv::plan";
  /// Importance minus redundancy takes either sign: a value weight adds ln w, as to a logit.
  static constexpr score_domain domain = score_domain::logit;
  rkv_config config;

  rkv() = default;
  explicit rkv(rkv_config c) : config(c) { detail::validate_rkv_config("triattn::rkv", config); }

 private:
  friend class window_policy<rkv>;
  static constexpr window_policy_names names{"triattn::rkv::attach", "triattn::rkv::observe", "triattn::rkv::score"};

  int window_size() const { return config.window; }
  void validate_config(const char* api) const { detail::validate_rkv_config(api, config); }

  /// Importance from the recomputed window logits (max over the group, prefix keys only),
  /// redundancy from all the keys, then the mix.
  void score_prefix(const window_inputs& in, std::span<float> out) const {
    const auto prefix_keys = in.keys.topRows(in.prefix);
    const auto prefix_positions = in.key_positions.first(static_cast<std::size_t>(in.prefix));
    row_matrix max_logits, logits;
    for (int i = 0; i < in.group; ++i) {
      window_logits(in.queries.middleRows(static_cast<Eigen::Index>(i) * in.rows, in.rows), in.query_positions,
                    prefix_keys, prefix_positions, i == 0 ? max_logits : logits);
      if (i > 0) max_logits = max_logits.cwiseMax(logits);
    }
    Eigen::RowVectorXf importance(in.prefix), redundancy(in.keys.rows());
    detail::rkv_importance(max_logits, config.kernel, {importance.data(), out.size()});
    rkv_redundancy(in.keys, config.threshold, {redundancy.data(), static_cast<std::size_t>(redundancy.size())});
    detail::rkv_mix_prefix({importance.data(), out.size()}, {redundancy.data(), static_cast<std::size_t>(redundancy.size())},
                    config.lambda, out);
  }
};

TRIATTN_NAMESPACE_END
