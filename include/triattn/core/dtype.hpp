/// \file triattn/core/dtype.hpp
/// \brief Element types of a KV cache (f32, f16, bf16, fp8 e4m3 and e5m2) and their
/// conversions.
///
/// The conversions are bit manipulations written once as `TRIATTN_HOST_DEVICE` functions,
/// so the host path needs no CUDA header and the CUDA path decodes with the same code. Every
/// float-to-narrow conversion rounds to nearest, ties to even, like the hardware.
///
/// **Element types are types.** Each storage type (`float`, `half_t`, `bfloat16_t`,
/// `fp8_e4m3_t`, `fp8_e5m2_t`) has an `element_traits` specialisation (its `dtype` tag, its
/// size, decode and encode). The run-time tag `dtype` is turned into the type once, by
/// `visit_dtype`, which walks the list `element_types`: adding an element type is one traits
/// specialisation and one entry in that list, not a new `switch` case anywhere.
///
/// **fp8** follows the OCP 8-bit formats that vLLM and TensorRT-LLM store: e4m3 ("fn": no
/// infinity, one NaN pattern per sign, largest 448) and e5m2 (IEEE-like, with infinities,
/// largest 57344). Encoding saturates finite values to the largest finite one, as vLLM's
/// `scaled_fp8_quant` clamps; an infinity becomes e5m2's infinity and, since e4m3 has none,
/// e4m3's NaN (PyTorch's cast does the same), so a non-finite input never becomes a plausible
/// number. A cache in fp8 has a per-tensor scale per K and V (`kv_geometry::k_scale` /
/// `v_scale`): the value is decode(bits) x scale, and a store encodes x / scale.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if !defined(__CUDA_ARCH__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "triattn/core/config.hpp"

TRIATTN_NAMESPACE_BEGIN

/// Storage type of the elements of K and V.
enum class dtype : std::uint8_t { f32, f16, bf16, fp8_e4m3, fp8_e5m2 };

/// IEEE 754 binary16, stored as its bits. A distinct type so that overloads and
/// `dtype_of<T>` can tell it from `std::uint16_t`.
struct half_t {
  std::uint16_t bits;
};
/// bfloat16 (the upper 16 bits of an f32), stored as its bits.
struct bfloat16_t {
  std::uint16_t bits;
};
/// OCP fp8 e4m3 ("fn": 4 exponent bits, bias 7, 3 mantissa bits, no infinity), as its bits.
struct fp8_e4m3_t {
  std::uint8_t bits;
};
/// OCP fp8 e5m2 (5 exponent bits, bias 15, 2 mantissa bits, IEEE-like), as its bits.
struct fp8_e5m2_t {
  std::uint8_t bits;
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

/// binary16 bits -> f32 (exact: every half is a float). Branch-free (every case is computed
/// and one is selected), so that a loop over a row vectorises: normals and infinities/NaNs
/// rebias the exponent in the integer bits (NaN payloads kept), subnormals are their mantissa
/// times 2^-24 (an exact int-to-float conversion, so no denormal is ever an operand).
TRIATTN_HOST_DEVICE float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t mag = h & 0x7fffu;
  const std::uint32_t exp = mag >> 10;
  const std::uint32_t shifted = mag << 13;
  const std::uint32_t normal = shifted + (112u << 23);     // exponent 15 -> 127
  const std::uint32_t inf_nan = shifted + (224u << 23);    // exponent 31 -> 255
  const std::uint32_t subnormal = detail::float_bits(static_cast<float>(mag) * 0x1p-24f);
  const std::uint32_t out = exp == 0x1fu ? inf_nan : (exp == 0u ? subnormal : normal);
  return detail::bits_float(sign | out);
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

namespace detail {
/// A small float format: `E` exponent bits, `M` mantissa bits, bias 2^(E-1) - 1. `Ieee`
/// formats reserve the top exponent for infinities and NaNs (e5m2); the others have one NaN
/// per sign, all ones (e4m3).
template <int E, int M, bool Ieee>
struct minifloat {
  static constexpr int bias = (1 << (E - 1)) - 1;
  static constexpr std::uint32_t exp_all = (1u << E) - 1u;
  static constexpr std::uint8_t nan = Ieee ? static_cast<std::uint8_t>((exp_all << M) | (1u << (M - 1)))
                                           : static_cast<std::uint8_t>((1u << (E + M)) - 1u);
  static constexpr std::uint8_t inf = Ieee ? static_cast<std::uint8_t>(exp_all << M) : nan;
  /// The bits of the largest finite magnitude.
  static constexpr std::uint8_t max_finite = Ieee ? static_cast<std::uint8_t>((exp_all << M) - 1u)
                                                  : static_cast<std::uint8_t>((1u << (E + M)) - 2u);

