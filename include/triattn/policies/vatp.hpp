/// \file triattn/policies/vatp.hpp
/// \brief VATP, value-aware token pruning (Guo et al., EMNLP 2024): H2O's accumulated attention
/// weighted by each token's value L1 norm, with the attention sinks always kept.
///
/// **Score** (cli.md), layer l, KV head g, slot j: the H2O score (h2o.hpp, including its
/// options: GQA aggregation, normalisation, Scissorhands prompt scoring) times ‖V[l,g,j,:]‖₁.
/// The norms are read from the cache at score time, so they are exact and move with it. The
/// reference multiplies each step's column sums by the norm before accumulating, which is the
/// same since a token's norm never changes.
///
/// **Decision**: H2O's, with `sinks` = 4 by default: value norms of attention sinks are tiny,
/// so VATP would evict them. A budget B splits as 4 sinks, recent = B/2, heavy the rest (the
/// sinks take the first heavy places, as the reference's dtype-max sink scores do).
///
/// **Reference settings** (guozhiyu/vatp): `--h2o` runs are `h2o_setting` (heavy = recent =
/// int(r x prompt length), README r = 0.25, `--sink_len 20`); the default runs are
/// `scissorhands_setting` (initial score = the last 400 prompt rows / 400, recent 10, heavy =
/// the rest of a budget of 2·int(r·L0)). The reference masks instead of dropping and sums in fp16.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/policies/accumulated_math.hpp"
#include "triattn/policies/h2o.hpp"

TRIATTN_NAMESPACE_BEGIN

/// H2O's options with VATP's default of 4 sinks.
struct vatp_config : h2o_config {
  vatp_config() { sinks = 4; }

  /// The reference's `--h2o --apval` runs: heavy = recent = int(ratio x prompt length), with
  /// `sink_len` sinks. Needs the round's `round_context::prompt_length`.
  static vatp_config h2o_setting(double ratio = 0.25, std::int64_t sink_len = 20) {
    vatp_config c;
    c.heavy_ratio = ratio;
    c.recent_ratio = ratio;
    c.sinks = sink_len;
    return c;
  }

  /// The reference's default (Scissorhands) `--apval` runs: the last 400 prompt rows, each
  /// weighted 1/400, then every decode row; recent 10, heavy the rest of the round's budget.
  /// Needs `set_prompt_length` before the prompt is observed.
  static vatp_config scissorhands_setting(std::int64_t sink_len = 20) {
    vatp_config c;
    c.recent = 10;
    c.sinks = sink_len;
    c.prompt = prompt_scoring::last_window;
    return c;
  }
};

/// VATP. Per (layer, kv_head) decisions by default; state per (layer, q-head, slot).
class vatp : public detail::accumulated_attention_policy<vatp, vatp_config> {
 public:
  static constexpr detail::accumulated_policy_names names{"triattn::vatp",
                                                          "triattn::vatp::attach",
                                                          "triattn::vatp::observe",
                                                          "triattn::vatp::score",
                                                          "triattn::vatp::split",
                                                          "triattn::vatp::set_prompt_length",
                                                          "triattn::vatp::after_compact"};

  static constexpr std::string_view name = "vatp";
  static constexpr const char* plan_api = "triattn::vatp::plan";

  using accumulated_attention_policy::accumulated_attention_policy;

  /// The score the decision ranks, of (layer, kv_head), into `out` [length]: the H2O score
  /// times the value's L1 norm (accumulated_math.hpp, shared with the CUDA path). Throws naming
  /// `api` for a value that is not finite.
  template <KVCacheView V>
  void row_score(const char* api, const V& view, int layer, int kv_head, std::span<float> out) const {
    attention_score(view, layer, kv_head, out);
    const int D = view.geometry().head_dim;
    std::vector<float> value(static_cast<std::size_t>(D));
    for (std::size_t s = 0; s < out.size(); ++s) {
      load_value(view, layer, kv_head, static_cast<std::int64_t>(s), value.data());
      const float norm = value_l1_norm(value.data(), D);
      TRIATTN_CHECK(std::isfinite(norm), api, "value of layer ", layer, " kv_head ", kv_head, " slot ", s,
                    " has L1 norm ", norm, ": values must be finite");
      out[s] = value_weighted_score(out[s], norm);
    }
  }
};

TRIATTN_NAMESPACE_END
