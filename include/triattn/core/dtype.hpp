/// \file triattn/core/dtype.hpp
/// \brief Element types of a KV cache (f32, f16, bf16) and their conversions.
///
/// The conversions are bit manipulations written once as `TRIATTN_HOST_DEVICE` functions,
/// so the host path needs no CUDA header and the CUDA path decodes with the same code.
/// Float-to-half and float-to-bfloat16 round to nearest, ties to even, like the hardware.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "triattn/core/config.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Storage type of the elements of K and V.
enum class dtype : std::uint8_t { f32, f16, bf16 };

/// Size of one element in bytes.
TRIATTN_HOST_DEVICE std::size_t dtype_bytes(dtype t) { return t == dtype::f32 ? 4 : 2; }

/// Name for messages: "f32", "f16", "bf16".
inline const char* dtype_name(dtype t) {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "?";
}

/// IEEE 754 binary16, stored as its bits. A distinct type so that overloads and
/// `dtype_of<T>` can tell it from `std::uint16_t`.
struct half_t {
  std::uint16_t bits;
};
/// bfloat16 (the upper 16 bits of an f32), stored as its bits.
struct bfloat16_t {
  std::uint16_t bits;
};

namespace detail {
TRIATTN_HOST_DEVICE std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}
TRIATTN_HOST_DEVICE float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}
}  // namespace detail

/// binary16 bits -> f32 (exact: every half is a float).
TRIATTN_HOST_DEVICE float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t out;
  if (exp == 0x1f) {  // inf / nan: keep the payload
    out = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    out = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    out = sign;
  } else {  // subnormal: normalise into an f32 normal
    std::uint32_t e = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  return detail::bits_float(out);
}

/// f32 -> binary16 bits, round to nearest even; overflow gives inf, NaN stays NaN (quiet).
TRIATTN_HOST_DEVICE std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u | ((abs >> 13) & 0x3ffu) : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs < 0x33000000u) return sign;  // < 2^-25 rounds to zero (2^-25 itself ties to even 0)
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp - 150) and the subnormal unit is 2^-24, so q = mant >> (126 - exp)
    const std::uint32_t shift = 126u - exp;  // in [14, 24] here
    std::uint32_t q = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  // normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits
  std::uint32_t h = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<std::uint16_t>(sign | h);
}

/// bfloat16 bits -> f32 (exact).
TRIATTN_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
}

/// f32 -> bfloat16 bits, round to nearest even; NaN stays NaN (quiet).
TRIATTN_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = detail::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

TRIATTN_HOST_DEVICE float to_float(float x) { return x; }
TRIATTN_HOST_DEVICE float to_float(half_t x) { return half_bits_to_float(x.bits); }
TRIATTN_HOST_DEVICE float to_float(bfloat16_t x) { return bf16_bits_to_float(x.bits); }

/// Converts an f32 to the storage type `T` (rounding to nearest even).
template <class T>
TRIATTN_HOST_DEVICE T from_float(float x) {
  if constexpr (std::is_same_v<T, half_t>) {
    return half_t{float_to_half_bits(x)};
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return bfloat16_t{float_to_bf16_bits(x)};
  } else {
    static_assert(std::is_same_v<T, float>, "triattn::from_float: T must be float, half_t or bfloat16_t");
    return x;
  }
}

/// The `dtype` tag of a storage type.
template <class T>
inline constexpr dtype dtype_of = std::is_same_v<T, half_t>       ? dtype::f16
                                  : std::is_same_v<T, bfloat16_t> ? dtype::bf16
                                                                  : dtype::f32;

/// Reads element `i` of a buffer of runtime type `t` as f32.
TRIATTN_HOST_DEVICE float load_element(const std::byte* p, dtype t, std::size_t i) {
  if (t == dtype::f32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  std::uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return t == dtype::f16 ? half_bits_to_float(b) : bf16_bits_to_float(b);
}

/// Writes `x` as element `i` of a buffer of runtime type `t`, rounding to nearest even.
TRIATTN_HOST_DEVICE void store_element(std::byte* p, dtype t, std::size_t i, float x) {
  if (t == dtype::f32) {
    std::memcpy(p + 4 * i, &x, 4);
    return;
  }
  const std::uint16_t b = t == dtype::f16 ? float_to_half_bits(x) : float_to_bf16_bits(x);
  std::memcpy(p + 2 * i, &b, 2);
}

TRIATTN_NAMESPACE_END
