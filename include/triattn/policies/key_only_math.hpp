/// \file triattn/policies/key_only_math.hpp
/// \brief The per-key formulas of the policies that read nothing but the cached keys (K-norm,
/// KeyDiff), written once for the CPU policies and the CUDA scorers (knorm.cuh, keydiff.cuh):
/// the same float operations in the same order on both sides. Sums are `fixed_order_dot`s and
/// explicit fused multiply-adds (core/dot.hpp), so every build and the GPU get the same bits.
#pragma once

#include <cmath>

#include "triattn/core/config.hpp"
#include "triattn/core/dot.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Norms below this count as zero: a zero key is no direction, its cosine with anything is 0
/// (PyTorch's `F.normalize` floors the norm alike).
inline constexpr float key_norm_floor = 1e-12f;

/// ‖k‖₂ of `k` [n].
TRIATTN_HOST_DEVICE float l2_norm(const float* k, int n) { return sqrtf(fixed_order_dot(k, k, n)); }

/// 1 / max(norm, floor): what scales a vector of that norm to unit length.
TRIATTN_HOST_DEVICE float unit_scale(float norm) { return 1.0f / (norm > key_norm_floor ? norm : key_norm_floor); }

/// K-norm's score of a key of norm `norm`: −‖k‖₂ (keys with small norms draw attention).
TRIATTN_HOST_DEVICE float knorm_score(float norm) { return -norm; }

/// KeyDiff's score of key `k` [n] against the anchor sum `anchor` [n] (Σ of the unit keys;
/// only its direction matters): −cos(k, anchor), 0 for a zero key or anchor.
TRIATTN_HOST_DEVICE float keydiff_score(const float* k, const float* anchor, int n) {
  return -(fixed_order_dot(k, anchor, n) * unit_scale(l2_norm(k, n)) * unit_scale(l2_norm(anchor, n)));
}

/// Adds the unit direction of key `k` [n] to the anchor sum `anchor` [n] (slot after slot).
TRIATTN_HOST_DEVICE void keydiff_accumulate(const float* k, int n, float* anchor) {
  const float u = unit_scale(l2_norm(k, n));
  for (int d = 0; d < n; ++d) anchor[d] = multiply_add(k[d], u, anchor[d]);
}

TRIATTN_NAMESPACE_END
