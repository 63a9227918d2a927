// The CPU side of the CUDA tests: what each kernel is compared against. Declared here with
// plain types and defined in host .cpp files (reference_*.cpp) that the C++ compiler builds,
// so the library's CPU code, and Eigen where it uses it, never goes through nvcc.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "support/views.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/granularity.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/core/value_weighting.hpp"
#include "triattn/policies/expected_attention_math.hpp"
#include "triattn/policies/triattention_config.hpp"

namespace triattn_cuda_test::cpu {

/// Rows of keep indices, one per (layer, kv_head) in order, as the CPU plan or compaction has them.
using keep_rows = std::vector<std::vector<std::int32_t>>;

/// The rows of a CPU keep plan, in (layer, kv_head) order.
keep_rows rows_of(const triattn::keep_plan& p);

/// triattn::select_keep on one row.
std::vector<std::int32_t> select_keep(const std::vector<float>& scores, const std::vector<std::int32_t>& positions,
                                      const triattn::protection& prot, std::int64_t budget);

/// triattn::compact of `cache` and `states` with `keep` (one row per (layer, kv_head)).
void compact(triattn_test::test_cache& cache, const keep_rows& keep, std::span<const triattn::slot_state> states = {});

/// triattn::triattention::score: [layers, q_heads, capacity], slots past a length left at 0.
std::vector<float> triattention_scores(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                                       const triattn::triattention_config& config, std::int64_t round_start);

/// triattn::triattention::plan's rows for the round at `round_start` after a prompt of
/// `prompt_length` tokens (granularity `per_layer` or `per_kv_head`).
keep_rows triattention_plan(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                            const triattn::triattention_config& config, std::int64_t round_start,
                            std::int64_t prompt_length, std::int64_t budget);

/// The smallest score gap at a cut of the double-precision oracle's decision for the same round
/// (tests/support/triattention_reference.hpp), relative to the largest |raw score| when the
/// rows are not z-scored: keep sets of two fp32 scorers may only differ below this.
double triattention_margin(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                           const triattn::triattention_config& config, std::int64_t round_start,
                           std::int64_t prompt_length, std::int64_t budget);

/// The round pipeline's decision (core/round.hpp's steps 2-4) for one sequence from its row
/// scores `scores` [layers, kv_heads, capacity] (the floats the device scorer wrote): per
/// decision of `options.grain`, the rows folded in row order with `fold_row_score`, the
/// protection and keep count of `rule` plus the prompt, then `triattn::select_keep`; one keep
/// row per (layer, kv_head). Rows of a shared decision must hold the same slots. A value-aware
/// round weights each row's candidates first (`triattn::detail::weight_by_values` over the
/// cache's own view, in the scorer's `domain`, by `projection` or the plain norms).
keep_rows round_plan(triattn_test::test_cache& cache, const float* scores, const triattn::round_options& options,
                     const triattn::row_rule& rule, std::int64_t prompt_length,
                     triattn::score_domain domain = triattn::score_domain::weight,
                     const triattn::value_projection* projection = nullptr);

/// The CPU scores [layers, kv_heads, capacity] of the key-only policy `name` ("knorm",
/// "keydiff"): its `score` over the cache's own view; slots past a length left at 0.
std::vector<float> key_only_scores(triattn_test::test_cache& cache, const char* name);

/// The CPU plan of the key-only policy `name` for a round of `budget` (per_layer).
keep_rows key_only_plan(triattn_test::test_cache& cache, const char* name, std::int64_t budget);

/// triattn::expected_attention::score [layers, kv_heads, capacity] (the sinks +inf) for a round
/// at `round_start`, the policy having observed `queries` [layers, q_heads, rows, head_dim] at
/// `positions` [rows] (one sequence).
std::vector<float> expected_attention_scores(triattn_test::test_cache& cache, const triattn::expected_attention_config& config,
                                             std::span<const float> queries, std::span<const std::int32_t> positions,
                                             std::int64_t round_start);

/// triattn::streaming_llm::plan's rows.
keep_rows streaming_plan(triattn_test::test_cache& cache, std::int64_t sinks, std::int64_t budget);

}  // namespace triattn_cuda_test::cpu
