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
#if !defined(__CUDA_ARCH__) && (defined(__SSE2__) || defined(__AVX__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
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
    // fused in double on every build (libm's fma where the build has no FMA instruction):
    // once per round, and the floats then do not depend on -ffp-contract
    c_re[f] = static_cast<float>(scale * std::fma(qr, w_re[f], -(qi * w_im[f])));
    c_im[f] = static_cast<float>(scale * std::fma(qr, w_im[f], qi * w_re[f]));
  }
}

/// Norm coefficients of one (layer, q-head): e_f = scale · (m_f − |q̄_f|), offset-independent.
/// Output `e` [num_bands].
TRIATTN_HOST_DEVICE void triattention_norm_coefficients(const float* q_mean_re, const float* q_mean_im,
                                                        const float* q_abs_mean, int num_bands, double scale,
                                                        float* e) {
  for (int f = 0; f < num_bands; ++f) {
    const double qr = q_mean_re[f], qi = q_mean_im[f];
    e[f] = static_cast<float>(scale * (q_abs_mean[f] - std::sqrt(std::fma(qr, qr, qi * qi))));  // fused, as above
  }
}

/// A key's features `x` [3F] = [Re K_f | Im K_f | |K_f|], with F = head_dim / 2: the operand
/// of the score's one dot product (`triattention_key_score`). `triattention_key_features`
/// writes the bands (the RoPE pairing `style` resolved here, so every later loop is unit-stride
/// over bands); pre-RoPE keys are then rotated (`triattention_rotate_features`) and
/// `triattention_key_moduli` completes the row.
TRIATTN_HOST_DEVICE void triattention_key_features(const float* key, int head_dim, rope_style style, float* x) {
  const int F = head_dim / 2;
  if (style == rope_style::half) {  // bands (d, d + F): the row already is [re | im]
    for (int d = 0; d < head_dim; ++d) x[d] = key[d];
  } else {  // interleaved (2f, 2f + 1)
    for (int f = 0; f < F; ++f) {
      x[f] = key[2 * f];
      x[F + f] = key[2 * f + 1];
    }
  }
}

/// |K_f| into `x[2F, 3F)` from the bands in `x[0, 2F)`. The square roots go through the
/// SSE/AVX instruction on x86 hosts: `std::sqrt` may set errno, so without -fno-math-errno
/// the compiler keeps it scalar with a branch per band. Every path is IEEE's correctly
/// rounded square root, so each gives the same float.
TRIATTN_HOST_DEVICE void triattention_key_moduli(float* x, int num_bands) {
  const int F = num_bands;
  float* m = x + 2 * F;
  for (int f = 0; f < F; ++f) m[f] = multiply_add(x[f], x[f], x[F + f] * x[F + f]);
  int f = 0;
#if !defined(__CUDA_ARCH__) && defined(__AVX512F__)
  for (; f + 16 <= F; f += 16) _mm512_storeu_ps(m + f, _mm512_sqrt_ps(_mm512_loadu_ps(m + f)));
#elif !defined(__CUDA_ARCH__) && defined(__AVX__)
  for (; f + 8 <= F; f += 8) _mm256_storeu_ps(m + f, _mm256_sqrt_ps(_mm256_loadu_ps(m + f)));
#elif !defined(__CUDA_ARCH__) && defined(__SSE2__)
  for (; f + 4 <= F; f += 4) _mm_storeu_ps(m + f, _mm_sqrt_ps(_mm_loadu_ps(m + f)));
#endif
  for (; f < F; ++f) m[f] = std::sqrt(m[f]);
}

/// Pre-RoPE keys are rotated to their position p by e^{i p w_f} without any trigonometry per
/// key: p is split into bytes, p = Σ_k b_k 256^k, and e^{i p w_f} = Π_k e^{i b_k 256^k w_f},
/// each factor one entry of a table built per round (`triattention_chunk_phasor`, the phase
/// formed and evaluated in double, then rounded to float). A position below 256^c takes c
/// factors; the product runs in float, lowest byte first, so the CPU and GPU form it alike.
inline constexpr int triattention_chunk_bits = 8;
inline constexpr int triattention_chunk_values = 1 << triattention_chunk_bits;
/// Bytes of a non-negative int32 position: 4 factors at most.
inline constexpr int triattention_max_chunks = 4;

