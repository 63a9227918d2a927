// Slow, double-precision oracles written from the formulas (IEEE 754 layouts, Hugging Face's
// RoPE code, complex multiplication), sharing no code with the library under test. The
// library's enums and rope_desc are used only as plain parameter containers.
#pragma once

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>
#include <utility>
#include <vector>

#include "triattn/core/dtype.hpp"
#include "triattn/core/rope.hpp"

namespace triattn_test::ref {

// --- 16-bit floats -----------------------------------------------------------------------

/// A binary format with a sign bit, `exp_bits` exponent bits and `mant_bits` stored mantissa bits.
struct small_float_format {
  int mant_bits;
  int exp_bits;
  int bias;
};
inline constexpr small_float_format f16_format{10, 5, 15};
inline constexpr small_float_format bf16_format{7, 8, 127};

/// Value of a bit pattern, from the definition: (-1)^s 2^(e-bias) 1.m, or 2^(1-bias) 0.m.
inline double decode(small_float_format f, std::uint16_t bits) {
  const bool negative = (bits >> 15) != 0;
  const int e = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = bits & ((1 << f.mant_bits) - 1);
  double v;
  if (e == (1 << f.exp_bits) - 1) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m, 1 - f.bias - f.mant_bits);
  } else {
    v = std::ldexp(m + (1 << f.mant_bits), e - f.bias - f.mant_bits);
  }
  return negative ? -v : v;
}

/// Rounds `x` to the format, to nearest with ties to even, by scaling to an integer count of
/// units in the last place and rounding that integer. NaN gives a quiet NaN.
inline std::uint16_t encode(small_float_format f, double x) {
  const auto sign = static_cast<std::uint16_t>(std::signbit(x) ? 0x8000 : 0);
  const auto exp_ones = static_cast<std::uint16_t>(((1 << f.exp_bits) - 1) << f.mant_bits);
  if (std::isnan(x)) return static_cast<std::uint16_t>(sign | exp_ones | (1 << (f.mant_bits - 1)));
  const double a = std::fabs(x);
  const int emin = 1 - f.bias;                      // exponent of the smallest normal
  const int emax = (1 << f.exp_bits) - 2 - f.bias;  // exponent of the largest normal
  if (std::isinf(a)) return static_cast<std::uint16_t>(sign | exp_ones);
  int e = emin;  // subnormals share the unit of the smallest binade
  if (a >= std::ldexp(1.0, emin)) {
    int fe = 0;
    std::frexp(a, &fe);
    e = fe - 1;  // a in [2^e, 2^(e+1))
  }
  const double q = std::ldexp(a, f.mant_bits - e);  // exact: a power-of-two scaling
  double r = std::floor(q);
  const double frac = q - r;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) == 1.0)) r += 1.0;
  if (r == std::ldexp(1.0, f.mant_bits + 1)) {  // rounded up into the next binade
    r /= 2.0;
    ++e;
  }
  if (e > emax) return static_cast<std::uint16_t>(sign | exp_ones);
  const auto ri = static_cast<int>(r);
  if (ri < (1 << f.mant_bits)) return static_cast<std::uint16_t>(sign | ri);  // zero or subnormal
  return static_cast<std::uint16_t>(sign | ((e + f.bias) << f.mant_bits) | (ri - (1 << f.mant_bits)));
}

// --- 8-bit floats (OCP fp8), from the definition ------------------------------------------

/// An OCP 8-bit format: `exp_bits` + `mant_bits` = 7, bias 2^(exp_bits-1) - 1. `ieee`: the top
/// exponent holds infinities and NaNs (e5m2); otherwise only all-ones is NaN, there is no
/// infinity, and the top exponent holds normal numbers (e4m3 "fn").
struct fp8_format {
  int mant_bits;
  int exp_bits;
  bool ieee;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
};
inline constexpr fp8_format e4m3_format{3, 4, false};
inline constexpr fp8_format e5m2_format{2, 5, true};

/// Value of an fp8 bit pattern: (-1)^s 2^(e-bias) 1.m, or 2^(1-bias) 0.m; NaN and inf as above.
inline double decode8(fp8_format f, std::uint8_t bits) {
  const bool negative = (bits & 0x80) != 0;
  const int e = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = bits & ((1 << f.mant_bits) - 1);
  const int e_top = (1 << f.exp_bits) - 1, m_top = (1 << f.mant_bits) - 1;
  double v;
  if (f.ieee && e == e_top) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (!f.ieee && e == e_top && m == m_top) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m, 1 - f.bias() - f.mant_bits);
  } else {
    v = std::ldexp(m + (1 << f.mant_bits), e - f.bias() - f.mant_bits);
  }
  return negative ? -v : v;
}

