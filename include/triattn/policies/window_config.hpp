/// \file triattn/policies/window_config.hpp
/// \brief The configurations of the window-scored policies (SnapKV, R-KV) and their checks,
/// apart from the policies themselves so that the CUDA path (cuda/window_attention.cuh) can take them
/// without including Eigen, which nvcc must never compile (cuda/snapkv.cuh, cuda/rkv.cuh).
///
/// The meaning of every field is documented with its policy (snapkv.hpp, rkv.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How the q-heads of a GQA group choose one keep set per KV head.
enum class snapkv_grouping : std::uint8_t {
  aggregate,   ///< combine the pooled votes with `snapkv_config::gqa`, then one top-k
  per_q_head,  ///< every q-head ranks by its own votes; the picks are merged round-robin
};

struct snapkv_config {
  int window = 32;  ///< w: queries that vote, and slots always kept
  int kernel = 7;   ///< pooling kernel, odd
  pooling pool = pooling::max;
  snapkv_grouping grouping = snapkv_grouping::aggregate;
  gqa_aggregation gqa = gqa_aggregation::mean;  ///< `aggregate` only
  round_options round{granularity::per_layer, row_reduction::mean, budget_mode::with_prompt, false,
                      schedule::once_after_prompt()};

  /// The paper's LongBench setting (the defaults): w = 32, kernel 7, max pooling, one round
  /// once the prompt is processed, GQA mean as kvpress.
  static snapkv_config paper() { return {}; }

  /// The decode-time SnapKV of the TriAttention and R-KV comparisons: w = 8, kernel 7, max
  /// pooling, a round every 128 generated tokens (slack 128).
  static snapkv_config decode() {
    snapkv_config c;
    c.window = 8;
    c.round.sched = schedule::with_slack(128);
    return c;
  }
};

struct rkv_config {
  int window = 8;          ///< α: queries that score, and slots always kept
  int kernel = 7;          ///< max-pooling kernel of the importance, odd
  float lambda = 0.1f;     ///< mix: Z = λ I − (1 − λ) R, in [0, 1]
  float threshold = 0.5f;  ///< cosine similarity above which two keys are near-duplicates
  /// Buffer: rounds at budget + 128, cut to budget.
  round_options round{granularity::per_layer, row_reduction::mean, budget_mode::with_prompt, false,
                      schedule::with_slack(128)};

  /// The paper's table and TriAttention's copy (the defaults): λ = 0.1.
  static rkv_config paper() { return {}; }
  /// The reference repository's `R1KV` class and run script: λ = 0.07.
  static rkv_config reference_code() {
    rkv_config c;
    c.lambda = 0.07f;
    return c;
  }
};

/// The first problem of a SnapKV config, quoting the value, or "" when it is valid. A message
/// rather than a throw, so that the CUDA entry points (which return errors) check the same
/// rules as the CPU policy (which throws them).
inline std::string snapkv_config_error(const snapkv_config& c) {
  std::ostringstream os;
  if (c.window < 1) {
    os << "window " << c.window << " must be >= 1";
  } else if (c.kernel < 1 || c.kernel % 2 == 0) {
    os << "kernel " << c.kernel << " must be odd and >= 1";
  } else if (c.pool != pooling::max && c.pool != pooling::avg) {
    os << "pooling " << static_cast<int>(c.pool) << " is not a pooling kind";
  } else if (c.grouping != snapkv_grouping::aggregate && c.grouping != snapkv_grouping::per_q_head) {
    os << "grouping " << static_cast<int>(c.grouping) << " is not a snapkv_grouping";
  } else if (c.gqa != gqa_aggregation::mean && c.gqa != gqa_aggregation::max && c.gqa != gqa_aggregation::sum) {
    os << "gqa aggregation " << static_cast<int>(c.gqa) << " is not a gqa_aggregation";
  }
  return os.str();
}

/// The first problem of an R-KV config, quoting the value, or "" (see `snapkv_config_error`).
inline std::string rkv_config_error(const rkv_config& c) {
  std::ostringstream os;
  if (c.window < 1) {
    os << "window " << c.window << " must be >= 1";
  } else if (c.kernel < 1 || c.kernel % 2 == 0) {
    os << "kernel " << c.kernel << " must be odd and >= 1";
  } else if (!(c.lambda >= 0.0f && c.lambda <= 1.0f)) {
    os << "lambda " << c.lambda << " must be in [0, 1]";
  } else if (!std::isfinite(c.threshold)) {
    os << "threshold " << c.threshold << " must be finite";
  }
  return os.str();
}

namespace detail {

inline void validate_snapkv_config(const char* api, const snapkv_config& c) {
  const std::string e = snapkv_config_error(c);
  TRIATTN_CHECK(e.empty(), api, e);
}

inline void validate_rkv_config(const char* api, const rkv_config& c) {
  const std::string e = rkv_config_error(c);
  TRIATTN_CHECK(e.empty(), api, e);
}

}  // namespace detail

TRIATTN_NAMESPACE_END
