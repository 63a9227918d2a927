// The CPU side of the SnapKV and R-KV kernels: the double-precision oracle of
// support/window_oracle.hpp on one (layer, kv_head) of a test cache. Plain loops only, so that
// this builds without Eigen and Catch2 (bench/gpu/run_on_device.sh).
#pragma once

#include <cstdint>
#include <vector>

#include "support/views.hpp"
#include "triattn/policies/window_config.hpp"

namespace triattn_cuda_test::cpu {

/// The window queries of one sequence, in the GPU's layout.
struct sequence_queries {
  std::vector<float> q;                   ///< [layers, q_heads, rows, head_dim]
  std::vector<std::int32_t> positions;    ///< [rows]
  int rows = 0;
};

/// The oracle's answer for one (layer, kv_head) of n slots.
struct window_expectation {
  std::vector<double> scores;        ///< [n], +inf on the window
  std::vector<std::int32_t> keep;    ///< the plan for the budget asked, ascending
  double keep_margin = 0.0;          ///< how far the cut is from a flip (ref::keep_best), +inf if no score decides
  bool tied_cut = false;             ///< the weakest kept and the best dropped score are equal
  double threshold_margin = 0.0;     ///< R-KV: smallest |cosine − threshold|; +inf for SnapKV
};

/// SnapKV (`aggregate` grouping) on (l, h) of `cache` with `queries`, and its plan for `budget`.
window_expectation expect(triattn_test::test_cache& cache, const sequence_queries& queries, int l, int h,
                          const triattn::snapkv_config& config, std::int64_t budget);

/// R-KV on (l, h) of `cache` with `queries`, and its plan for `budget`.
window_expectation expect(triattn_test::test_cache& cache, const sequence_queries& queries, int l, int h,
                          const triattn::rkv_config& config, std::int64_t budget);

}  // namespace triattn_cuda_test::cpu
