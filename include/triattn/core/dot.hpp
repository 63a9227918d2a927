/// \file triattn/core/dot.hpp
/// \brief Dot products whose floats do not depend on the build: the same sum from a scalar
/// loop, an SSE, AVX2 or AVX-512 build, and the GPU, so that keep sets do not either.
///
/// Two things make a float dot product differ between builds of the same code:
///
/// - **Summation order.** A vectorised loop (or a BLAS) sums in as many lanes as its registers
///   hold, then reduces them; a different width is a different order. Here the order is fixed:
///   16 partial sums (element i goes to partial i mod 16), reduced by a fixed tree. Any build
///   maps the 16 partials onto 1, 2 or 4 registers and computes the same floats.
/// - **Contraction.** Whether `acc + a * b` is one fused multiply-add (one rounding) or two
///   roundings depends on the compiler's -ffp-contract and on its flags for each loop. Here it
///   is explicit (`multiply_add`) and always fused: the FMA instruction where the build has one
///   (x86 FMA3, AVX-512, AArch64, CUDA), else an exact emulation in double precision
///   (`fused_multiply_add_emulated`), whatever -ffp-contract says.
///
/// So every build gives bit-identical dots: x86-64's baseline (SSE2), x86-64-v3, AVX-512,
/// AArch64 and the GPU's `fmaf`. tests/determinism compares the builds.
///
/// A build for x86-64's baseline (the default: no -march) still runs `fixed_order_dot` and
/// `fixed_order_dot_block` on the FMA or AVX-512 units of the CPU it runs on, chosen once at
/// run time (`TRIATTN_DOT_DISPATCH`; define TRIATTN_DOT_NO_DISPATCH to keep the emulation):
/// the instruction and the emulation round alike, so the floats stay the same, and the
/// emulation, about 20x slower, made an O(n²) score such as R-KV's redundancy the bulk of an
/// evaluation. Code compiled by nvcc keeps the emulation on the host.
#pragma once

#include <math.h>  // fmaf in device code

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#if !defined(__CUDA_ARCH__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__) && \
    !defined(__FMA__) && !defined(__AVX512F__) && !defined(TRIATTN_DOT_NO_DISPATCH)
#define TRIATTN_DOT_DISPATCH 1
#endif
#if !defined(__CUDA_ARCH__) && (defined(__AVX512F__) || defined(TRIATTN_DOT_DISPATCH))
#include <immintrin.h>
#define TRIATTN_DOT_AVX512 1
#endif

#include "triattn/core/config.hpp"

TRIATTN_NAMESPACE_BEGIN

/// a b + c rounded once to float (IEEE 754 fusedMultiplyAdd) without an FMA instruction: the
/// builds that lack one (x86-64's baseline) then score the same floats as those that have one.
/// The product of two floats is exact in double (48 significant bits); the sum is rounded to
/// double and its error recovered exactly (TwoSum); rounding that double to odd (an inexact
/// result with an even last bit moves one ulp toward the exact sum) keeps the information the
/// final rounding needs, so rounding it to float rounds the exact a b + c correctly, double
/// rounding included (Boldo & Melquiond 2008: 53 >= 24 + 2 bits). A compiler that fuses the
/// product into the sum changes nothing: the product is exact in double.
inline float fused_multiply_add_emulated(float a, float b, float c) {
  const double p = static_cast<double>(a) * static_cast<double>(b);  // exact
  const double cd = static_cast<double>(c);
  const double s = p + cd;
  const double t = s - p;
  const double e = (p - (s - t)) + (cd - t);  // p + c == s + e exactly, when s is finite
  auto bits = std::bit_cast<std::uint64_t>(s);
  // s == 0 only when the sum is exact; an infinite or NaN s came from such inputs (e is NaN).
  if (e != 0.0 && (bits & 1u) == 0 && std::isfinite(s)) bits += ((e > 0.0) == (s > 0.0)) ? 1u : ~std::uint64_t{0};
  return static_cast<float>(std::bit_cast<double>(bits));
}

