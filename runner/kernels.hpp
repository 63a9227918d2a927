/// \file runner/kernels.hpp
/// \brief The forward pass's arithmetic: panel products, attention over a (layer, kv_head)'s slots,
/// RoPE at one position, RMSNorm and softmax, each summed in run.c's order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "runner/model.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/core/rope.hpp"

namespace triattn_runner {

namespace detail {

// The products and the attention sums run on AVX where the CPU has it (checked when they are
// called): the kernels use only AVX's 256-bit float instructions, not AVX2's integer ones, so
// that CPUs that report AVX without AVX2 (some virtual machines) take them too. The sums stay in
// run.c's order, so the AVX and the plain loops give the same bits. No FMA: it rounds
// differently (the batched-decoding test sees it), and for the same reason the programs that
// use the runner build with -ffp-contract=off (CMake target triattn_runner), whatever -march.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
#define TRIATTN_RUNNER_AVX_KERNEL 1
#endif

inline constexpr int panel_rows = model::panel_rows;

// Writes a tile's accumulators acc[S][16] (sequence s, panel row r) to out [n, rows], leaving
// out the rows past the matrix.
template <int S>
inline void store_tile(float* out, const float (&acc)[S][panel_rows], int rows, int i0, int s0) {
  const int valid = std::min(panel_rows, rows - i0);
  for (int s = 0; s < S; ++s) std::copy_n(acc[s], valid, out + static_cast<std::ptrdiff_t>(s0 + s) * rows + i0);
}

// out(s, i) = Σ_j w[i][j] x[s][j] for the 16 rows of one panel (from row i0) and the S
// sequences from s0: each sum in float, a multiply then an add, in j order (run.c's bits, for
// any S, any tile, any thread).
template <int S>
inline void panel_tile(float* out, const float* panel, const float* x, int rows, int cols, int i0, int s0) {
  float acc[S][panel_rows] = {};
  for (int j = 0; j < cols; ++j) {
    const float* w = panel + static_cast<std::ptrdiff_t>(j) * panel_rows;
    for (int s = 0; s < S; ++s) {
      const float a = x[static_cast<std::ptrdiff_t>(s0 + s) * cols + j];
      for (int r = 0; r < panel_rows; ++r) acc[s][r] += w[r] * a;
    }
  }
  store_tile<S>(out, acc, rows, i0, s0);
}

#if TRIATTN_RUNNER_AVX_KERNEL
// acc_lo / acc_hi (the panel's rows 0-7 / 8-15) += w * x: a multiply then an add (AVX has no
// fused form, and the runner builds with -ffp-contract=off).
__attribute__((target("avx"), always_inline)) inline void panel_step(__m256& lo, __m256& hi, __m256 w_lo, __m256 w_hi,
                                                                     const float* x) {
  const __m256 a = _mm256_broadcast_ss(x);
  lo = _mm256_add_ps(lo, _mm256_mul_ps(w_lo, a));
  hi = _mm256_add_ps(hi, _mm256_mul_ps(w_hi, a));
}

// The AVX twin of `panel_tile` for S <= 6: the panel's 16 rows in two registers, one
// broadcast of x per sequence, each lane summing in j order. The 2S accumulators are named
// variables: GCC keeps an array of them in registers too, but also stores it to the stack on
// every j (half the speed).
template <int S>
__attribute__((target("avx"))) inline void panel_tile_avx(float* out, const float* panel, const float* x, int rows,
                                                          int cols, int i0, int s0) {
  static_assert(S >= 1 && S <= 6);
  const __m256 z = _mm256_setzero_ps();
  __m256 a0 = z, b0 = z, a1 = z, b1 = z, a2 = z, b2 = z, a3 = z, b3 = z, a4 = z, b4 = z, a5 = z, b5 = z;
  const float* xs = x + static_cast<std::ptrdiff_t>(s0) * cols;
  const auto c = static_cast<std::ptrdiff_t>(cols);
  for (int j = 0; j < cols; ++j) {
    const float* w = panel + static_cast<std::ptrdiff_t>(j) * panel_rows;
    const __m256 lo = _mm256_loadu_ps(w), hi = _mm256_loadu_ps(w + 8);
    panel_step(a0, b0, lo, hi, xs + j);
    if constexpr (S > 1) panel_step(a1, b1, lo, hi, xs + c + j);
    if constexpr (S > 2) panel_step(a2, b2, lo, hi, xs + 2 * c + j);
    if constexpr (S > 3) panel_step(a3, b3, lo, hi, xs + 3 * c + j);
    if constexpr (S > 4) panel_step(a4, b4, lo, hi, xs + 4 * c + j);
    if constexpr (S > 5) panel_step(a5, b5, lo, hi, xs + 5 * c + j);
  }
  const __m256 acc[6][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  alignas(32) float lanes[S][panel_rows];
  for (int s = 0; s < S; ++s) {
    _mm256_store_ps(lanes[s], acc[s][0]);
    _mm256_store_ps(lanes[s] + 8, acc[s][1]);
  }
  store_tile<S>(out, lanes, rows, i0, s0);
}

__attribute__((target("avx"))) inline void matmul_panels_avx(float* out, const float* panels, const float* x,
                                                             int rows, int cols, int n, int p0, int p1) {
  for (int p = p0; p < p1; ++p) {
    const float* panel = panels + static_cast<std::ptrdiff_t>(p) * cols * panel_rows;
    const int i0 = p * panel_rows;
    // Tiles of 6 sequences (12 accumulators + 2 weights + 1 broadcast of the 16 ymm
    // registers), the rest in tiles of at least 3 where n allows: a tile of 1 or 2 has too
    // few independent sums to hide the adds' latency. 7 = 4 + 3, 8 = 4 + 4.
    const int rest = n % 6, whole = n / 6 - (rest > 0 && rest < 3 && n >= 6 ? 1 : 0);
    int s0 = 0;
    for (int k = 0; k < whole; ++k, s0 += 6) panel_tile_avx<6>(out, panel, x, rows, cols, i0, s0);
    for (int left = n - s0; left > 0;) {
      const int take = left > 5 ? 4 : left;  // 7, 8: 4 first
      switch (take) {
        case 5: panel_tile_avx<5>(out, panel, x, rows, cols, i0, s0); break;
        case 4: panel_tile_avx<4>(out, panel, x, rows, cols, i0, s0); break;
        case 3: panel_tile_avx<3>(out, panel, x, rows, cols, i0, s0); break;
        case 2: panel_tile_avx<2>(out, panel, x, rows, cols, i0, s0); break;
        default: panel_tile_avx<1>(out, panel, x, rows, cols, i0, s0); break;
      }
      s0 += take;
      left -= take;
    }
  }
}
#endif

// out [n, rows] = x [n, cols] · wᵀ for the panels [p0, p1) of w (model::panels): the rows
// [16 p0, 16 p1) of every sequence. Each out(s, i) = Σ_j w[i][j] x[s][j] accumulated in float
// in j order, as run.c's matvec: the same bits for any n, any split of the panels, any vector
// width.
inline void matmul_panels(float* out, const float* panels, const float* x, int rows, int cols, int n, int p0, int p1) {
#if TRIATTN_RUNNER_AVX_KERNEL
  if (__builtin_cpu_supports("avx")) return matmul_panels_avx(out, panels, x, rows, cols, n, p0, p1);
#endif
  for (int p = p0; p < p1; ++p) {
    const float* panel = panels + static_cast<std::ptrdiff_t>(p) * cols * panel_rows;
    int s0 = 0;
    for (; s0 + 4 <= n; s0 += 4) panel_tile<4>(out, panel, x, rows, cols, p * panel_rows, s0);
    for (; s0 < n; ++s0) panel_tile<1>(out, panel, x, rows, cols, p * panel_rows, s0);
  }
}

// att[t] = (q · k_t) / scale for the `len` keys at `keys` + t * `stride` (an f32 cache read in
// place). Eight keys at a time, each dot product summed in d order as run.c's: eight
// independent chains hide the latency of the adds, and every key gets run.c's bits.
inline void attention_logits(const float* q, const float* keys, std::int64_t stride, int hd, std::int32_t len,
                             float scale, float* att) {
  constexpr int block = 8;
  std::int32_t t = 0;
  for (; t + block <= len; t += block) {
    float acc[block] = {};
    const float* k = keys + static_cast<std::ptrdiff_t>(t) * stride;
    for (int d = 0; d < hd; ++d)
      for (int i = 0; i < block; ++i) acc[i] += q[d] * k[static_cast<std::ptrdiff_t>(i) * stride + d];
    for (int i = 0; i < block; ++i) att[t + i] = acc[i] / scale;
  }
  for (; t < len; ++t) {
    const float* k = keys + static_cast<std::ptrdiff_t>(t) * stride;
    float dot = 0.0f;
    for (int d = 0; d < hd; ++d) dot += q[d] * k[d];
    att[t] = dot / scale;
  }
}

// out[d] = Σ_t att[t] v_t[d] for the `len` values at `values` + t * `stride`, summed in t order
// as run.c's (from 0, a multiply then an add).
inline void attention_values(const float* att, const float* values, std::int64_t stride, int hd, std::int32_t len,
                             float* out) {
  std::fill_n(out, hd, 0.0f);
  for (std::int32_t t = 0; t < len; ++t) {
    const float* v = values + static_cast<std::ptrdiff_t>(t) * stride;
    for (int d = 0; d < hd; ++d) out[d] += att[t] * v[d];
  }
}

#if TRIATTN_RUNNER_AVX_KERNEL
// r[i] (8 floats of key i) -> r[j] (dim j of the 8 keys).
__attribute__((target("avx"), always_inline)) inline void transpose8(__m256& r0, __m256& r1, __m256& r2, __m256& r3,
                                                                     __m256& r4, __m256& r5, __m256& r6, __m256& r7) {
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r0 = _mm256_permute2f128_ps(u0, u4, 0x20);
  r1 = _mm256_permute2f128_ps(u1, u5, 0x20);
  r2 = _mm256_permute2f128_ps(u2, u6, 0x20);
  r3 = _mm256_permute2f128_ps(u3, u7, 0x20);
  r4 = _mm256_permute2f128_ps(u0, u4, 0x31);
  r5 = _mm256_permute2f128_ps(u1, u5, 0x31);
  r6 = _mm256_permute2f128_ps(u2, u6, 0x31);
  r7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// acc (8 keys) += q[j] * c_j for the 8 dims of a transposed block, in d order.
__attribute__((target("avx"), always_inline)) inline __m256 dot_block(__m256 acc, const float* q, __m256 c0, __m256 c1,
                                                                      __m256 c2, __m256 c3, __m256 c4, __m256 c5,
                                                                      __m256 c6, __m256 c7) {
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q), c0));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 1), c1));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 2), c2));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 3), c3));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 4), c4));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 5), c5));
  acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 6), c6));
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(q + 7), c7));
}

