/// \file triattn/policies/streaming_llm.hpp
/// \brief StreamingLLM (Xiao et al. 2023): attention sinks plus a recent window.
///
/// Keeps the first `sinks` slots and the last `budget - sinks` slots of every (layer,
/// kv_head); reads no scores, only slot order. With `reposition`, survivors are renumbered
/// to their slot index and post-RoPE keys are re-rotated accordingly (the paper's pos_shift
/// mode: relative distances become distances within the cache). The engine must then rotate
/// the next query at position `length` instead of its position in the text.
#pragma once

#include <cstdint>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/policies/policy.hpp"

TRIATTN_NAMESPACE_BEGIN

struct streaming_llm_config {
  std::int64_t sinks = 4;   ///< attention sinks always kept (the paper's "four initial tokens")
  bool reposition = false;  ///< renumber survivors to positions within the cache (pos_shift)
};

/// Slot kept at output index i when `n` slots are cut to `budget` with `sinks` sinks: the
/// index-only rule, shared by the CPU and CUDA paths. Requires i < min(budget, n).
TRIATTN_HOST_DEVICE std::int64_t streaming_keep_slot(std::int64_t i, std::int64_t n, std::int64_t budget,
                                                     std::int64_t sinks) {
  if (n <= budget) return i;
  const std::int64_t s = sinks < budget ? sinks : budget;
  return i < s ? i : n - (budget - s) + (i - s);
}

class streaming_llm : public policy_base<streaming_llm> {
 public:
  streaming_llm_config config;

  streaming_llm() = default;
  explicit streaming_llm(streaming_llm_config c) : config(c) {
    TRIATTN_CHECK(c.sinks >= 0, "triattn::streaming_llm", "sinks ", c.sinks, " must be >= 0");
  }

  /// Keep plan: per (layer, kv_head), the sinks and the most recent slots.
  template <KVCacheView V>
  keep_plan plan(const V& view, std::int64_t budget) const {
    TRIATTN_CHECK(budget >= 1, "triattn::streaming_llm::plan", "budget ", budget, " must be >= 1");
    const kv_geometry& g = view.geometry();
    keep_plan p(g.num_layers, g.num_kv_heads);
    std::vector<std::int32_t> keep;
    for (int l = 0; l < g.num_layers; ++l) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        const std::int64_t n = view.length(l, h);
        keep.resize(static_cast<std::size_t>(n < budget ? n : budget));
        for (std::size_t i = 0; i < keep.size(); ++i)
          keep[i] = static_cast<std::int32_t>(streaming_keep_slot(static_cast<std::int64_t>(i), n, budget, config.sinks));
        p.push_row(keep);
      }
    }
    return p;
  }

  /// With `reposition`: slot i now holds position i; post-RoPE keys are rotated to match.
  template <KVCacheView V>
  void after_compact(const V& view, const keep_plan&) const {
    if (!config.reposition) return;
    const kv_geometry& g = view.geometry();
    std::vector<float> k(static_cast<std::size_t>(g.head_dim));
    for (int l = 0; l < g.num_layers; ++l) {
      for (int h = 0; h < g.num_kv_heads; ++h) {
        for (std::int32_t s = 0; s < view.length(l, h); ++s) {
          std::int32_t& pos = view.position(l, h, s);
          if (pos == s) continue;
          if (g.keys == key_state::post_rope) {
            load_key(view, l, h, s, k.data());
            rope_shift(g.rope, k.data(), g.head_dim, pos, s);
            store_key(view, l, h, s, k.data());
          }
          pos = s;
        }
      }
    }
  }
};

TRIATTN_NAMESPACE_END