/// e^{i v 256^k w} as floats: table entry (chunk k, byte value v) of the band of frequency w.
TRIATTN_HOST_DEVICE void triattention_chunk_phasor(double w, int k, int v, float& re, float& im) {
  const double phase = static_cast<double>(std::int64_t{v} << (triattention_chunk_bits * k)) * w;
  re = static_cast<float>(std::cos(phase));
  im = static_cast<float>(std::sin(phase));
}

/// How many byte factors position p >= 0 takes (1 for p < 256).
TRIATTN_HOST_DEVICE int triattention_position_chunks(std::int64_t p) {
  int c = 1;
  while (c < triattention_max_chunks && (p >> (triattention_chunk_bits * c)) != 0) ++c;
  return c;
}

/// Multiplies the complex number (re, im) by (b_re, b_im) in place, in float: a product of
/// phasors, or a band rotated by one.
TRIATTN_HOST_DEVICE void triattention_phasor_multiply(float& re, float& im, float b_re, float b_im) {
  const float r = multiply_add(re, b_re, -(im * b_im));
  im = multiply_add(re, b_im, im * b_re);
  re = r;
}

/// e^{i p w} of one band from its byte factors, each computed on the spot: what a table of
/// `triattention_chunk_phasor` entries gives, for a scorer that keeps no table (the GPU's).
TRIATTN_HOST_DEVICE void triattention_position_phasor(double w, std::int64_t p, float& re, float& im) {
  triattention_chunk_phasor(w, 0, static_cast<int>(p & 0xff), re, im);
  for (int k = 1; k < triattention_position_chunks(p); ++k) {
    float b_re, b_im;
    triattention_chunk_phasor(w, k, static_cast<int>((p >> (triattention_chunk_bits * k)) & 0xff), b_re, b_im);
    triattention_phasor_multiply(re, im, b_re, b_im);
  }
}

/// Rotates the bands of `x` [re | im] by the phasors `p_re`, `p_im` [F]: K_f = p_f κ_f.
TRIATTN_HOST_DEVICE void triattention_rotate_features(float* x, const float* p_re, const float* p_im, int num_bands) {
  const int F = num_bands;
  for (int f = 0; f < F; ++f) triattention_phasor_multiply(x[f], x[F + f], p_re[f], p_im[f]);
}

/// Rotates the bands of `x` by the product of `Chunks` table rows (`re[k]`, `im[k]` [F]: the
/// factor of byte k), formed per band as `triattention_position_phasor` forms it (byte 0
/// times byte 1, times byte 2, ...), without storing the product.
template <int Chunks>
TRIATTN_HOST_DEVICE void triattention_rotate_by_chunks(float* x, const float* const* re, const float* const* im,
                                                       int num_bands) {
  const int F = num_bands;
  for (int f = 0; f < F; ++f) {
    float p_re = re[0][f], p_im = im[0][f];
    for (int k = 1; k < Chunks; ++k) triattention_phasor_multiply(p_re, p_im, re[k][f], im[k][f]);
    float a = x[f], b = x[F + f];
    triattention_phasor_multiply(a, b, p_re, p_im);
    x[f] = a;
    x[F + f] = b;
  }
}

/// Length of one q-head's coefficient row for `num_sets` phasor sets: [sets][c_re | c_im]
/// (2F each) then e [F]. With one set (mean aggregation) the row is [c_re | c_im | e], the
/// same layout as a key's features.
TRIATTN_HOST_DEVICE int triattention_coefficient_row(int num_sets, int num_bands) {
  return (2 * num_sets + 1) * num_bands;
}

/// Score of one key (features `x` [3F]) against one q-head (coefficient row `coef`, see
/// `triattention_coefficient_row`): the largest over the sets of Σ_f Re(c_f conj K_f) plus
/// Σ_f e_f |K_f|. One set: one dot product of length 3F.
TRIATTN_HOST_DEVICE float triattention_key_score(const float* coef, int num_sets, const float* x, int num_bands) {
  const int F = num_bands;
  if (num_sets == 1) return fixed_order_dot(coef, x, 3 * F);
  float trig = 0.0f;
  for (int j = 0; j < num_sets; ++j) {
    const float t = fixed_order_dot(coef + 2 * j * F, x, 2 * F);
    trig = j == 0 || t > trig ? t : trig;
  }
  return trig + fixed_order_dot(coef + 2 * num_sets * F, x + 2 * F, F);
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