  /// Branch-free, like `half_bits_to_float`: a row's loop vectorises.
  TRIATTN_HOST_DEVICE static float decode(std::uint8_t b) {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
    const std::uint32_t mag = b & 0x7fu;
    const std::uint32_t exp = mag >> M, mant = mag & ((1u << M) - 1u);
    const std::uint32_t normal = ((exp + 127u - bias) << 23) | (mant << (23 - M));
    // subnormal or zero: mant x 2^(1 - bias - M), exact in f32
    const std::uint32_t subnormal =
        float_bits(static_cast<float>(mant) * bits_float(static_cast<std::uint32_t>(127 + 1 - bias - M) << 23));
    // e5m2: infinities and NaNs keep their payload; e4m3: its one NaN per sign, quiet
    const std::uint32_t special = Ieee ? 0x7f800000u | (mant << (23 - M)) : 0x7fc00000u;
    const bool is_special = Ieee ? exp == exp_all : mag == (nan & 0x7fu);
    return bits_float(sign | (is_special ? special : (exp == 0 ? subnormal : normal)));
  }

  TRIATTN_HOST_DEVICE static std::uint8_t encode(float f) {
    const std::uint32_t u = float_bits(f);
    const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
    const std::uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<std::uint8_t>(sign | nan);
    if (abs == 0x7f800000u) return static_cast<std::uint8_t>(sign | inf);
    const std::uint32_t min_normal = static_cast<std::uint32_t>(127 + 1 - bias) << 23;
    std::uint32_t q;
    if (abs < min_normal) {
      // Subnormal range: count units of 2^(1 - bias - M). Scaling by a power of two is exact,
      // so the only rounding is the integer one, done by hand to nearest even.
      const float units = bits_float(abs) * bits_float(static_cast<std::uint32_t>(127 - (1 - bias - M)) << 23);
      const auto whole = static_cast<std::uint32_t>(units);
      const float frac = units - static_cast<float>(whole);
      q = whole + ((frac > 0.5f || (frac == 0.5f && (whole & 1u))) ? 1u : 0u);  // 2^M is the smallest normal
    } else {
      // Normal: rebias the exponent and round the dropped mantissa bits; a carry moves into
      // the exponent, which is the correct result.
      constexpr std::uint32_t drop = 23 - M;
      q = (abs - ((127u - bias) << 23)) >> drop;
      const std::uint32_t rem = abs & ((1u << drop) - 1u), half = 1u << (drop - 1);
      if (rem > half || (rem == half && (q & 1u))) ++q;
    }
    if (q > max_finite) q = max_finite;  // saturate finite values (vLLM clamps before the cast)
    return static_cast<std::uint8_t>(sign | q);
  }
};
using e4m3_format = minifloat<4, 3, false>;
using e5m2_format = minifloat<5, 2, true>;
}  // namespace detail

/// fp8 e4m3 bits -> f32 (exact).
TRIATTN_HOST_DEVICE float fp8_e4m3_bits_to_float(std::uint8_t b) { return detail::e4m3_format::decode(b); }
/// f32 -> fp8 e4m3 bits: nearest even, finite values saturate to +-448, infinities and NaN give NaN.
TRIATTN_HOST_DEVICE std::uint8_t float_to_fp8_e4m3_bits(float f) { return detail::e4m3_format::encode(f); }
/// fp8 e5m2 bits -> f32 (exact).
TRIATTN_HOST_DEVICE float fp8_e5m2_bits_to_float(std::uint8_t b) { return detail::e5m2_format::decode(b); }
/// f32 -> fp8 e5m2 bits: nearest even, finite values saturate to +-57344, infinities stay.
TRIATTN_HOST_DEVICE std::uint8_t float_to_fp8_e5m2_bits(float f) { return detail::e5m2_format::encode(f); }

TRIATTN_HOST_DEVICE float to_float(float x) { return x; }
TRIATTN_HOST_DEVICE float to_float(half_t x) { return half_bits_to_float(x.bits); }
TRIATTN_HOST_DEVICE float to_float(bfloat16_t x) { return bf16_bits_to_float(x.bits); }
TRIATTN_HOST_DEVICE float to_float(fp8_e4m3_t x) { return fp8_e4m3_bits_to_float(x.bits); }
TRIATTN_HOST_DEVICE float to_float(fp8_e5m2_t x) { return fp8_e5m2_bits_to_float(x.bits); }

/// What the library knows of a storage type: its tag, its name, and its conversions.
template <class T>
struct element_traits;
template <>
struct element_traits<float> {
  static constexpr dtype tag = dtype::f32;
  static constexpr const char* name = "f32";
  TRIATTN_HOST_DEVICE static float encode(float x) { return x; }
};
template <>
struct element_traits<half_t> {
  static constexpr dtype tag = dtype::f16;
  static constexpr const char* name = "f16";
  TRIATTN_HOST_DEVICE static half_t encode(float x) { return {float_to_half_bits(x)}; }
};
template <>
struct element_traits<bfloat16_t> {
  static constexpr dtype tag = dtype::bf16;
  static constexpr const char* name = "bf16";
  TRIATTN_HOST_DEVICE static bfloat16_t encode(float x) { return {float_to_bf16_bits(x)}; }
};
template <>
struct element_traits<fp8_e4m3_t> {
  static constexpr dtype tag = dtype::fp8_e4m3;
  static constexpr const char* name = "fp8_e4m3";
  TRIATTN_HOST_DEVICE static fp8_e4m3_t encode(float x) { return {float_to_fp8_e4m3_bits(x)}; }
};
template <>
struct element_traits<fp8_e5m2_t> {
  static constexpr dtype tag = dtype::fp8_e5m2;
  static constexpr const char* name = "fp8_e5m2";
  TRIATTN_HOST_DEVICE static fp8_e5m2_t encode(float x) { return {float_to_fp8_e5m2_bits(x)}; }
};

/// Every storage type, in `dtype` order.
template <class... T>
struct type_list {};
using element_types = type_list<float, half_t, bfloat16_t, fp8_e4m3_t, fp8_e5m2_t>;

/// Converts an f32 to the storage type `T` (rounding to nearest even).
template <class T>
TRIATTN_HOST_DEVICE T from_float(float x) {
  return element_traits<T>::encode(x);
}

/// The `dtype` tag of a storage type.
template <class T>
inline constexpr dtype dtype_of = element_traits<T>::tag;

// visit_dtype is host-device and its callers pass host-only or device-only callables (a host
// lambda in dtype_name): nvcc must not check the other side of a template it never calls there.
namespace detail {
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class F, class T, class... Rest>
TRIATTN_HOST_DEVICE decltype(auto) visit_dtype_in(dtype t, F&& f, type_list<T, Rest...>) {
  if constexpr (sizeof...(Rest) == 0) {
    return f.template operator()<T>();  // the last type: callers validated the tag
  } else {
    if (t == element_traits<T>::tag) return f.template operator()<T>();
    return visit_dtype_in(t, static_cast<F&&>(f), type_list<Rest...>{});
  }
}
}  // namespace detail

/// Calls `f.template operator()<T>()` with the storage type `T` whose tag is `t`: the one place
/// where the run-time tag becomes a type. An out-of-range tag is treated as the last type;
/// views reject such tags in `validate` (see `is_valid_dtype`).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class F>
TRIATTN_HOST_DEVICE decltype(auto) visit_dtype(dtype t, F&& f) {
  return detail::visit_dtype_in(t, static_cast<F&&>(f), element_types{});
}

/// Whether `t` is one of the tags of `element_types`.
TRIATTN_HOST_DEVICE bool is_valid_dtype(dtype t) {
  return static_cast<std::uint8_t>(t) <= static_cast<std::uint8_t>(dtype::fp8_e5m2);
}

/// Size of one element in bytes.
TRIATTN_HOST_DEVICE std::size_t dtype_bytes(dtype t) {
  return visit_dtype(t, [&]<class T>() { return sizeof(T); });  // [&]: nvcc warns on a captureless template lambda
}

/// Name for messages: "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2".
inline const char* dtype_name(dtype t) {
  if (!is_valid_dtype(t)) return "?";
  return visit_dtype(t, [&]<class T>() { return element_traits<T>::name; });
}

/// Element `i` of a row of `T` as f32 (unscaled).
template <class T>
TRIATTN_HOST_DEVICE float load_as(const std::byte* p, std::size_t i) {
  T x;
  std::memcpy(&x, p + sizeof(T) * i, sizeof(T));
  return to_float(x);
}
/// Writes `x` as element `i` of a row of `T`, rounding to nearest even.
template <class T>
TRIATTN_HOST_DEVICE void store_as(std::byte* p, std::size_t i, float x) {
  const T y = from_float<T>(x);
  std::memcpy(p + sizeof(T) * i, &y, sizeof(T));
}

/// Reads element `i` of a buffer of runtime type `t` as f32 (unscaled). One dispatch per
/// element: for whole rows use an accessor (kv_cache_view.hpp), which dispatches once.
TRIATTN_HOST_DEVICE float load_element(const std::byte* p, dtype t, std::size_t i) {
  return visit_dtype(t, [&]<class T>() { return load_as<T>(p, i); });
}

/// Writes `x` as element `i` of a buffer of runtime type `t`, rounding to nearest even.
TRIATTN_HOST_DEVICE void store_element(std::byte* p, dtype t, std::size_t i, float x) {
  visit_dtype(t, [&]<class T>() { store_as<T>(p, i, x); });
}

/// Rows of one storage type `T` with a per-tensor scale: element d of a row is
/// decode(row[d]) x scale, and a store writes encode(x / scale). The `scale` of f32, f16 and
/// bf16 caches is 1 (a multiplication by 1 is exact, so their values are the plain decode).
/// The compile-time accessor: a view whose element type is known uses it directly.
template <class T>
struct scaled_accessor {
  using element_type = T;
  float scale = 1.0f;

