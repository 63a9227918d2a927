/// \file triattn/core/gqa.hpp
/// \brief Combining the q-heads of a GQA group into one score per KV head.
///
/// Scores that policies compute per query head (accumulated attention, window votes) become one
/// score per (KV head, slot) before selection. The reference implementations differ here
/// (kvpress and KVCache-Factory average, R-KV takes the max, H2O variants sum), so it is a
/// parameter of every policy that needs it.
#pragma once

#include <cstdint>

#include "triattn/core/config.hpp"

TRIATTN_NAMESPACE_BEGIN

enum class gqa_aggregation : std::uint8_t { mean, max, sum };

/// Name for messages and the CLI: "mean", "max", "sum".
inline const char* gqa_aggregation_name(gqa_aggregation a) {
  switch (a) {
    case gqa_aggregation::mean: return "mean";
    case gqa_aggregation::max: return "max";
    case gqa_aggregation::sum: return "sum";
  }
  return "?";
}

/// Combines `group` rows of scores `rows` [group, row_stride] (the first `n` entries of each)
/// into `out` [n]. Shared by the CPU and CUDA paths.
TRIATTN_HOST_DEVICE void gqa_combine(const float* rows, int group, std::int64_t row_stride, std::int64_t n,
                                     gqa_aggregation a, float* out) {
  for (std::int64_t j = 0; j < n; ++j) {
    float acc = rows[j];
    for (int g = 1; g < group; ++g) {
      const float x = rows[g * row_stride + j];
      acc = a == gqa_aggregation::max ? (x > acc ? x : acc) : acc + x;
    }
    out[j] = a == gqa_aggregation::mean ? acc / static_cast<float>(group) : acc;
  }
}

TRIATTN_NAMESPACE_END