/// The largest finite magnitude of the format (448 for e4m3, 57344 for e5m2).
inline double fp8_max(fp8_format f) {
  double m = 0.0;
  for (int b = 0; b < 0x80; ++b) {
    const double v = decode8(f, static_cast<std::uint8_t>(b));
    if (std::isfinite(v)) m = std::max(m, v);
  }
  return m;
}

/// `x` rounded to the format as a value: nearest with ties to even (an even last mantissa
/// bit), finite values saturating to +-max (vLLM's clamp), NaN to NaN, infinities to inf
/// (e5m2) or NaN (e4m3, which has none). Computed by scaling to an integer count of units.
inline double round8(fp8_format f, double x) {
  if (std::isnan(x)) return x;
  if (std::isinf(x)) return f.ieee ? x : std::numeric_limits<double>::quiet_NaN();
  const double a = std::fabs(x);
  const int emin = 1 - f.bias();
  int e = emin;
  if (a >= std::ldexp(1.0, emin)) {
    int fe = 0;
    std::frexp(a, &fe);
    e = fe - 1;
  }
  const double q = std::ldexp(a, f.mant_bits - e);
  double r = std::floor(q);
  const double frac = q - r;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) == 1.0)) r += 1.0;
  const double v = std::min(std::ldexp(r, e - f.mant_bits), fp8_max(f));
  return std::signbit(x) ? -v : v;
}

/// The bit pattern holding `round8(f, x)` (same sign for zeros; the NaN with x's sign).
inline std::uint8_t encode8(fp8_format f, double x) {
  const double v = round8(f, x);
  for (int b = 0; b < 256; ++b) {
    const double d = decode8(f, static_cast<std::uint8_t>(b));
    if (std::signbit(d) != std::signbit(v)) continue;
    if ((std::isnan(v) && std::isnan(d)) || d == v) return static_cast<std::uint8_t>(b);
  }
  return 0;
}

inline bool is_fp8(triattn::dtype t) { return t == triattn::dtype::fp8_e4m3 || t == triattn::dtype::fp8_e5m2; }
inline fp8_format fp8_of(triattn::dtype t) { return t == triattn::dtype::fp8_e4m3 ? e4m3_format : e5m2_format; }

/// Element `i` of a buffer of `t`, decoded (unscaled).
inline double load(const std::byte* p, triattn::dtype t, std::size_t i) {
  if (t == triattn::dtype::f32) {
    float x;
    std::memcpy(&x, p + 4 * i, 4);
    return x;
  }
  if (is_fp8(t)) return decode8(fp8_of(t), static_cast<std::uint8_t>(p[i]));
  std::uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return decode(t == triattn::dtype::f16 ? f16_format : bf16_format, b);
}

/// Writes `x` rounded to `t` (unscaled) as element `i`.
inline void store(std::byte* p, triattn::dtype t, std::size_t i, double x) {
  if (t == triattn::dtype::f32) {
    const auto f = static_cast<float>(x);
    std::memcpy(p + 4 * i, &f, 4);
    return;
  }
  if (is_fp8(t)) {
    p[i] = static_cast<std::byte>(encode8(fp8_of(t), x));
    return;
  }
  const std::uint16_t b = encode(t == triattn::dtype::f16 ? f16_format : bf16_format, x);
  std::memcpy(p + 2 * i, &b, 2);
}

/// Bytes of one element of `t`.
inline std::size_t bytes_of(triattn::dtype t) {
  return t == triattn::dtype::f32 ? 4 : is_fp8(t) ? 1 : 2;
}

/// Unit roundoff of a storage type (half the relative spacing).
inline double unit_roundoff(triattn::dtype t) {
  switch (t) {
    case triattn::dtype::f32: return std::ldexp(1.0, -24);
    case triattn::dtype::f16: return std::ldexp(1.0, -11);
    case triattn::dtype::bf16: return std::ldexp(1.0, -8);
    case triattn::dtype::fp8_e4m3: return std::ldexp(1.0, -4);
    case triattn::dtype::fp8_e5m2: return std::ldexp(1.0, -3);
  }
  return 0.0;
}

// --- RoPE inverse frequencies, transcribed from transformers' modeling_rope_utils.py ------

/// `_compute_default_rope_parameters`: 1 / base^(arange(0, dim, 2) / dim).
inline std::vector<double> hf_default_inv_freq(double base, int dim) {
  std::vector<double> inv;
  for (int i = 0; i < dim; i += 2) inv.push_back(1.0 / std::pow(base, static_cast<double>(i) / dim));
  return inv;
}