/// a b + c rounded once: the FMA instruction where the build has one, else the same float
/// emulated (`fused_multiply_add_emulated`). Explicit so that neither -ffp-contract nor the
/// instruction set can make two builds, or two paths of one build, disagree.
TRIATTN_HOST_DEVICE float multiply_add(float a, float b, float c) {
// AVX-512F has FMA instructions of its own (-mavx512f alone does not define __FMA__).
#if defined(__CUDA_ARCH__) || defined(__FMA__) || defined(__AVX512F__) || defined(__ARM_FEATURE_FMA)
  return fmaf(a, b, c);
#else
  return fused_multiply_add_emulated(a, b, c);
#endif
}

namespace detail {

/// `fixed_order_dot` with the fused multiply-add `fma`.
template <class Fma>
TRIATTN_HOST_DEVICE float fixed_order_dot_with(const float* a, const float* b, int n, Fma fma) {
  constexpr int lanes = 16;
  float part[lanes] = {};
  int i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int k = 0; k < lanes; ++k) part[k] = fma(a[i + k], b[i + k], part[k]);
  for (int k = 0; i + k < n; ++k) part[k] = fma(a[i + k], b[i + k], part[k]);
  for (int width = lanes / 2; width >= 1; width /= 2)
    for (int k = 0; k < width; ++k) part[k] += part[k + width];
  return part[0];
}

#ifdef TRIATTN_DOT_DISPATCH
#define TRIATTN_DOT_TARGET_AVX512 __attribute__((target("avx512f")))
/// Whether the CPU running this has FMA3 / AVX-512F (asked once).
inline bool cpu_has_fma() {
  static const bool yes = __builtin_cpu_supports("fma");
  return yes;
}
inline bool cpu_has_avx512f() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
/// `fixed_order_dot` on the FMA instruction (the same floats as the emulation).
__attribute__((target("fma"))) inline float fixed_order_dot_fma(const float* a, const float* b, int n) {
  return fixed_order_dot_with(a, b, n, [](float x, float y, float z) { return __builtin_fmaf(x, y, z); });
}
#else
#define TRIATTN_DOT_TARGET_AVX512
#endif

}  // namespace detail

/// Σ_i a_i b_i over 16 partial sums in a fixed order (see the file comment): partial k takes
/// elements i ≡ k (mod 16), then partial k += partial k + 8, + 4, + 2, + 1.
TRIATTN_HOST_DEVICE float fixed_order_dot(const float* a, const float* b, int n) {
#ifdef TRIATTN_DOT_DISPATCH
  if (detail::cpu_has_fma()) return detail::fixed_order_dot_fma(a, b, n);
#endif
  return detail::fixed_order_dot_with(a, b, n, [](float x, float y, float z) { return multiply_add(x, y, z); });
}

