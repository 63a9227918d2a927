/// \file triattn/policies/window_math.hpp
/// \brief The per-element formulas of the window-scored policies (SnapKV, R-KV), shared by
/// the CPU path (query_window.hpp, snapkv.hpp, rkv.hpp) and the CUDA path
/// (cuda/window_attention.cuh, cuda/snapkv.cuh, cuda/rkv.cuh).
///
/// Each function computes one element (one (query, key) logit, one softmax entry, one cell of
/// R-KV's similarity matrix); the CPU loops over them around its dot products and the GPU
/// calls them from its kernels, so the two paths cannot drift apart. Eigen-free and
/// exception-free: raw scalars only, `INFINITY` instead of `std::numeric_limits` (not usable
/// in device code).
#pragma once

#include <math.h>

#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"
#include "triattn/core/dtype.hpp"

TRIATTN_NAMESPACE_BEGIN

/// The logit scale 1/√D of a head of `head_dim` dimensions.
TRIATTN_HOST_DEVICE float window_logit_scale(int head_dim) { return 1.0f / sqrtf(static_cast<float>(head_dim)); }

/// The logit of one (query, key) pair from their dot product: `dot * scale`, or −inf when the
/// key's position is above the query's (the causal mask inside the window).
TRIATTN_HOST_DEVICE float window_logit(float dot, float scale, std::int32_t key_position, std::int32_t query_position) {
  return key_position > query_position ? -INFINITY : dot * scale;
}

/// e^x for x <= 0 (a logit minus its row's largest), within 2 ulp of `expf`, written out so
/// that a row's loop vectorises on the CPU (libm's `expf` is a call per element) and the GPU
/// computes the same float (every multiply-add explicit, `multiply_add`): x = n ln2 + r with
/// |r| <= ln2 / 2 (ln2 split in two, Cody-Waite), e^r by Cephes' degree-7 polynomial, 2^n by
/// the exponent bits. Below -87.3 (where e^x is under 2^-126) it returns 0.
TRIATTN_HOST_DEVICE float window_exp(float x) {
  const float clamped = x < -87.3f ? -87.3f : x;
  const float shifter = 12582912.0f;  // 1.5 x 2^23: adding it rounds to an integer, in any rounding code
  const float n = multiply_add(clamped, 1.44269504088896341f, shifter) - shifter;
  const float r = multiply_add(n, 2.12194440e-4f, multiply_add(-n, 0.693359375f, clamped));  // n ln2_hi is exact
  float p = 1.9875691500e-4f;
  p = multiply_add(p, r, 1.3981999507e-3f);
  p = multiply_add(p, r, 8.3334519073e-3f);
  p = multiply_add(p, r, 4.1665795894e-2f);
  p = multiply_add(p, r, 1.6666665459e-1f);
  p = multiply_add(p, r, 5.0000001201e-1f);
  const float e = multiply_add(p, r * r, r) + 1.0f;
  const float two_n = detail::bits_float(static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : e * two_n;
}

/// The unnormalised softmax entry of `x` in a row whose largest entry is `top`. A masked
/// entry (−inf) is exactly 0, so ties of masked keys stay ties; a fully masked row (top −inf)
/// gives only zeros.
TRIATTN_HOST_DEVICE float softmax_numerator(float x, float top) {
  return x == -INFINITY ? 0.0f : window_exp(x - top);
}

/// The softmax entry from its numerator and the row's sum of numerators. A row with a sum of
/// 0 is fully masked and carries no attention: its entries are 0 (not 0/0). Any other sum is
/// >= 1 (the top entry contributes exp(0)).
TRIATTN_HOST_DEVICE float softmax_probability(float numerator, float sum) { return sum > 0.0f ? numerator / sum : 0.0f; }

/// R-KV's importance is the mean of the window rows' attention: `sum` over `rows` rows.
TRIATTN_HOST_DEVICE float rkv_attention_mean(float sum, int rows) { return sum / static_cast<float>(rows); }

/// What R-KV divides a key by to make it a unit key: ‖k‖ + 1e-8 (the reference's epsilon,
/// which keeps a zero key at zero instead of NaN), from the squared norm.
TRIATTN_HOST_DEVICE float rkv_unit_divisor(float squared_norm) { return sqrtf(squared_norm) + 1e-8f; }

/// Cell (r, j) of R-KV's similarity matrix from the unit keys' dot product `s`: the diagonal
/// is 0 (a key is no duplicate of itself).
TRIATTN_HOST_DEVICE float rkv_similarity(float s, std::int64_t r, std::int64_t j) { return r == j ? 0.0f : s; }

/// Whether column j of a similarity row (diagonal already zeroed) may be the row's newest
/// near-duplicate: j > 0 and above the threshold. The row's newest duplicate is the largest
/// such j, or 0 when none is (the reference's `torch.where(mask, arange, 0).max()`).
TRIATTN_HOST_DEVICE bool rkv_duplicate_candidate(float similarity, std::int64_t j, float threshold) {
  return j > 0 && similarity > threshold;
}

/// The newest near-duplicate of a similarity row `row` [n] (diagonal already zeroed): the CPU
/// scans a whole row, the GPU reduces `rkv_duplicate_candidate` over tiles.
TRIATTN_HOST_DEVICE std::int64_t rkv_newest_duplicate(const float* row, std::int64_t n, float threshold) {
  for (std::int64_t j = n - 1; j > 0; --j)
    if (rkv_duplicate_candidate(row[j], j, threshold)) return j;
  return 0;
}

/// What cell (r, j) adds to column j's redundancy sum: the similarity (diagonal already
/// zeroed), except 0 at the row's newest duplicate `newest` (the newest copy is spared).
TRIATTN_HOST_DEVICE float rkv_column_term(float similarity, std::int64_t j, std::int64_t newest) {
  return j == newest ? 0.0f : similarity;
}

/// Column j's redundancy before the softmax: the mean of its `n` terms.
TRIATTN_HOST_DEVICE float rkv_column_mean(float sum, std::int64_t n) { return sum / static_cast<float>(n); }

/// R-KV's score of a prefix slot: Z = λ I − (1 − λ) R.
TRIATTN_HOST_DEVICE float rkv_mix(float importance, float redundancy, float lambda) {
  return multiply_add(lambda, importance, -((1.0f - lambda) * redundancy));
}

TRIATTN_NAMESPACE_END
