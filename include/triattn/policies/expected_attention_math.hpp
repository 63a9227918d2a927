/// \file triattn/policies/expected_attention_math.hpp
/// \brief Expected Attention's formulas that the CPU policy (expected_attention.hpp) and the
/// CUDA scorer (cuda/expected_attention.cuh) share, and its configuration (apart from the
/// policy, which uses Eigen, so that nvcc never meets it).
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "triattn/core/config.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"

TRIATTN_NAMESPACE_BEGIN

struct expected_attention_config {
  /// The last `window` observed queries of every (layer, q-head) give the statistics (their
  /// mean and covariance before RoPE). Not protected: every slot is scored.
  int window = 128;
  /// The future positions whose RoPE rotation is averaged: [round start, round start + future).
  std::int64_t future = 512;
  /// The first `sinks` slots are always kept, and queries at positions below `sinks` are left
  /// out of the statistics (both kvpress' `n_sink`, 4).
  std::int64_t sinks = 4;
  bool covariance = true;   ///< the kᵀΣk / 2D term; without it, the mean alone
  bool value_norm = true;   ///< weight each slot by ‖v‖₂
  float epsilon = 0.0f;     ///< added to the expected probability before the value weight
  round_options round{granularity::per_layer, row_reduction::mean, budget_mode::with_prompt, false,
                      schedule::with_slack(128)};

  /// kvpress' defaults (the defaults): one round after a long prefill.
  static expected_attention_config kvpress() { return {}; }
  /// Decode-time rounds: RoPE averaged over the next 16 positions instead of 512, which keeps
  /// its preference for recent keys. Chosen on SmolLM2's development prompts among 1, 16 and
  /// 512 positions and the mean alone; on the test prompts it beats kvpress' defaults by 1.7 to
  /// 2.4 standard errors at budgets 128 to 512 (docs/quality.md, `expected_attention_f16`).
  static expected_attention_config decode() {
    expected_attention_config c;
    c.future = 16;
    return c;
  }
};

/// The first problem of a config, quoting the value, or "" (a message, not a throw, so that
/// the CUDA entry point checks the same rules).
inline std::string expected_attention_config_error(const expected_attention_config& c) {
  std::ostringstream os;
  if (c.window < 1) {
    os << "window " << c.window << " must be >= 1";
  } else if (c.future < 1 || c.future > (std::int64_t{1} << 20)) {
    os << "future " << c.future << " must be in [1, 2^20]";
  } else if (c.sinks < 0) {
    os << "sinks " << c.sinks << " must be >= 0";
  } else if (!(c.epsilon >= 0.0f && std::isfinite(c.epsilon))) {
    os << "epsilon " << c.epsilon << " must be finite and >= 0";
  }
  return os.str();
}

/// The mean over t in [start, start + future) of band f's RoPE rotation at position t, as
/// (c, s): R̄_f = a [[c, −s], [s, c]] with a the RoPE attention scale, folded into c and s.
TRIATTN_HOST_DEVICE void expected_attention_mean_rotation(const rope_desc& r, int head_dim, int f, double start,
                                                          std::int64_t future, double& c, double& s) {
  const double w = inv_freq(r, rotary_dims(r, head_dim), f);
  double sc = 0.0, ss = 0.0;
  for (std::int64_t t = 0; t < future; ++t) {
    sc += cos((start + static_cast<double>(t)) * w);
    ss += sin((start + static_cast<double>(t)) * w);
  }
  c = r.attention_scale * sc / static_cast<double>(future);
  s = r.attention_scale * ss / static_cast<double>(future);
}

/// A slot's score from its expected probability `p` (the GQA group's mean) and value norm.
TRIATTN_HOST_DEVICE float expected_attention_score(float p, float value_norm, bool use_value_norm, float epsilon) {
  return use_value_norm ? (p + epsilon) * value_norm : p + epsilon;
}

TRIATTN_NAMESPACE_END