// `attention_logits` for up to 4 queries (q + i * hd, i < nq: a GQA group) that read the same
// keys, head_dim a multiple of 8: each block of 8 keys x 8 dims is loaded and transposed once
// for every query, and each lane sums one key's dot product in d order (run.c's bits).
// att + i * att_stride is query i's row.
__attribute__((target("avx"))) inline void attention_logits_avx(const float* q, int nq, const float* keys,
                                                                std::int64_t stride, int hd, std::int32_t len,
                                                                float scale, float* att, std::int64_t att_stride) {
  const __m256 z = _mm256_setzero_ps(), div = _mm256_set1_ps(scale);
  const std::int32_t whole = len / 8 * 8;
  for (std::int32_t t = 0; t < whole; t += 8) {
    const float* k = keys + static_cast<std::ptrdiff_t>(t) * stride;
    __m256 a0 = z, a1 = z, a2 = z, a3 = z;
    for (int d0 = 0; d0 < hd; d0 += 8) {
      __m256 r0 = _mm256_loadu_ps(k + d0), r1 = _mm256_loadu_ps(k + stride + d0),
             r2 = _mm256_loadu_ps(k + 2 * stride + d0), r3 = _mm256_loadu_ps(k + 3 * stride + d0),
             r4 = _mm256_loadu_ps(k + 4 * stride + d0), r5 = _mm256_loadu_ps(k + 5 * stride + d0),
             r6 = _mm256_loadu_ps(k + 6 * stride + d0), r7 = _mm256_loadu_ps(k + 7 * stride + d0);
      transpose8(r0, r1, r2, r3, r4, r5, r6, r7);
      a0 = dot_block(a0, q + d0, r0, r1, r2, r3, r4, r5, r6, r7);
      if (nq > 1) a1 = dot_block(a1, q + hd + d0, r0, r1, r2, r3, r4, r5, r6, r7);
      if (nq > 2) a2 = dot_block(a2, q + 2 * hd + d0, r0, r1, r2, r3, r4, r5, r6, r7);
      if (nq > 3) a3 = dot_block(a3, q + 3 * hd + d0, r0, r1, r2, r3, r4, r5, r6, r7);
    }
    _mm256_storeu_ps(att + t, _mm256_div_ps(a0, div));
    if (nq > 1) _mm256_storeu_ps(att + att_stride + t, _mm256_div_ps(a1, div));
    if (nq > 2) _mm256_storeu_ps(att + 2 * att_stride + t, _mm256_div_ps(a2, div));
    if (nq > 3) _mm256_storeu_ps(att + 3 * att_stride + t, _mm256_div_ps(a3, div));
  }
  for (int i = 0; i < nq; ++i)
    attention_logits(q + static_cast<std::ptrdiff_t>(i) * hd, keys + static_cast<std::ptrdiff_t>(whole) * stride, stride,
                     hd, len - whole, scale, att + i * att_stride + whole);
}

