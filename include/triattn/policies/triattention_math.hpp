/// \file triattn/policies/triattention_math.hpp
/// \brief The per-band and per-key arithmetic of the TriAttention score (folded one-pass form),
/// written once for the CPU scorer and the CUDA scorer.
///
/// Notation (spec triattention.md §1, §4): F = head_dim / 2 bands, w_f the RoPE inverse
/// frequencies, q̄_f the complex mean of the pre-RoPE query, m_f its mean modulus, a the RoPE
/// attention scale, r the round start (position of the next token), O the offsets.
/// For one query head and one key the score is
///
///     S(k) = Σ_f Re(c_f · conj K_f) + Σ_f e_f · |K_f|
///
/// with the round phasor W_f = mean_{o ∈ O} e^{i (r + o) w_f}, c_f = s · q̄_f · W_f,
/// e_f = s · (m_f − |q̄_f|), and K_f the key's band rotated to its position: the stored band for
/// post-RoPE keys (which carry one factor a, so s = a), or e^{i p w_f} κ_f for pre-RoPE keys
/// (s = a²). Either way S equals the reference's mean over offsets of
/// Σ_f a² |q̄_f| |κ_f| cos((r + o − p) w_f + φ_f) plus Σ_f a² (m_f − |q̄_f|) |κ_f|.
/// `max` aggregation over offsets does not fold: it uses one coefficient set per offset (W_f
/// of a single offset each) and takes the largest trig term.
///
/// Rules for this file: raw pointers and sizes only, no exceptions, no std::complex; phases
/// are formed and evaluated in double, everything per key runs in float.
#pragma once

#include <cmath>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/kv_cache_view.hpp"
#include "triattn/core/rope.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Number of offsets {1, 2, 4, ..., 2^j <= offset_max} (17 for the default 65536).
/// Requires offset_max >= 1.
TRIATTN_HOST_DEVICE int triattention_num_offsets(std::int64_t offset_max) {
  int n = 1;
  for (std::int64_t o = 1; o <= offset_max / 2; o *= 2) ++n;  // o <= max / 2: 2 o cannot overflow
  return n;
}

/// Offset j of the geometric set: 2^j.
TRIATTN_HOST_DEVICE std::int64_t triattention_offset(int j) { return std::int64_t{1} << j; }

/// The factor s of the coefficients: a for post-RoPE keys (their bands already carry one a),
/// a² for pre-RoPE keys, so that scores match Hugging Face's a²-weighted definition.
TRIATTN_HOST_DEVICE double triattention_coefficient_scale(double attention_scale, key_state keys) {
  return keys == key_state::post_rope ? attention_scale : attention_scale * attention_scale;
}

/// Round phasors of `num_bands` bands: W_f = (1/n) Σ_j e^{i (r + offsets[j]) w_f} over the
/// `num_offsets` = n offsets given. The phases (r + o) w_f are formed and evaluated in double
/// (r reaches 10^6 and more). Outputs `w_re`, `w_im` [num_bands].
TRIATTN_HOST_DEVICE void triattention_phasors(const double* inv_freq, int num_bands, std::int64_t round_start,
                                              const std::int64_t* offsets, int num_offsets, double* w_re,
                                              double* w_im) {
  for (int f = 0; f < num_bands; ++f) {
    double re = 0.0, im = 0.0;
    for (int j = 0; j < num_offsets; ++j) {
      const double phase = static_cast<double>(round_start + offsets[j]) * inv_freq[f];
      re += std::cos(phase);
      im += std::sin(phase);
    }
    w_re[f] = re / num_offsets;
    w_im[f] = im / num_offsets;
  }
}

/// Trig coefficients of one (layer, q-head) for one phasor set: c_f = scale · q̄_f · W_f,
/// computed in double and stored as float. Inputs: the stats rows `q_mean_re`, `q_mean_im`
/// [num_bands] and the phasors; outputs `c_re`, `c_im` [num_bands].
TRIATTN_HOST_DEVICE void triattention_trig_coefficients(const float* q_mean_re, const float* q_mean_im,
                                                        const double* w_re, const double* w_im, int num_bands,
                                                        double scale, float* c_re, float* c_im) {
  for (int f = 0; f < num_bands; ++f) {
    const double qr = q_mean_re[f], qi = q_mean_im[f];
    c_re[f] = static_cast<float>(scale * (qr * w_re[f] - qi * w_im[f]));
    c_im[f] = static_cast<float>(scale * (qr * w_im[f] + qi * w_re[f]));
  }
}

/// Norm coefficients of one (layer, q-head): e_f = scale · (m_f − |q̄_f|), offset-independent.
/// Output `e` [num_bands].
TRIATTN_HOST_DEVICE void triattention_norm_coefficients(const float* q_mean_re, const float* q_mean_im,
                                                        const float* q_abs_mean, int num_bands, double scale,
                                                        float* e) {
  for (int f = 0; f < num_bands; ++f) {
    const double qr = q_mean_re[f], qi = q_mean_im[f];
    e[f] = static_cast<float>(scale * (q_abs_mean[f] - std::sqrt(qr * qr + qi * qi)));
  }
}

