/// \file triattn/core/value_weighting.hpp
/// \brief Value-aware correction for every policy (`round_options::value_aware`): each
/// candidate's score weighted by how much its value would move the layer's output, written
/// once for the CPU pipeline and the GPU one (cuda/round.cuh), the same float operations in
/// the same order on both sides.
///
/// **Source**: CriticalKV (Feng et al., "Identify Critical KV Cache in LLM Inference from an
/// Output Perturbation Perspective", arXiv:2502.03805; kvpress `CriticalKVPress`): evicting
/// token j perturbs the attention output by its attention weight times its value as the
/// output projection sees it, so the score to rank is a_j ‖W_o v_j‖. Here it applies to any
/// policy's score, attention-reading or not.
///
/// **Weight**, layer l, kv head g of group size G, slot j, value v_j [head_dim] (dequantised):
///
///     w_j = (1/G) Σ_{h in g} sqrt(v_jᵀ M_{l,h} v_j) = (1/G) Σ_h ‖W_o,h v_j‖₂
///                                               with the projection (M = W_o,hᵀ W_o,h),
///     w_j = ‖v_j‖₂                              without one,
///
/// W_o,h [hidden, head_dim] the columns of the layer's output projection that q-head h's
/// output meets. The engine passes M per (layer, q-head) (`value_projection`, built from W_o
/// by `output_gram`): head_dim² floats per q-head, and a slot costs head_dim² per q-head
/// instead of head_dim x hidden.
///
/// **Score** by the policy's `score_domain`: `weight` (proportional to attention mass: H2O,
/// VATP, SnapKV, R-KV, Expected Attention) multiplies, s·w; `logit` (a log-attention up to a
/// per-row affine map: TriAttention, K-norm, KeyDiff) adds, s + ln w, which is exp(s)·w.
///
/// **Differences from CriticalKV**: the L2 norm of W_o v (CriticalKV takes L1, which needs the
/// whole W_o,h per slot); one stage (kvpress first keeps half the budget by the plain score,
/// then weights the rest); no ε added to the score (Expected Attention adds its own).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/kv_cache_view.hpp"

TRIATTN_NAMESPACE_BEGIN

/// What a policy's scores measure, so that a value weight can apply to them (see the file
/// comment). A policy declares `static constexpr score_domain domain`; without it, `weight`.
enum class score_domain : std::uint8_t {
  weight,  ///< proportional to the attention a slot draws: weighted by multiplying
  logit,   ///< a log-attention, up to a per-row affine map: weighted by adding ln w
};

/// The domain policy (or device scorer) `P` declares.
template <class P>
constexpr score_domain score_domain_of() {
  if constexpr (requires { P::domain; }) {
    return P::domain;
  } else {
    return score_domain::weight;
  }
}

/// The output projection as a value weight reads it: one [head_dim, head_dim] matrix
/// M = W_o,hᵀ W_o,h per (layer, q-head), row-major, in host memory for the CPU pipeline and in
/// device memory for the GPU one. Non-owning.
struct value_projection {
  int num_layers = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  const float* gram = nullptr;  ///< [num_layers, num_q_heads, head_dim, head_dim]

  /// M of (layer, q_head).
  TRIATTN_HOST_DEVICE const float* head(int layer, int q_head) const {
    return gram + (static_cast<std::int64_t>(layer) * num_q_heads + q_head) * head_dim * head_dim;
  }

  /// The projection's first problem against a cache of geometry `g`, or "" (a message, not a
  /// throw, so that the CUDA entry point checks the same rules).
  std::string error(const kv_geometry& g) const {
    std::ostringstream os;
    if (num_layers != g.num_layers || num_q_heads != g.num_q_heads || head_dim != g.head_dim) {
      os << "value projection of " << num_layers << " layers x " << num_q_heads << " q_heads x head_dim " << head_dim
         << " does not match the cache's " << g.num_layers << " x " << g.num_q_heads << " x " << g.head_dim;
    } else if (gram == nullptr) {
      os << "value projection has no data (gram is null)";
    }
    return os.str();
  }
  /// Throws naming `api` unless the projection has `g`'s shape and data.
  void validate(const char* api, const kv_geometry& g) const {
    const std::string e = error(g);
    TRIATTN_CHECK(e.empty(), api, e);
  }
};

