/// \file triattn/policies/window_config.hpp
/// \brief The configurations of the window-scored policies (SnapKV, R-KV) and their checks,
/// apart from the policies themselves so that the CUDA path (cuda/window.cuh) can take them
/// without including Eigen, which nvcc must never compile.
///
/// The meaning of every field is documented with its policy (snapkv.hpp, rkv.hpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How the q-heads of a GQA group choose one keep set per KV head.
enum class snapkv_grouping : std::uint8_t {
  aggregate,   ///< combine the pooled votes with `snapkv_config::gqa`, then one top-k
  per_q_head,  ///< every q-head ranks by its own votes; the picks are merged round-robin
};

/// When SnapKV compresses.
enum class snapkv_trigger : std::uint8_t {
  once_after_prefill,  ///< one round right after the prompt (the reference)
  every,               ///< during decode, by `snapkv_config::sched` (the decode-time variant)
};

struct snapkv_config {
  int window = 32;  ///< w: queries that vote, and slots always kept
  int kernel = 7;   ///< pooling kernel, odd
  pooling pool = pooling::max;
  snapkv_grouping grouping = snapkv_grouping::aggregate;
  gqa_aggregation gqa = gqa_aggregation::mean;  ///< `aggregate` only
  snapkv_trigger trigger = snapkv_trigger::once_after_prefill;
  schedule sched = schedule::with_slack(128);  ///< `every` only

  /// The paper's LongBench setting (the defaults): w = 32, kernel 7, max pooling, once after
  /// prefill, GQA mean as kvpress.
  static snapkv_config paper() { return {}; }

  /// The decode-time SnapKV of the TriAttention and R-KV comparisons: w = 8, kernel 7, max
  /// pooling, a round every 128 generated tokens (slack 128).
  static snapkv_config decode() {
    snapkv_config c;
    c.window = 8;
    c.trigger = snapkv_trigger::every;
    return c;
  }
};

struct rkv_config {
  int window = 8;          ///< α: queries that score, and slots always kept
  int kernel = 7;          ///< max-pooling kernel of the importance, odd
  float lambda = 0.1f;     ///< mix: Z = λ I − (1 − λ) R, in [0, 1]
  float threshold = 0.5f;  ///< cosine similarity above which two keys are near-duplicates
  schedule sched = schedule::with_slack(128);  ///< buffer: rounds at budget + 128, cut to budget

  /// The paper's table and TriAttention's copy (the defaults): λ = 0.1.
  static rkv_config paper() { return {}; }
  /// The reference repository's `R1KV` class and run script: λ = 0.07.
  static rkv_config reference_code() {
    rkv_config c;
    c.lambda = 0.07f;
    return c;
  }
};

namespace detail {

inline void validate_snapkv_config(const char* api, const snapkv_config& c) {
  TRIATTN_CHECK(c.window >= 1, api, "window ", c.window, " must be >= 1");
  TRIATTN_CHECK(c.kernel >= 1 && c.kernel % 2 == 1, api, "kernel ", c.kernel, " must be odd and >= 1");
  TRIATTN_CHECK(c.pool == pooling::max || c.pool == pooling::avg, api, "pooling ", static_cast<int>(c.pool),
                " is not a pooling kind");
  TRIATTN_CHECK(c.grouping == snapkv_grouping::aggregate || c.grouping == snapkv_grouping::per_q_head, api,
                "grouping ", static_cast<int>(c.grouping), " is not a snapkv_grouping");
  TRIATTN_CHECK(c.gqa == gqa_aggregation::mean || c.gqa == gqa_aggregation::max || c.gqa == gqa_aggregation::sum, api,
                "gqa aggregation ", static_cast<int>(c.gqa), " is not a gqa_aggregation");
  TRIATTN_CHECK(c.trigger == snapkv_trigger::once_after_prefill || c.trigger == snapkv_trigger::every, api,
                "trigger ", static_cast<int>(c.trigger), " is not a snapkv_trigger");
}

inline void validate_rkv_config(const char* api, const rkv_config& c) {
  TRIATTN_CHECK(c.window >= 1, api, "window ", c.window, " must be >= 1");
  TRIATTN_CHECK(c.kernel >= 1 && c.kernel % 2 == 1, api, "kernel ", c.kernel, " must be odd and >= 1");
  TRIATTN_CHECK(c.lambda >= 0.0f && c.lambda <= 1.0f, api, "lambda ", c.lambda, " must be in [0, 1]");
  TRIATTN_CHECK(std::isfinite(c.threshold), api, "threshold ", c.threshold, " must be finite");
}

}  // namespace detail

TRIATTN_NAMESPACE_END