/// `_compute_linear_scaling_rope_parameters`: inv_freq /= factor.
inline std::vector<double> hf_linear_inv_freq(double base, int dim, double factor) {
  auto inv = hf_default_inv_freq(base, dim);
  for (auto& w : inv) w /= factor;
  return inv;
}

/// `_compute_llama3_parameters`.
inline std::vector<double> hf_llama3_inv_freq(double base, int dim, double factor, double low_freq_factor,
                                              double high_freq_factor, double old_context_len) {
  const auto inv_freq = hf_default_inv_freq(base, dim);
  const double low_freq_wavelen = old_context_len / low_freq_factor;
  const double high_freq_wavelen = old_context_len / high_freq_factor;
  std::vector<double> out(inv_freq.size());
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / inv_freq[i];
    const double llama = wavelen > low_freq_wavelen ? inv_freq[i] / factor : inv_freq[i];
    const double smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
    const double smoothed = (1 - smooth_factor) * llama / factor + smooth_factor * llama;
    const bool is_medium_freq = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    out[i] = is_medium_freq ? smoothed : llama;
  }
  return out;
}

/// `_compute_yarn_parameters` (inv_freq part).
inline std::vector<double> hf_yarn_inv_freq(double base, int dim, double factor, double beta_fast, double beta_slow,
                                            double original_max_position_embeddings, bool truncate) {
  const auto find_correction_dim = [&](double num_rotations) {
    return (dim * std::log(original_max_position_embeddings / (num_rotations * 2 * std::numbers::pi))) /
           (2 * std::log(base));
  };
  double low = find_correction_dim(beta_fast);
  double high = find_correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // "Prevent singularity"
  std::vector<double> out;
  for (int i = 0; i < dim / 2; ++i) {
    const double pos_freq = std::pow(base, static_cast<double>(2 * i) / dim);
    const double extrapolation = 1.0 / pos_freq;
    const double interpolation = 1.0 / (factor * pos_freq);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1 - ramp;
    out.push_back(interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor);
  }
  return out;
}

/// `_compute_yarn_parameters` (attention_factor when none is configured): get_mscale(factor).
inline double hf_yarn_attention_factor(double factor) { return factor <= 1 ? 1.0 : 0.1 * std::log(factor) + 1.0; }

/// The inverse frequencies of `dim` rotated dims for the rule named in `r`.
inline std::vector<double> inv_freq(const triattn::rope_desc& r, int dim) {
  const auto& s = r.scaling;
  switch (s.type) {
    case triattn::rope_scaling_type::none: return hf_default_inv_freq(r.theta, dim);
    case triattn::rope_scaling_type::linear: return hf_linear_inv_freq(r.theta, dim, s.factor);
    case triattn::rope_scaling_type::llama3:
      return hf_llama3_inv_freq(r.theta, dim, s.factor, s.low_freq_factor, s.high_freq_factor,
                                s.original_max_position);
    case triattn::rope_scaling_type::yarn:
      return hf_yarn_inv_freq(r.theta, dim, s.factor, s.beta_fast, s.beta_slow, s.original_max_position, s.truncate);
  }
  return {};
}

// --- RoPE as complex multiplication --------------------------------------------------------

/// The two dims of band f: (f, f + R/2) for the half pairing, (2f, 2f + 1) for interleaved.
inline std::pair<int, int> band_dims(triattn::rope_style style, int rotary, int f) {
  if (style == triattn::rope_style::half) return {f, f + rotary / 2};
  return {2 * f, 2 * f + 1};
}

/// x rotated to position `pos`: z_f <- a e^{i pos w_f} z_f on the first R dims, the rest copied.
inline std::vector<double> rotate(const triattn::rope_desc& r, const std::vector<double>& x, double pos) {
  const int head_dim = static_cast<int>(x.size());
  const int rotary = r.rotary_dim > 0 ? r.rotary_dim : head_dim;
  const auto w = inv_freq(r, rotary);
  std::vector<double> y = x;
  for (int f = 0; f < rotary / 2; ++f) {
    const auto [re, im] = band_dims(r.style, rotary, f);
    const std::complex<double> z(x[re], x[im]);
    const std::complex<double> rz = r.attention_scale * std::polar(1.0, pos * w[f]) * z;
    y[re] = rz.real();
    y[im] = rz.imag();
  }
  return y;
}

}  // namespace triattn_test::ref
