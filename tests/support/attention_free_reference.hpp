// Slow, double-precision oracles of the attention-free scorers (K-norm, KeyDiff, Expected
// Attention), transcribed from their papers' formulas as docs/attention_free.md states them,
// sharing no code with the library: keys decoded by the reference (support/reference.hpp),
// rotated by its own RoPE, rotations as explicit matrices.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/reference.hpp"
#include "support/views.hpp"

namespace triattn_test::ref {

/// ‖x‖₂ in double.
inline double l2_norm(const std::vector<double>& x) {
  double s = 0.0;
  for (const double v : x) s += v * v;
  return std::sqrt(s);
}

/// Key of slot s of (layer, kv_head) after RoPE: as stored for a post-RoPE cache, rotated to
/// its position for a pre-RoPE one.
inline std::vector<double> post_rope_key(test_cache& c, int layer, int kv_head, std::int64_t s) {
  const std::vector<double> k = c.key(layer, kv_head, s);
  if (c.shape().keys == triattn::key_state::post_rope) return k;
  return rotate(c.shape().rope, k, c.position(layer, kv_head, s));
}

/// K-norm: −‖k_j‖₂ of every slot [0, length) of (layer, kv_head), the key as stored.
inline std::vector<double> knorm_scores(test_cache& c, int layer, int kv_head) {
  std::vector<double> out;
  for (std::int32_t s = 0; s < c.length(layer, kv_head); ++s) out.push_back(-l2_norm(c.key(layer, kv_head, s)));
  return out;
}

/// KeyDiff: −cos(k_j, a) with a the mean of the unit post-RoPE keys of the row, every norm
/// floored at 1e-12 (a zero key or anchor has cosine 0).
inline std::vector<double> keydiff_scores(test_cache& c, int layer, int kv_head) {
  const std::int32_t n = c.length(layer, kv_head);
  std::vector<std::vector<double>> keys;
  std::vector<double> anchor(static_cast<std::size_t>(c.shape().head_dim), 0.0);
  for (std::int32_t s = 0; s < n; ++s) {
    keys.push_back(post_rope_key(c, layer, kv_head, s));
    const double norm = std::max(l2_norm(keys.back()), 1e-12);
    for (std::size_t d = 0; d < anchor.size(); ++d) anchor[d] += keys.back()[d] / norm / n;
  }
  const double anchor_norm = std::max(l2_norm(anchor), 1e-12);
  std::vector<double> out;
  for (const auto& k : keys) {
    const double norm = std::max(l2_norm(k), 1e-12);
    double dot = 0.0;
    for (std::size_t d = 0; d < k.size(); ++d) dot += k[d] * anchor[d];
    out.push_back(-dot / (norm * anchor_norm));
  }
  return out;
}

}  // namespace triattn_test::ref

namespace triattn_test::ref {

/// RoPE's rotation at position `t` as a D x D matrix: a·[[cos, −sin], [sin, cos]] on each
/// rotated band (the model's pairing), the identity on dims past the rotary ones.
inline std::vector<double> rope_matrix(const triattn::rope_desc& r, int head_dim, double t) {
  const int rotary = r.rotary_dim > 0 ? r.rotary_dim : head_dim;
  const auto w = inv_freq(r, rotary);
  std::vector<double> m(static_cast<std::size_t>(head_dim) * head_dim, 0.0);
  for (int d = rotary; d < head_dim; ++d) m[d * head_dim + d] = 1.0;
  for (int f = 0; f < rotary / 2; ++f) {
    const auto [re, im] = band_dims(r.style, rotary, f);
    const double c = r.attention_scale * std::cos(t * w[f]), s = r.attention_scale * std::sin(t * w[f]);
    m[re * head_dim + re] = c;
    m[re * head_dim + im] = -s;
    m[im * head_dim + re] = s;
    m[im * head_dim + im] = c;
  }
  return m;
}

/// y = M x for a D x D matrix.
inline std::vector<double> mat_vec(const std::vector<double>& m, const std::vector<double>& x) {
  const std::size_t D = x.size();
  std::vector<double> y(D, 0.0);
  for (std::size_t a = 0; a < D; ++a)
    for (std::size_t b = 0; b < D; ++b) y[a] += m[a * D + b] * x[b];
  return y;
}

/// The pre-RoPE statistics of one q-head: mean [D] and covariance [D x D].
struct query_moments {
  std::vector<double> mean, cov;
};

/// The moments of post-RoPE queries `q` [m][D] at `positions` [m], each rotated back to
/// position 0 (the inverse of `rope_matrix`: its transpose over a²), those below `sinks` left
/// out; the covariance divides by their count (0 without `covariance`). Empty `mean` when no
/// query is left.
inline query_moments moments_of(const triattn::rope_desc& r, const std::vector<std::vector<double>>& q,
                                const std::vector<std::int32_t>& positions, std::int64_t sinks, bool covariance) {
  const int D = q.empty() ? 0 : static_cast<int>(q.front().size());
  std::vector<std::vector<double>> pre;
  for (std::size_t i = 0; i < q.size(); ++i) {
    if (positions[i] < sinks) continue;
    const auto m = rope_matrix(r, D, positions[i]);
    std::vector<double> x(static_cast<std::size_t>(D), 0.0);
    for (int a = 0; a < D; ++a)
      for (int b = 0; b < D; ++b) x[a] += m[b * D + a] * q[i][b];  // Mᵀ q
    const int rotary = r.rotary_dim > 0 ? r.rotary_dim : D;
    for (int a = 0; a < rotary; ++a) x[a] /= r.attention_scale * r.attention_scale;
    pre.push_back(x);
  }
  query_moments out;
  if (pre.empty()) return out;
  out.mean.assign(static_cast<std::size_t>(D), 0.0);
  out.cov.assign(static_cast<std::size_t>(D) * D, 0.0);
  for (const auto& x : pre)
    for (int a = 0; a < D; ++a) out.mean[a] += x[a] / static_cast<double>(pre.size());
  if (covariance)
    for (const auto& x : pre)
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b)
          out.cov[a * D + b] += (x[a] - out.mean[a]) * (x[b] - out.mean[b]) / static_cast<double>(pre.size());
  return out;
}