/// The Gram matrices of one layer's output projection `w_o` [hidden, num_q_heads x head_dim]
/// (row-major, y = W_o x, as PyTorch's `o_proj.weight` and GGUF's `attn_output`), appended to
/// `out` as [num_q_heads, head_dim, head_dim]: what `value_projection::gram` holds per layer.
/// Sums in double.
inline void append_output_gram(std::span<const float> w_o, int hidden, int num_q_heads, int head_dim,
                               std::vector<float>& out) {
  const char* api = "triattn::append_output_gram";
  TRIATTN_CHECK(hidden > 0 && num_q_heads > 0 && head_dim > 0, api, "hidden ", hidden, ", num_q_heads ", num_q_heads,
                " and head_dim ", head_dim, " must be >= 1");
  const std::int64_t cols = std::int64_t{num_q_heads} * head_dim;
  TRIATTN_CHECK(std::ssize(w_o) == hidden * cols, api, "w_o holds ", w_o.size(), " floats, expected hidden ", hidden,
                " x num_q_heads ", num_q_heads, " x head_dim ", head_dim);
  for (int h = 0; h < num_q_heads; ++h)
    for (int a = 0; a < head_dim; ++a)
      for (int b = 0; b < head_dim; ++b) {
        double m = 0.0;
        for (std::int64_t i = 0; i < hidden; ++i)
          m += static_cast<double>(w_o[i * cols + h * head_dim + a]) * w_o[i * cols + h * head_dim + b];
        out.push_back(static_cast<float>(m));
      }
}

/// ‖W_o,h v‖₂ = sqrt(vᵀ M v) for v [n] and M [n, n] (0 where rounding makes vᵀ M v negative;
/// NaN stays NaN, for the caller to refuse).
TRIATTN_HOST_DEVICE float projected_norm(const float* v, const float* m, int n) {
  float acc = 0.0f;
  for (int a = 0; a < n; ++a) acc = multiply_add(v[a], fixed_order_dot(m + static_cast<std::int64_t>(a) * n, v, n), acc);
  return acc < 0.0f ? 0.0f : sqrtf(acc);
}

/// The weight of value `v` [head_dim] of (layer, kv_head): the mean over the kv head's `group`
/// q-heads of its projected norms, or ‖v‖₂ when `projection` is null.
TRIATTN_HOST_DEVICE float value_weight(const float* v, const value_projection* projection, int layer, int kv_head,
                                       int group, int head_dim) {
  if (projection == nullptr) return sqrtf(fixed_order_dot(v, v, head_dim));
  float sum = 0.0f;
  for (int i = 0; i < group; ++i) sum += projected_norm(v, projection->head(layer, kv_head * group + i), head_dim);
  return sum / static_cast<float>(group);
}

/// Weights below this count as it for `logit` scores, so that ln w stays finite (a zero value
/// then ranks below every value that moves the output).
inline constexpr float value_weight_floor = 1e-30f;

/// Score `s` of a slot weighted by its value weight `w` in `domain` (see the file comment).
TRIATTN_HOST_DEVICE float value_weighted(float s, float w, score_domain domain) {
  if (domain == score_domain::weight) return s * w;
  return s + logf(w > value_weight_floor ? w : value_weight_floor);
}

namespace detail {
/// Weights the scores `row` [length] of row (layer, kv_head) of `view` where `candidate` [length]
/// is 1, in `domain`, reading each value into `value` (the caller's scratch); throws naming
/// `api` for a value whose weight is not finite.
template <KVCacheView V>
void weight_by_values(const char* api, const V& view, int layer, int kv_head, const value_projection* projection,
                      score_domain domain, std::span<const std::uint8_t> candidate, std::span<float> row,
                      std::vector<float>& value) {
  const kv_geometry& g = view.geometry();
  value.resize(static_cast<std::size_t>(g.head_dim));
  for (std::size_t s = 0; s < row.size(); ++s) {
    if (candidate[s] == 0) continue;
    load_value(view, layer, kv_head, static_cast<std::int64_t>(s), value.data());
    const float w = value_weight(value.data(), projection, layer, kv_head, g.group_size(), g.head_dim);
    TRIATTN_CHECK(std::isfinite(w), api, "value of layer ", layer, " kv_head ", kv_head, " slot ", s, " has weight ", w,
                  ": values must be finite");
    row[s] = value_weighted(row[s], w, domain);
  }
}
}  // namespace detail

TRIATTN_NAMESPACE_END
