// Oracles of the H2O and VATP kernels (triattn/cuda/accumulated.cuh), written from the
// formulas of cli.md as plain loops. Not the CPU policies: those need Eigen, and the CUDA
// tests build on machines without it (bench/gpu/run_on_device.sh).
#pragma once

#include <cstdint>
#include <vector>

#include "support/views.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/policies/accumulated_math.hpp"

namespace triattn_cuda_test::cpu {

/// One sequence's accumulated attention, laid out as the CPU accumulator holds it.
struct accumulated_sums {
  std::vector<float> sums;           ///< [layers, q_heads, capacity]
  std::vector<std::int32_t> counts;  ///< [layers, kv_heads, capacity]

  /// Zeroed state for `cache`'s geometry and capacity.
  explicit accumulated_sums(const triattn_test::test_cache& cache);
};

/// Adds one row per (layer, q_head): `probs` [layers, q_heads, capacity] over the slots
/// [0, length(layer, q_head / G)), each times `weight`, in float as the CPU does; the group's
/// first q-head counts the row. A weight of 0 records nothing.
void accumulate(triattn_test::test_cache& cache, const float* probs, float weight, accumulated_sums& state);

/// Zeroes the state of every slot at or past its (layer, kv_head)'s length.
void clear_past_length(triattn_test::test_cache& cache, accumulated_sums& state);

/// The score of every slot below its length, in double: [layers, kv_heads, capacity], 0 past
/// the lengths. The group's sums combined by `agg`, divided by the row count with
/// `normalize` (0 for a slot no row saw), times ‖V‖₁ with `value_weighted`.
std::vector<double> accumulated_scores(triattn_test::test_cache& cache, const accumulated_sums& state,
                                       triattn::gqa_aggregation agg, bool normalize, bool value_weighted);

/// A keep set of the oracle, and whether it is decided by less than the tolerance.
struct oracle_keep {
  std::vector<std::int32_t> keep;  ///< ascending
  bool near_tie = false;  ///< the last kept and the first dropped candidate differ, by less than the tolerance
};

/// The keep set of a row of `n` scores under `split`: all of them when n <= total; else the
/// first `sinks` and last `recent` slots and the best-scoring others up to the total, ties to
/// the lower slot. `relative_tolerance` decides `near_tie`.
oracle_keep accumulated_keep(const double* scores, std::int32_t n, const triattn::h2o_split& split,
                             double relative_tolerance);

}  // namespace triattn_cuda_test::cpu