// acc_k += a * v[8k..8k+8) for the V vectors of one value row.
template <int V>
__attribute__((target("avx"), always_inline)) inline void value_step(__m256 (&acc)[8], __m256 a, const float* v) {
  if constexpr (V > 0) acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(a, _mm256_loadu_ps(v)));
  if constexpr (V > 1) acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(a, _mm256_loadu_ps(v + 8)));
  if constexpr (V > 2) acc[2] = _mm256_add_ps(acc[2], _mm256_mul_ps(a, _mm256_loadu_ps(v + 16)));
  if constexpr (V > 3) acc[3] = _mm256_add_ps(acc[3], _mm256_mul_ps(a, _mm256_loadu_ps(v + 24)));
  if constexpr (V > 4) acc[4] = _mm256_add_ps(acc[4], _mm256_mul_ps(a, _mm256_loadu_ps(v + 32)));
  if constexpr (V > 5) acc[5] = _mm256_add_ps(acc[5], _mm256_mul_ps(a, _mm256_loadu_ps(v + 40)));
  if constexpr (V > 6) acc[6] = _mm256_add_ps(acc[6], _mm256_mul_ps(a, _mm256_loadu_ps(v + 48)));
  if constexpr (V > 7) acc[7] = _mm256_add_ps(acc[7], _mm256_mul_ps(a, _mm256_loadu_ps(v + 56)));
}

