/// \file triattn/policies/keydiff.hpp
/// \brief KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for
/// Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364): keep
/// the keys least like the average key, the most distinctive directions.
///
/// **Score**, layer l, kv head g holding n slots, post-RoPE keys k_j:
///
///     u_j = k_j / max(‖k_j‖₂, 1e-12),   a = Σ_j u_j  (every slot of the row, in slot order),
///     s[j] = −cos(k_j, a) = −(k_j · a) / (max(‖k_j‖₂, 1e-12) · max(‖a‖₂, 1e-12))
///
/// (key_only_math.hpp). The paper's anchor is the mean of the unit keys; the sum has its
/// direction, which is all a cosine reads. kvpress `KeyDiffPress` scores the same over the
/// keys it compresses (its anchor spans the whole cache, as here: protected slots included).
/// Keys of a `key_state::pre_rope` view are rotated to their positions first (`window_keys`),
/// so both key states keep the same tokens. No sinks of its own (the round's are the caller's).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/policies/key_only_math.hpp"
#include "triattn/policies/key_scored.hpp"
#include "triattn/policies/query_window.hpp"

TRIATTN_NAMESPACE_BEGIN

class keydiff : public key_scored_policy<keydiff> {
 public:
  static constexpr std::string_view name = "keydiff";
  static constexpr const char* plan_api = "triattn::keydiff::plan";
  static constexpr const char* score_api = "triattn::keydiff::score";

  using key_scored_policy::key_scored_policy;

  /// −cos(k_j, anchor) of every slot of (layer, kv_head) into `out` [length].
  template <KVCacheView V>
  static void score_row(const char* api, const V& view, int layer, int kv_head, std::span<float> out,
                        key_scratch& sc) {
    const int D = view.geometry().head_dim;
    const auto n = static_cast<std::int64_t>(out.size());
    const key_map keys = window_keys(api, view, layer, kv_head, n, sc.keys);  // [n, D] post-RoPE
    sc.floats.assign(static_cast<std::size_t>(D), 0.0f);                    // the anchor [D]
    for (std::int64_t s = 0; s < n; ++s) keydiff_accumulate(keys.row(s).data(), D, sc.floats.data());
    for (std::int64_t s = 0; s < n; ++s) out[s] = keydiff_score(keys.row(s).data(), sc.floats.data(), D);
  }
};

TRIATTN_NAMESPACE_END
