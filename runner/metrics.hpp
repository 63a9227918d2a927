/// \file runner/metrics.hpp
/// \brief What the programs measure on logits: the greedy token and KL(full || compressed).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>

#include "triattn/core/error.hpp"

namespace triattn_runner {

/// Index of the largest logit; the first one on ties, as run.c's argmax.
inline int argmax(std::span<const float> logits) {
  return static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// KL(p || q) in nats between the softmax distributions of two logit vectors, in double.
inline double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  TRIATTN_CHECK(p_logits.size() == q_logits.size() && !p_logits.empty(), "triattn_runner::kl_divergence", "logit vectors of ",
                p_logits.size(), " and ", q_logits.size(), " entries");
  // log-sum-exp of each vector, then Σ p_i (log p_i - log q_i) with no buffer.
  const auto lse = [](std::span<const float> z) {
    const double max = *std::max_element(z.begin(), z.end());
    double sum = 0.0;
    for (const float v : z) sum += std::exp(v - max);
    return max + std::log(sum);
  };
  const double lp = lse(p_logits), lq = lse(q_logits);
  double kl = 0.0;
  for (std::size_t i = 0; i < p_logits.size(); ++i) {
    const double log_p = p_logits[i] - lp;
    kl += std::exp(log_p) * (log_p - (q_logits[i] - lq));
  }
  return kl;
}

}  // namespace triattn_runner
