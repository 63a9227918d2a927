/// \file triattn/policies/accumulated_math.hpp
/// \brief The per-element arithmetic of H2O and the policies built on accumulated attention,
/// written once for the CPU policies (attention_accumulator.hpp, h2o.hpp and the policies
/// derived from it) and the CUDA kernels (cuda/accumulated.cuh).
///
/// Both paths call these functions element by element, so a change to a formula reaches both
/// at once and the GPU reproduces the CPU's floats. Nothing here needs Eigen, exceptions or
/// `std::numeric_limits`, which nvcc device code cannot use; the budget split is plain host
/// arithmetic so that a CUDA caller can compute it without the CPU policy's headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/selection.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How the prompt's rows enter the accumulated score.
enum class prompt_scoring : std::uint8_t {
  every_row,    ///< H2O: every observed row adds its probabilities
  last_window,  ///< Scissorhands: only the last `scissorhands_window` prompt rows, each weighted 1 / window
};

/// A round's split of the budget, per decision.
struct h2o_split {
  std::int64_t recent = 0;  ///< the last slots, always kept
  std::int64_t heavy = 0;   ///< slots kept by score; the first `sinks` slots take their places first
  std::int64_t sinks = 0;   ///< at most `heavy`

  /// Slots a decision holding more keeps.
  TRIATTN_HOST_DEVICE std::int64_t total() const { return recent + heavy; }
  /// The slots kept whatever their score: the sinks first, the recent window last.
  TRIATTN_HOST_DEVICE protection protected_slots() const { return protection::sinks_and_recent(sinks, recent); }
};

/// The split of `budget` >= 1 slots given the heavy and recent counts a config resolves to
/// (ratios already turned into counts; negative: unset, then the other part's remainder, or
/// half the budget). The budget caps them: recent first, then heavy, then the sinks within
/// heavy. Arithmetic without checks: the policies validate their config first.
TRIATTN_HOST_DEVICE h2o_split split_budget(std::int64_t budget, std::int64_t heavy, std::int64_t recent,
                                           std::int64_t sinks) {
  h2o_split s;
  const std::int64_t r = recent >= 0 ? recent : (heavy >= 0 ? budget - heavy : budget / 2);
  s.recent = r < 0 ? 0 : (r > budget ? budget : r);
  const std::int64_t h = heavy >= 0 ? heavy : budget;
  s.heavy = h < budget - s.recent ? h : budget - s.recent;
  s.sinks = sinks < s.heavy ? sinks : s.heavy;
  return s;
}
/// `split_budget` with unset parts as `std::nullopt`.
inline h2o_split split_budget(std::int64_t budget, std::optional<std::int64_t> heavy, std::optional<std::int64_t> recent,
                              std::int64_t sinks) {
  return split_budget(budget, heavy.value_or(-1), recent.value_or(-1), sinks);
}

/// An H2O-style budget as a config describes it, in a form both paths read: counts, or ratios
/// of the prompt length (Python's int()), negative when unset.
struct h2o_budget {
  std::int64_t heavy = -1, recent = -1;
  double heavy_ratio = -1.0, recent_ratio = -1.0;
  std::int64_t sinks = 0;

  /// The split of `budget` for a prompt of `prompt_length` tokens.
  TRIATTN_HOST_DEVICE h2o_split split(std::int64_t budget, std::int64_t prompt_length) const {
    const auto part = [&](std::int64_t count, double ratio) {
      return count >= 0 || ratio < 0.0 ? count : static_cast<std::int64_t>(ratio * static_cast<double>(prompt_length));
    };
    return split_budget(budget, part(heavy, heavy_ratio), part(recent, recent_ratio), sinks);
  }
};

/// The weight of an observed row at `position`: 1 for every row of `every_row` scoring and
/// for decode rows; with `last_window`, 1 / `window` for the prompt's last `window` rows and 0
/// (the row is not recorded, neither summed nor counted) for the prompt rows before them.
TRIATTN_HOST_DEVICE float row_weight(prompt_scoring scoring, std::int64_t position, std::int64_t prompt_length,
                                     std::int64_t window) {
  if (scoring == prompt_scoring::every_row || position >= prompt_length) return 1.0f;
  if (position < prompt_length - window) return 0.0f;
  return 1.0f / static_cast<float>(window);
}

/// A running sum after one more probability `p` of a row of weight `weight`: one
/// `multiply_add` (core/dot.hpp), rounded once on every build, so the host and the GPU hold
/// the same bits after any number of rows whatever -ffp-contract says.
TRIATTN_HOST_DEVICE float accumulate_probability(float sum, float weight, float p) { return multiply_add(weight, p, sum); }

/// A combined sum divided by the rows that saw the slot (kvpress ObservedAttentionPress); 0
/// for a slot no row saw, which has no attention to average.
TRIATTN_HOST_DEVICE float normalized_sum(float combined, std::int32_t rows) {
  return rows > 0 ? combined / static_cast<float>(rows) : 0.0f;
}

/// The accumulated-attention (H2O) score of one slot: the sums of the group's `group` q-heads,
/// `sums[g * row_stride]` for g in [0, group), combined by `agg` and, with `normalize`, divided
/// by the group's row count `rows`. The count is shared by the group, so dividing after
/// combining equals dividing each q-head's sum first.
TRIATTN_HOST_DEVICE float accumulated_score(const float* sums, int group, std::int64_t row_stride, std::int32_t rows,
                                            gqa_aggregation agg, bool normalize) {
  float combined = 0.0f;
  gqa_combine(sums, group, row_stride, 1, agg, &combined);
  return normalize ? normalized_sum(combined, rows) : combined;
}

/// ‖v‖₁ of a value row `v` [n], summed in slot order (one order for both paths, hence the same
/// float). A policy that weights the score by the value norm weighs a token by it; a
/// non-finite result is an error on both paths.
TRIATTN_HOST_DEVICE float value_l1_norm(const float* v, int n) {
  float acc = 0.0f;
  for (int d = 0; d < n; ++d) acc += std::fabs(v[d]);
  return acc;
}

/// The score of a slot for a policy that weights the score by the value norm: its accumulated
/// attention times its value's L1 norm.
TRIATTN_HOST_DEVICE float value_weighted_score(float attention, float value_norm) { return attention * value_norm; }

TRIATTN_NAMESPACE_END
