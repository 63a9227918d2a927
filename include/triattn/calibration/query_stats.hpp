/// \file triattn/calibration/query_stats.hpp
/// \brief TriAttention's calibration statistics: per (layer, q-head, band) the complex mean of
/// the pre-RoPE query E[q_f] and its mean modulus E[|q_f|], with the RoPE they belong to.
///
/// In memory this mirrors the `triattn.stats.v1` file (see stats_file.hpp): tensors
/// `q_mean_real`, `q_mean_imag`, `q_abs_mean` [num_layers, num_q_heads, head_dim/2] and
/// `inv_freq` [head_dim/2]. Band f pairs dims (f, f + head_dim/2) for `half` and (2f, 2f + 1)
/// for `interleaved`; query head h belongs to KV head h / (num_q_heads / num_kv_heads).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"

TRIATTN_NAMESPACE_BEGIN

struct query_stats {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  rope_style style = rope_style::half;
  double attention_scale = 1.0;  ///< RoPE's a (HF `attention_scaling`), 1 unless YaRN
  std::vector<double> inv_freq;  ///< [head_dim/2] w_f
  std::vector<float> q_mean_real;  ///< [num_layers, num_q_heads, head_dim/2] Re E[q_f]
  std::vector<float> q_mean_imag;  ///< [num_layers, num_q_heads, head_dim/2] Im E[q_f]
  std::vector<float> q_abs_mean;   ///< [num_layers, num_q_heads, head_dim/2] E[|q_f|]
  std::map<std::string, std::string> info;  ///< free-form metadata: model, num_tokens, source

  int num_bands() const { return head_dim / 2; }
  /// Offset of (layer, q_head, band 0) in the three per-head tensors.
  std::size_t row(int layer, int q_head) const {
    return (static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_q_heads) + static_cast<std::size_t>(q_head)) *
           static_cast<std::size_t>(num_bands());
  }

  /// Internal consistency: positive shapes, GQA divisibility, tensor sizes, finite values,
  /// positive frequencies. Throws `triattn::error` naming `api` and the field.
  void validate(const char* api) const {
    TRIATTN_CHECK(num_layers > 0, api, "stats num_layers ", num_layers, " must be >= 1");
    TRIATTN_CHECK(num_kv_heads > 0, api, "stats num_kv_heads ", num_kv_heads, " must be >= 1");
    TRIATTN_CHECK(num_q_heads > 0 && num_q_heads % num_kv_heads == 0, api, "stats num_q_heads ", num_q_heads,
                  " must be a positive multiple of num_kv_heads ", num_kv_heads);
    TRIATTN_CHECK(head_dim > 0 && head_dim % 2 == 0, api, "stats head_dim ", head_dim, " must be even and positive");
    TRIATTN_CHECK(attention_scale > 0.0 && std::isfinite(attention_scale), api, "stats attention_scale ",
                  attention_scale, " must be finite and > 0");
    TRIATTN_CHECK(inv_freq.size() == static_cast<std::size_t>(num_bands()), api, "stats inv_freq has ",
                  inv_freq.size(), " bands, expected head_dim/2 = ", num_bands());
    for (std::size_t f = 0; f < inv_freq.size(); ++f)
      TRIATTN_CHECK(inv_freq[f] > 0.0 && std::isfinite(inv_freq[f]), api, "stats inv_freq[", f, "] = ", inv_freq[f],
                    " must be finite and > 0");
    const std::size_t n = row(num_layers, 0);
    const std::pair<const char*, const std::vector<float>*> tensors[] = {
        {"q_mean_real", &q_mean_real}, {"q_mean_imag", &q_mean_imag}, {"q_abs_mean", &q_abs_mean}};
    for (const auto& [name, t] : tensors) {
      TRIATTN_CHECK(t->size() == n, api, "stats ", name, " holds ", t->size(), " values, expected ", num_layers, " x ",
                    num_q_heads, " x ", num_bands());
      for (std::size_t i = 0; i < n; ++i)
        TRIATTN_CHECK(std::isfinite((*t)[i]), api, "stats ", name, "[", i, "] = ", (*t)[i], " is not finite");
    }
    for (std::size_t i = 0; i < n; ++i)
      TRIATTN_CHECK(q_abs_mean[i] >= 0.0f, api, "stats q_abs_mean[", i, "] = ", q_abs_mean[i],
                    " is negative: it is a mean modulus");
  }

  /// Checks that these stats describe the model behind `g`: layers, q-heads, kv-heads,
  /// head_dim, RoPE pairing and inverse frequencies (relative 1e-5, as the reference's
  /// `verify_rotary_alignment`). Every mismatch is reported by name.
  void check_against(const char* api, const kv_geometry& g) const {
    validate(api);
    TRIATTN_CHECK(num_layers == g.num_layers, api, "stats num_layers ", num_layers, " != model num_layers ",
                  g.num_layers);
    TRIATTN_CHECK(num_q_heads == g.num_q_heads, api, "stats num_q_heads ", num_q_heads, " != model num_q_heads ",
                  g.num_q_heads);
    TRIATTN_CHECK(num_kv_heads == g.num_kv_heads, api, "stats num_kv_heads ", num_kv_heads,
                  " != model num_kv_heads ", g.num_kv_heads);
    TRIATTN_CHECK(head_dim == g.head_dim, api, "stats head_dim ", head_dim, " != model head_dim ", g.head_dim);
    TRIATTN_CHECK(rotary_dims(g.rope, g.head_dim) == g.head_dim, api, "rotary_dim ", g.rope.rotary_dim,
                  " < head_dim ", g.head_dim, ": TriAttention needs every dim rotated");
    TRIATTN_CHECK(style == g.rope.style, api, "stats rope_style ", style == rope_style::half ? "half" : "interleaved",
                  " != model rope style ", g.rope.style == rope_style::half ? "half" : "interleaved");
    TRIATTN_CHECK(std::abs(attention_scale - g.rope.attention_scale) <= 1e-6 * g.rope.attention_scale, api,
                  "stats attention_scale ", attention_scale, " != model rope attention_scale ", g.rope.attention_scale);
    for (int f = 0; f < num_bands(); ++f) {
      const double w = inv_freq[static_cast<std::size_t>(f)], m = inv_freq_of(g.rope, g.head_dim, f);
      TRIATTN_CHECK(std::abs(w - m) <= 1e-5 * m, api, "stats inv_freq[", f, "] = ", w, " != model inv_freq ", m);
    }
  }

 private:
  static double inv_freq_of(const rope_desc& r, int dim, int f) { return ::TRIATTN_NAMESPACE::inv_freq(r, dim, f); }
};

TRIATTN_NAMESPACE_END