// `attention_values` for dims [d0, d0 + 8V) (V <= 8 vectors in registers), each lane summing
// in t order.
template <int V>
__attribute__((target("avx"))) inline void attention_values_avx(const float* att, const float* values,
                                                                std::int64_t stride, std::int32_t len, float* out) {
  __m256 acc[8];
  for (__m256& a : acc) a = _mm256_setzero_ps();
  for (std::int32_t t = 0; t < len; ++t)
    value_step<V>(acc, _mm256_broadcast_ss(att + t), values + static_cast<std::ptrdiff_t>(t) * stride);
  for (int k = 0; k < V; ++k) _mm256_storeu_ps(out + 8 * k, acc[k]);
}

__attribute__((target("avx"))) inline void attention_values_avx(const float* att, const float* values,
                                                                std::int64_t stride, int hd, std::int32_t len,
                                                                float* out) {
  for (int d0 = 0; d0 < hd; d0 += 64) {
    const float* v = values + d0;
    switch (std::min(8, (hd - d0) / 8)) {
      case 8: attention_values_avx<8>(att, v, stride, len, out + d0); break;
      case 7: attention_values_avx<7>(att, v, stride, len, out + d0); break;
      case 6: attention_values_avx<6>(att, v, stride, len, out + d0); break;
      case 5: attention_values_avx<5>(att, v, stride, len, out + d0); break;
      case 4: attention_values_avx<4>(att, v, stride, len, out + d0); break;
      case 3: attention_values_avx<3>(att, v, stride, len, out + d0); break;
      case 2: attention_values_avx<2>(att, v, stride, len, out + d0); break;
      default: attention_values_avx<1>(att, v, stride, len, out + d0); break;
    }
  }
}
#endif

