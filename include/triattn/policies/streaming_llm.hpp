/// \file triattn/policies/streaming_llm.hpp
/// \brief StreamingLLM (Xiao et al. 2023): attention sinks plus a recent window.
///
/// Keeps the first `sinks` slots and the last `budget - sinks` slots of every decision; reads
/// no scores, only slot order: its rule protects exactly what it keeps, so the round pipeline
/// never asks it for a score. With `reposition`, survivors are renumbered
/// to their slot index and post-RoPE keys are re-rotated accordingly (the paper's pos_shift
/// mode: relative distances become distances within the cache). The engine must then rotate
/// the next query at position `length` instead of its position in the text.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "triattn/core/compaction.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/core/round.hpp"
#include "triattn/policies/policy.hpp"

TRIATTN_NAMESPACE_BEGIN

struct streaming_llm_config {
  std::int64_t sinks = 4;   ///< attention sinks always kept (the paper's "four initial tokens")
  bool reposition = false;  ///< renumber survivors to positions within the cache (pos_shift)
  round_options round{granularity::per_layer, row_reduction::mean, budget_mode::with_prompt, false,
                      schedule::every_step()};
};

/// StreamingLLM's rule for a round of `budget` slots: the first min(sinks, budget) slots and
/// the most recent rest are protected, which fills the budget. Shared by the CPU and CUDA paths.
TRIATTN_HOST_DEVICE row_rule streaming_rule(std::int64_t sinks, std::int64_t budget) {
  const std::int64_t s = sinks < budget ? sinks : budget;
  return {protection::sinks_and_recent(s, budget - s), budget};
}

class streaming_llm : public policy_base<streaming_llm> {
 public:
  static constexpr std::string_view name = "streaming_llm";
  static constexpr const char* plan_api = "triattn::streaming_llm::plan";
  streaming_llm_config config;

  streaming_llm() = default;
  explicit streaming_llm(streaming_llm_config c) : config(c) { validate_config("triattn::streaming_llm"); }

  const round_options& round() const { return config.round; }

  row_rule rule(const round_info& info) const { return streaming_rule(config.sinks, info.budget); }

  /// Never asked for a score (the rule protects the whole budget); every slot scores 0.
  struct row_scorer {
    void score(int, int, std::span<const std::uint8_t>, std::span<float> out) const {
      std::fill(out.begin(), out.end(), 0.0f);
    }
  };
  template <KVCacheView V>
  row_scorer begin_round(const char* api, const V&, const round_info&) const {
    validate_config(api);
    return {};
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

 private:
  void validate_config(const char* api) const {
    TRIATTN_CHECK(config.sinks >= 0, api, "sinks ", config.sinks, " must be >= 0");
  }
};

TRIATTN_NAMESPACE_END
