/// \file triattn/policies/knorm.hpp
/// \brief K-norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV
/// Cache Compression", arXiv:2406.11430): keys with a small L2 norm draw attention, so keep
/// the smallest.
///
/// **Score**, layer l, kv head g, slot j: s[j] = −‖K[l,g,j,:]‖₂ (key_only_math.hpp), per
/// (layer, kv head): the key is all it reads, so a GQA group needs no aggregation. The norm is
/// taken of the key as cached: RoPE rotates pairs of dims, so pre- and post-RoPE keys have one
/// norm (up to a model's uniform RoPE attention scale, which ranks no key differently).
/// kvpress `KnormPress` scores the same; its press keeps no sinks, and neither does this
/// policy: the round's `sinks`, `recent` and prompt protection are the caller's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/policies/key_only_math.hpp"
#include "triattn/policies/key_scored.hpp"

TRIATTN_NAMESPACE_BEGIN

class knorm : public key_scored_policy<knorm> {
 public:
  static constexpr std::string_view name = "knorm";
  static constexpr const char* plan_api = "triattn::knorm::plan";
  static constexpr const char* score_api = "triattn::knorm::score";

  using key_scored_policy::key_scored_policy;

  /// −‖k‖₂ of every slot of (layer, kv_head) into `out` [length].
  template <KVCacheView V>
  static void score_row(const char* api, const V& view, int layer, int kv_head, std::span<float> out,
                        key_scratch& sc) {
    const int D = view.geometry().head_dim;
    sc.floats.resize(static_cast<std::size_t>(D));
    for (std::size_t s = 0; s < out.size(); ++s) {
      load_key(view, layer, kv_head, static_cast<std::int64_t>(s), sc.floats.data());
      check_key_finite(api, sc.floats.data(), D, layer, kv_head, static_cast<std::int64_t>(s));
      out[s] = knorm_score(l2_norm(sc.floats.data(), D));
    }
  }
};

TRIATTN_NAMESPACE_END