  TRIATTN_HOST_DEVICE void load(const std::byte* row, int n, float* out) const {
    int d = 0;
#if !defined(__CUDA_ARCH__) && defined(__F16C__)
    if constexpr (std::is_same_v<T, half_t>) {  // the hardware's conversion: exact, as the bit decode
#if defined(__AVX512F__)
      for (; d + 16 <= n; d += 16)
        _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row) + d / 16)));
#endif
      for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row) + d / 8)));
    }
#endif
    for (; d < n; ++d) out[d] = load_as<T>(row, static_cast<std::size_t>(d));
    if (scale != 1.0f)  // x 1 is exact: unscaled caches skip the pass
      for (d = 0; d < n; ++d) out[d] *= scale;
  }
  TRIATTN_HOST_DEVICE void store(std::byte* row, int n, const float* in) const {
    for (int d = 0; d < n; ++d) store_as<T>(row, static_cast<std::size_t>(d), in[d] / scale);
  }
};

/// Rows whose storage type is known at run time only: one dispatch per row to the
/// `scaled_accessor` of the type, then that accessor's loop.
struct dtype_accessor {
  dtype type = dtype::f32;
  float scale = 1.0f;

  TRIATTN_HOST_DEVICE void load(const std::byte* row, int n, float* out) const {
    visit_dtype(type, [&]<class T>() { scaled_accessor<T>{scale}.load(row, n, out); });
  }
  TRIATTN_HOST_DEVICE void store(std::byte* row, int n, const float* in) const {
    visit_dtype(type, [&]<class T>() { scaled_accessor<T>{scale}.store(row, n, in); });
  }
};

TRIATTN_NAMESPACE_END