// The logits of the `nq` queries at q (q + i * hd) that read the same f32 keys: row i at
// att + i * att_stride. The AVX kernel where the CPU has it and head_dim is a multiple of 8.
inline void group_logits(const float* q, int nq, const float* keys, std::int64_t stride, int hd, std::int32_t len,
                         float scale, float* att, std::int64_t att_stride) {
#if TRIATTN_RUNNER_AVX_KERNEL
  if (hd % 8 == 0 && __builtin_cpu_supports("avx")) {
    for (int i = 0; i < nq; i += 4)
      attention_logits_avx(q + static_cast<std::ptrdiff_t>(i) * hd, std::min(4, nq - i), keys, stride, hd, len, scale,
                            att + i * att_stride, att_stride);
    return;
  }
#endif
  for (int i = 0; i < nq; ++i)
    attention_logits(q + static_cast<std::ptrdiff_t>(i) * hd, keys, stride, hd, len, scale, att + i * att_stride);
}

// `attention_values` with the AVX kernel where the CPU has it and head_dim is a multiple of 8.
inline void values_sum(const float* att, const float* values, std::int64_t stride, int hd, std::int32_t len,
                       float* out) {
#if TRIATTN_RUNNER_AVX_KERNEL
  if (hd % 8 == 0 && __builtin_cpu_supports("avx")) return attention_values_avx(att, values, stride, hd, len, out);
#endif
  attention_values(att, values, stride, hd, len, out);
}

// RoPE at one position, its cos and sin per band computed once and applied to every head of
// every layer: triattn::rope_rotate's phases and roundings (the same bits) without its
// trigonometry per head.
struct position_rotation {
  std::vector<double> c, s;  // [bands]: cos(phase) x scale, sin(phase) x scale
  triattn::rope_style style = triattn::rope_style::half;
  int dim = 0;

  void set(const triattn::rope_desc& r, int head_dim, std::int32_t pos) {
    dim = triattn::rotary_dims(r, head_dim);
    style = r.style;
    c.resize(static_cast<std::size_t>(dim / 2));
    s.resize(c.size());
    for (int f = 0; f < dim / 2; ++f) {
      const double phase = static_cast<double>(pos) * triattn::inv_freq(r, dim, f);
      c[static_cast<std::size_t>(f)] = std::cos(phase) * r.attention_scale;
      s[static_cast<std::size_t>(f)] = std::sin(phase) * r.attention_scale;
    }
  }
  void apply(float* x) const {
    for (int f = 0; f < dim / 2; ++f) {
      int re, im;
      triattn::rope_band_dims(style, dim, f, re, im);
      triattn::rotate_band_cs(x, re, im, c[static_cast<std::size_t>(f)], s[static_cast<std::size_t>(f)]);
    }
  }
};

// out(s, i) = row i of block matrix `w` · x[s], for the rows [i0, i1) and the n
// sequences: each input row is quantised once to the kernel's input format (into `scratch`),
// then ggml's vec_dot takes each weight row with every sequence while the row is in cache. ggml's
// own CPU product does the same per (row, column), so the runner and llama.cpp agree to the
// kernels' rounding.
inline void matmul_blocks(float* out, const block_matrix& w, int rows, int cols, const float* x, int n, int i0, int i1,
                          std::vector<std::byte>& scratch) {
  scratch.resize(static_cast<std::size_t>(n) * w.input_row_bytes);
  for (int s = 0; s < n; ++s)
    w.quantize_input(x + static_cast<std::ptrdiff_t>(s) * cols, scratch.data() + static_cast<std::size_t>(s) * w.input_row_bytes,
                     cols);
  for (int i = i0; i < i1; ++i) {
    const std::byte* weights = w.bytes.data() + static_cast<std::size_t>(i) * w.row_bytes;
    for (int s = 0; s < n; ++s)
      w.vec_dot(cols, out + static_cast<std::ptrdiff_t>(s) * rows + i, 0, weights, 0,
                scratch.data() + static_cast<std::size_t>(s) * w.input_row_bytes, 0, 1);
  }
}

// x += bias, n elements.
inline void add(float* x, const float* bias, int n) {
  for (int i = 0; i < n; ++i) x[i] += bias[i];
}

inline void rmsnorm(float* out, const float* x, const float* gain, int n, float eps) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  ss = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = gain[i] * (ss * x[i]);
}

inline void softmax(float* x, std::int64_t n) {
  const float max = *std::max_element(x, x + n);
  float sum = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  for (std::int64_t i = 0; i < n; ++i) x[i] /= sum;
}

}  // namespace detail

}  // namespace triattn_runner
