/// \file triattn/triattn.hpp
/// \brief Umbrella header: every host-side public header of triattn.
#pragma once

#include "triattn/calibration/accumulator.hpp"
#include "triattn/calibration/query_stats.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/selection.hpp"
#include "triattn/io/json.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/io/safetensors.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/triattention_math.hpp"