namespace detail {
#ifdef TRIATTN_DOT_AVX512
/// The 16 partial sums of each of 4 accumulators reduced by `fixed_order_dot`'s tree (lane
/// j += lane j + 8, then j + 4, j + 2, j + 1), the four at once, into `out` [4]. Two-source
/// permutes only: GCC 12 warns (-Wuninitialized) on the intrinsics with an undefined operand.
TRIATTN_DOT_TARGET_AVX512 inline void dot_reduce4x16(const __m512 (&acc)[4], float* out) {
  const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // [a + a >> 8 | b + b >> 8], [c ... | d ...]: 8 lanes per accumulator
  const __m512 ab = _mm512_add_ps(_mm512_permutex2var_ps(acc[0], lo8, acc[1]), _mm512_permutex2var_ps(acc[0], hi8, acc[1]));
  const __m512 cd = _mm512_add_ps(_mm512_permutex2var_ps(acc[2], lo8, acc[3]), _mm512_permutex2var_ps(acc[2], hi8, acc[3]));
  // 4 lanes per accumulator: lane j + lane j + 4
  const __m512i lo4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi4 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512 w4 = _mm512_add_ps(_mm512_permutex2var_ps(ab, lo4, cd), _mm512_permutex2var_ps(ab, hi4, cd));
  // lane j + lane j + 2, then lane 0 + lane 1, in each accumulator's group of 4
  const __m512i up2 = _mm512_setr_epi32(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
  const __m512 w2 = _mm512_add_ps(w4, _mm512_permutex2var_ps(w4, up2, w4));
  const __m512i up1 = _mm512_setr_epi32(1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9, 13, 13, 13, 13);
  const __m512 w1 = _mm512_add_ps(w2, _mm512_permutex2var_ps(w2, up1, w2));
  // lanes 0, 4, 8, 12: the four sums. Compressed in a register, then stored: a compressing
  // store to memory is microcoded on AMD Zen 4 (tens of cycles). Stored whole, not through
  // _mm512_castps512_ps128, which GCC 12 expands with an undefined operand (-Wuninitialized)
  // where AVX-512 comes from the target attribute alone.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_maskz_compress_ps(0x1111, w1));
  for (int k = 0; k < 4; ++k) out[k] = lanes[k];
}

/// 4 columns x `Rows` rows in registers: each column load serves every row, each row load
/// every column (16 + 4 + 1 of the 32 zmm registers at 4 rows). n % 16 == 0.
template <int Rows>
TRIATTN_DOT_TARGET_AVX512 inline void dot_block_avx512(const float* a, std::ptrdiff_t a_stride, const float* b,
                                                       std::ptrdiff_t b_stride, int n, float* out,
                                                       std::ptrdiff_t out_stride) {
  __m512 acc[4][Rows];
  for (int k = 0; k < 4; ++k)
    for (int g = 0; g < Rows; ++g) acc[k][g] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    __m512 bv[4];
    for (int k = 0; k < 4; ++k) bv[k] = _mm512_loadu_ps(b + k * b_stride + i);
    for (int g = 0; g < Rows; ++g) {
      const __m512 av = _mm512_loadu_ps(a + g * a_stride + i);
      for (int k = 0; k < 4; ++k) acc[k][g] = _mm512_fmadd_ps(av, bv[k], acc[k][g]);  // AVX-512F implies FMA
    }
  }
  for (int g = 0; g < Rows; ++g) {
    const __m512 cols[4] = {acc[0][g], acc[1][g], acc[2][g], acc[3][g]};
    dot_reduce4x16(cols, out + g * out_stride);
  }
}
#endif
}  // namespace detail

/// out[r * out_stride + c] = fixed_order_dot(a_r, b_c, n) for `rows` rows a_r (`a_stride`
/// floats apart) and `cols` columns b_c (`b_stride` apart): the same floats as one call per
/// pair. On AVX-512 hosts (n a multiple of 16) 4 columns x up to 4 rows stay in registers.
TRIATTN_HOST_DEVICE void fixed_order_dot_block(const float* a, std::ptrdiff_t a_stride, int rows, const float* b,
                                               std::ptrdiff_t b_stride, std::int64_t cols, int n, float* out,
                                               std::ptrdiff_t out_stride) {
  std::int64_t c0 = 0;
#ifdef TRIATTN_DOT_AVX512
#ifdef TRIATTN_DOT_DISPATCH
  if (n % 16 == 0 && detail::cpu_has_avx512f())
#else
  if (n % 16 == 0)
#endif
    for (; c0 + 4 <= cols; c0 += 4)
      for (int r0 = 0; r0 < rows; r0 += 4) {
        const float* ar = a + r0 * a_stride;
        const float* bc = b + c0 * b_stride;
        float* o = out + r0 * out_stride + c0;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
          case 1: detail::dot_block_avx512<1>(ar, a_stride, bc, b_stride, n, o, out_stride); break;
          case 2: detail::dot_block_avx512<2>(ar, a_stride, bc, b_stride, n, o, out_stride); break;
          case 3: detail::dot_block_avx512<3>(ar, a_stride, bc, b_stride, n, o, out_stride); break;
          default: detail::dot_block_avx512<4>(ar, a_stride, bc, b_stride, n, o, out_stride); break;
        }
      }
#endif
  for (int r = 0; r < rows; ++r)
    for (std::int64_t c = c0; c < cols; ++c) out[r * out_stride + c] = fixed_order_dot(a + r * a_stride, b + c * b_stride, n);
}

TRIATTN_NAMESPACE_END