/// Expected Attention of one row of `c` (docs/attention_free.md): `moments` [G] of its q-heads,
/// the round start `T`, the mean rotation over [T, T + future); keys after RoPE, softmax over
/// the `candidate` slots of z_j = m̄·k_j/√D + k_jᵀ C k_j/(2D) (m̄ = R̄ μ, C = R̄ Σ R̄ᵀ), the
/// q-heads' mean, then (p + ε)·‖v_j‖₂ (or p + ε). Non-candidates score 0.
inline std::vector<double> expected_attention_scores(test_cache& c, int layer, int kv_head,
                                                     const std::vector<query_moments>& moments, double T,
                                                     std::int64_t future, const std::vector<bool>& candidate,
                                                     bool value_norm, double epsilon) {
  const int D = c.shape().head_dim;
  const std::int32_t n = c.length(layer, kv_head);
  std::vector<double> rbar(static_cast<std::size_t>(D) * D, 0.0);
  for (std::int64_t t = 0; t < future; ++t) {
    const auto m = rope_matrix(c.shape().rope, D, T + static_cast<double>(t));
    for (std::size_t i = 0; i < m.size(); ++i) rbar[i] += m[i] / static_cast<double>(future);
  }
  std::vector<std::vector<double>> keys;
  for (std::int32_t s = 0; s < n; ++s) keys.push_back(post_rope_key(c, layer, kv_head, s));
  std::vector<double> p(static_cast<std::size_t>(n), 0.0);
  for (const auto& mo : moments) {
    const auto mbar = mat_vec(rbar, mo.mean);
    // C = R̄ Σ R̄ᵀ
    std::vector<double> cm(static_cast<std::size_t>(D) * D, 0.0);
    for (int a = 0; a < D; ++a)
      for (int b = 0; b < D; ++b)
        for (int x = 0; x < D; ++x)
          for (int y = 0; y < D; ++y) cm[a * D + b] += rbar[a * D + x] * mo.cov[x * D + y] * rbar[b * D + y];
    std::vector<double> z(static_cast<std::size_t>(n), -std::numeric_limits<double>::infinity());
    double top = -std::numeric_limits<double>::infinity();
    for (std::int32_t j = 0; j < n; ++j) {
      if (!candidate[j]) continue;
      double lin = 0.0, quad = 0.0;
      for (int a = 0; a < D; ++a) lin += mbar[a] * keys[j][a];
      for (int a = 0; a < D; ++a)
        for (int b = 0; b < D; ++b) quad += keys[j][a] * cm[a * D + b] * keys[j][b];
      z[j] = lin / std::sqrt(static_cast<double>(D)) + quad / (2.0 * D);
      top = std::max(top, z[j]);
    }
    double sum = 0.0;
    for (std::int32_t j = 0; j < n; ++j)
      if (candidate[j]) sum += std::exp(z[j] - top);
    for (std::int32_t j = 0; j < n; ++j)
      if (candidate[j]) p[j] += std::exp(z[j] - top) / sum / static_cast<double>(moments.size());
  }
  std::vector<double> out(static_cast<std::size_t>(n), 0.0);
  for (std::int32_t j = 0; j < n; ++j) {
    if (!candidate[j]) continue;
    out[j] = value_norm ? (p[j] + epsilon) * l2_norm(c.value(layer, kv_head, j)) : p[j] + epsilon;
  }
  return out;
}

}  // namespace triattn_test::ref
