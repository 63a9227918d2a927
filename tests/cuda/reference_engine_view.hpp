// The CPU side of cuda_engine_view.cu: the library's CPU path over the engine's own view
// (engine_view.hpp), built by the C++ compiler (reference_engine_view.cpp).
#pragma once

#include <cstdint>

#include "cuda/engine_view.hpp"
#include "cuda/reference.hpp"
#include "support/views.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/policies/triattention_config.hpp"

namespace triattn_cuda_test::cpu {

/// Whether the CPU path reads every key and value row of `engine` (`triattn::load_key` /
/// `load_value`: the view's accessors), every slot up to the capacity, as exactly `mirror`'s floats.
bool reads_as_mirror(engine_cache& engine, triattn_test::test_cache& mirror);

/// triattn::triattention::plan's rows over the engine view itself (its accessor decodes).
keep_rows triattention_plan(engine_cache& engine, const triattn::query_stats& stats,
                            const triattn::triattention_config& config, std::int64_t round_start,
                            std::int64_t prompt_length, std::int64_t budget);

}  // namespace triattn_cuda_test::cpu
