/// \file triattn/policies/key_scored.hpp
/// \brief What the policies that score from the cached keys alone share (K-norm, KeyDiff):
/// their configuration, the round scaffolding and `score`. Such a policy observes nothing and
/// keeps no state; `Derived` provides `name`, `plan_api`, `score_api` and
///
///     template <KVCacheView V>
///     static void score_row(const char* api, const V& view, int layer, int kv_head,
///                           std::span<float> out, key_scratch& scratch);
///
/// writing one score per slot of (layer, kv_head) into `out` [length] and throwing naming
/// `api` for a key that is not finite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/round.hpp"
#include "triattn/core/schedule.hpp"
#include "triattn/core/value_weighting.hpp"
#include "triattn/policies/policy.hpp"
#include "triattn/policies/query_window.hpp"

TRIATTN_NAMESPACE_BEGIN

/// The options of a key-scored policy: the round's only. No protection of its own: the
/// round's sinks, recent window and prompt (`round_options`) are the caller's choice.
struct key_scored_config {
  round_options round{granularity::per_layer, row_reduction::mean, budget_mode::with_prompt, false,
                      schedule::with_slack(128)};
};

/// Buffers a row scorer reuses across the (layer, kv_head) rows it scores.
struct key_scratch {
  row_matrix keys;           ///< [n, head_dim] post-RoPE keys (`window_keys`), when not read in place
  std::vector<float> floats;  ///< per-slot or per-dim values of the policy's own
};

template <class Derived>
class key_scored_policy : public policy_base<Derived> {
 public:
  key_scored_config config;
  /// Key-only scores rank like logits (−‖k‖, −cos): a value weight adds ln w.
  static constexpr score_domain domain = score_domain::logit;

  key_scored_policy() = default;
  explicit key_scored_policy(key_scored_config c) : config(c) {}

  const round_options& round() const { return config.round; }

  /// Needs nothing beyond the view the pipeline has validated.
  template <KVCacheView V>
  auto begin_round(const char* api, const V& view, const round_info&) const {
    return row_scorer<V>{&view, api, {}};
  }

  /// Scores into `out` [num_layers, num_kv_heads, capacity]: one score per slot below each
  /// (layer, kv_head)'s length (the rest left as they are). Throws `triattn::error` naming
  /// `Derived::score_api` for a malformed view, an output of the wrong size or a non-finite key.
  template <KVCacheView V>
  void score(const V& view, std::span<float> out) const {
    const char* api = Derived::score_api;
    view.validate(api);
    key_scratch sc;
    for_each_score_row(api, view, out,
                       [&](int l, int h, std::span<float> row) { Derived::score_row(api, view, l, h, row, sc); });
  }

 private:
  template <KVCacheView V>
  struct row_scorer {
    const V* view;
    const char* api;
    key_scratch sc;
    void score(int layer, int kv_head, std::span<const std::uint8_t>, std::span<float> out) {
      Derived::score_row(api, *view, layer, kv_head, out, sc);
    }
  };
};

TRIATTN_NAMESPACE_END