/// Splits a key row `key` [head_dim] into its complex bands `k_re`, `k_im` and their moduli
/// `k_abs` [head_dim / 2], with the RoPE pairing `style`.
TRIATTN_HOST_DEVICE void triattention_key_bands(const float* key, int head_dim, rope_style style, float* k_re,
                                                float* k_im, float* k_abs) {
  for (int f = 0; f < head_dim / 2; ++f) {
    int re, im;
    rope_band_dims(style, head_dim, f, re, im);
    k_re[f] = key[re];
    k_im[f] = key[im];
    k_abs[f] = std::sqrt(key[re] * key[re] + key[im] * key[im]);
  }
}

/// Pre-RoPE keys: rotates the bands by e^{i p w_f} (no scale), so that Re(c_f conj K_f) equals
/// Re(c_f e^{-i p w_f} conj κ_f). The phase p w_f is formed and evaluated in double.
TRIATTN_HOST_DEVICE void triattention_rotate_bands(float* k_re, float* k_im, const double* inv_freq, int num_bands,
                                                   std::int64_t position) {
  for (int f = 0; f < num_bands; ++f) {
    const double phase = static_cast<double>(position) * inv_freq[f];
    const double c = std::cos(phase), s = std::sin(phase);
    const double re = k_re[f], im = k_im[f];
    k_re[f] = static_cast<float>(re * c - im * s);
    k_im[f] = static_cast<float>(re * s + im * c);
  }
}

namespace detail {
/// Σ_i a_i b_i in float over 8 independent partial sums: short dependency chains, and a loop
/// the compiler vectorises (a plain serial sum may not be reordered).
TRIATTN_HOST_DEVICE float triattention_dot(const float* a, const float* b, int n) {
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) part[k] += a[i + k] * b[i + k];
  for (; i < n; ++i) part[i % 8] += a[i] * b[i];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}
}  // namespace detail

/// Score of one key against one q-head: the largest over the `num_sets` coefficient sets
/// (`c_re`, `c_im` [num_sets, num_bands]; one set for mean aggregation) of Σ_f Re(c_f conj K_f),
/// plus Σ_f e_f |K_f| (`e` [num_bands]). Accumulates in float.
TRIATTN_HOST_DEVICE float triattention_key_score(const float* c_re, const float* c_im, int num_sets, const float* e,
                                                 const float* k_re, const float* k_im, const float* k_abs,
                                                 int num_bands) {
  float trig = 0.0f;
  for (int j = 0; j < num_sets; ++j) {
    const float t = detail::triattention_dot(c_re + j * num_bands, k_re, num_bands) +
                    detail::triattention_dot(c_im + j * num_bands, k_im, num_bands);
    trig = j == 0 || t > trig ? t : trig;
  }
  return trig + detail::triattention_dot(e, k_abs, num_bands);
}

/// One candidate's term of a row's sum of squared deviations from the row's mean, in double.
TRIATTN_HOST_DEVICE double triattention_squared_deviation(float x, double mean) {
  const double d = x - mean;
  return d * d;
}

/// Population standard deviation of a row of n candidate scores whose squared deviations sum
/// to `sum_sq`, floored at 1e-6 as the reference does (a constant row must not divide by 0).
TRIATTN_HOST_DEVICE double triattention_row_std(double sum_sq, std::int64_t n) {
  const double sd = std::sqrt(sum_sq / static_cast<double>(n));
  return sd > 1e-6 ? sd : 1e-6;
}

/// The z-score of one raw score, formed in double (the row's mean can dwarf its spread).
TRIATTN_HOST_DEVICE float triattention_zscore(float x, double mean, double std_dev) {
  return static_cast<float>((x - mean) / std_dev);
}

/// The weight of each layer in a per-KV-head decision: the mean over the layers.
TRIATTN_HOST_DEVICE float triattention_layer_weight(int num_layers) { return 1.0f / static_cast<float>(num_layers); }

/// `weight` x the GQA reduction of one slot over the `group` q-head rows of its KV head:
/// `rows` points at the slot in the first q-head's row, the others follow `stride` apart. `max`
/// takes the largest (as std::max), else the mean.
TRIATTN_HOST_DEVICE float triattention_group_term(const float* rows, int group, std::int64_t stride, bool max,
                                                  float weight) {
  float red = rows[0];
  for (int gi = 1; gi < group; ++gi) {
    const float x = rows[gi * stride];
    red = max ? (red < x ? x : red) : red + x;
  }
  return (max ? weight : weight / static_cast<float>(group)) * red;
}

TRIATTN_NAMESPACE_END
