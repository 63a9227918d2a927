/// \file triattn/policies/redundancy.hpp
/// \brief R-KV's key redundancy (baselines.md §5), shared by R-KV and by TriAttention's
/// attention-free `redundancy` option: how much each key of a row repeats the others.
///
///     S = K̂ K̂ᵀ over all n keys, K̂ = K / (‖K‖ + 1e-8), diagonal set to 0
///     per row i: S[i, j*] = 0 for j* = the largest j with S[i, j] > threshold
///     R = softmax over all n of the column means (1/n) Σ_i S[i, j]
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/error.hpp"
#include "triattn/policies/query_window.hpp"
#include "triattn/policies/window_math.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Redundancy `out` [n] of keys `keys` [n, D] (see the file comment). Row blocks of K̂K̂ᵀ keep
/// the memory at O(block x n) instead of O(n²).
inline void rkv_redundancy(const const_rows& keys, float threshold, std::span<float> out) {
  const char* api = "triattn::rkv_redundancy";
  const Eigen::Index n = keys.rows();
  TRIATTN_CHECK(out.size() == static_cast<std::size_t>(n), api, "output holds ", out.size(), " values, expected n ", n);
  if (n == 0) return;
  const auto D = static_cast<int>(keys.cols());
  row_matrix unit = keys;
  for (Eigen::Index i = 0; i < n; ++i) {
    float* k = unit.row(i).data();
    unit.row(i) /= rkv_unit_divisor(fixed_order_dot(k, k, D));
  }
  Eigen::RowVectorXf column_sum = Eigen::RowVectorXf::Zero(n), block_sum(n);
  constexpr Eigen::Index block = 256;
  row_matrix s;
  for (Eigen::Index i0 = 0; i0 < n; i0 += block) {
    const Eigen::Index b = std::min(block, n - i0);
    s.resize(b, n);  // [b, n] = unit[i0, i0 + b) unitᵀ, in the build-independent order (core/dot.hpp)
    fixed_order_dot_block(unit.row(i0).data(), D, static_cast<int>(b), unit.data(), D, n, D, s.data(), n);
    for (Eigen::Index r = 0; r < b; ++r) {
      float* row = s.row(r).data();  // row-major: the n cells of key i0 + r
      for (Eigen::Index j = 0; j < n; ++j) row[j] = rkv_similarity(row[j], i0 + r, j);
      const std::int64_t newest = rkv_newest_duplicate(row, n, threshold);
      for (Eigen::Index j = 0; j < n; ++j) row[j] = rkv_column_term(row[j], j, newest);
    }
    add_rows(s.data(), n, b, n, block_sum.data());
    column_sum += block_sum;
  }
  for (Eigen::Index j = 0; j < n; ++j) out[static_cast<std::size_t>(j)] = rkv_column_mean(column_sum[j], n);
  softmax_row(out.data(), n);
}

TRIATTN_NAMESPACE_END
