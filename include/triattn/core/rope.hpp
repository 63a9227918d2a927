/// \file triattn/core/rope.hpp
/// \brief Rotary position embedding: pairing styles, inverse frequencies with Hugging Face's
/// scaling rules, rotate and un-rotate.
///
/// A RoPE'd vector is a set of complex bands z_f = x[i_f] + i*x[j_f]. Rotating to position p
/// multiplies each band by a*e^{i p w_f}, where a is `attention_scale` (Hugging Face's
/// `attention_scaling`: 1 except for YaRN). Dims past `rotary_dim` are not rotated.
#pragma once

#include <cmath>
#include <cstdint>

#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"

TRIATTN_NAMESPACE_BEGIN

/// How the dims of a head pair into complex bands.
enum class rope_style : std::uint8_t {
  half,         ///< NeoX / Hugging Face `rotate_half`: band f = (x[f], x[f + R/2])
  interleaved,  ///< GPT-J / original Meta / llama2.c: band f = (x[2f], x[2f + 1])
};

/// Hugging Face `rope_scaling.rope_type`.
enum class rope_scaling_type : std::uint8_t { none, linear, llama3, yarn };

/// Parameters of a scaling rule; only the fields of the chosen `type` are read.
struct rope_scaling {
  rope_scaling_type type = rope_scaling_type::none;
  double factor = 1.0;                   ///< linear, llama3, yarn
  double low_freq_factor = 1.0;          ///< llama3
  double high_freq_factor = 4.0;         ///< llama3
  double original_max_position = 8192;   ///< llama3, yarn (`original_max_position_embeddings`)
  double beta_fast = 32.0;               ///< yarn
  double beta_slow = 1.0;                ///< yarn
  bool truncate = true;                  ///< yarn: round the correction range to whole dims
};

/// Everything needed to rotate or un-rotate one head. Trivially copyable, so kernels take
/// it by value.
struct rope_desc {
  rope_style style = rope_style::half;
  int rotary_dim = 0;        ///< rotated dims (even, <= head_dim); 0 means all of head_dim
  double theta = 10000.0;    ///< base
  rope_scaling scaling{};
  double attention_scale = 1.0;  ///< a: HF's `attention_scaling` (YaRN mscale), multiplies cos and sin
  /// Explicit w_f [rotary_dim/2] that overrides theta and scaling when set: for RoPE variants
  /// given as a table (a stats file's `inv_freq`, LongRoPE). Not owned; must outlive the desc.
  const double* inv_freq_table = nullptr;
};

namespace detail {
TRIATTN_HOST_DEVICE double rope_pi() { return 3.14159265358979323846; }

/// YaRN: the (fractional) dim whose wavelength makes `rotations` turns over the original context.
TRIATTN_HOST_DEVICE double yarn_correction_dim(double rotations, int dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (rotations * 2.0 * rope_pi()))) / (2.0 * std::log(base));
}
}  // namespace detail

/// The rotated dims of a head of `head_dim` dims.
TRIATTN_HOST_DEVICE int rotary_dims(const rope_desc& r, int head_dim) {
  return r.rotary_dim > 0 ? r.rotary_dim : head_dim;
}

/// Inverse frequency w_f of band f of `dim` rotated dims: `inv_freq_table[f]` when given, else
/// Hugging Face's formulas (`_compute_default/linear/llama3/yarn_parameters`), in double.
TRIATTN_HOST_DEVICE double inv_freq(const rope_desc& r, int dim, int f) {
  if (r.inv_freq_table != nullptr) return r.inv_freq_table[f];
  const double base = std::pow(r.theta, -2.0 * f / dim);
  const rope_scaling& s = r.scaling;
  switch (s.type) {
    case rope_scaling_type::none:
      return base;
    case rope_scaling_type::linear:
      return base / s.factor;
    case rope_scaling_type::llama3: {
      const double wavelen = 2.0 * detail::rope_pi() / base;
      const double low_wavelen = s.original_max_position / s.low_freq_factor;
      const double high_wavelen = s.original_max_position / s.high_freq_factor;
      if (wavelen > low_wavelen) return base / s.factor;
      if (wavelen < high_wavelen) return base;
      const double smooth =
          (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      return (1.0 - smooth) * base / s.factor + smooth * base;
    }
    case rope_scaling_type::yarn: {
      double low = detail::yarn_correction_dim(s.beta_fast, dim, r.theta, s.original_max_position);
      double high = detail::yarn_correction_dim(s.beta_slow, dim, r.theta, s.original_max_position);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = low > 0.0 ? low : 0.0;
      high = high < dim - 1 ? high : dim - 1;
      if (low == high) high += 0.001;  // avoid a division by zero, as HF does
      double ramp = (f - low) / (high - low);
      ramp = ramp < 0.0 ? 0.0 : (ramp > 1.0 ? 1.0 : ramp);
      const double extrapolation = 1.0 - ramp;  // weight of the unscaled frequency
      return base / s.factor * (1.0 - extrapolation) + base * extrapolation;
    }
  }
  return base;
}

/// HF's default YaRN attention factor: 0.1 ln(factor) + 1 (1 when factor <= 1).
inline double yarn_attention_scale(double factor) {
  return factor <= 1.0 ? 1.0 : 0.1 * std::log(factor) + 1.0;
}

/// Indices of the two dims of band f of a head with `dim` rotated dims.
TRIATTN_HOST_DEVICE void rope_band_dims(rope_style style, int dim, int f, int& re, int& im) {
  if (style == rope_style::half) {
    re = f;
    im = f + dim / 2;
  } else {
    re = 2 * f;
    im = 2 * f + 1;
  }
}

/// Rotates band (re, im) of `x` by the rotation c = cos(phase) x scale, s = sin(phase) x scale,
/// in double: what `rotate_band` applies, for callers that rotate many heads by one phase.
template <class T>
TRIATTN_HOST_DEVICE void rotate_band_cs(T* x, int re, int im, double c, double s) {
  const double a = x[re], b = x[im];
  // fused on every build (libm's fma without an FMA instruction), so the rotated floats do
  // not depend on -ffp-contract
  x[re] = static_cast<T>(std::fma(a, c, -(b * s)));
  x[im] = static_cast<T>(std::fma(a, s, b * c));
}

/// Rotates band f of `x` by `phase` radians and scales it by `scale`.
template <class T>
TRIATTN_HOST_DEVICE void rotate_band(T* x, int re, int im, double phase, double scale) {
  rotate_band_cs(x, re, im, std::cos(phase) * scale, std::sin(phase) * scale);
}

/// Rotates a head vector `x` [head_dim] from position 0 to position `pos`
/// (what the model does to q and k). Phases are formed in double.
template <class T>
TRIATTN_HOST_DEVICE void rope_rotate(const rope_desc& r, T* x, int head_dim, double pos) {
  const int dim = rotary_dims(r, head_dim);
  for (int f = 0; f < dim / 2; ++f) {
    int re, im;
    rope_band_dims(r.style, dim, f, re, im);
    rotate_band(x, re, im, pos * inv_freq(r, dim, f), r.attention_scale);
  }
}

/// Inverse of `rope_rotate`: back from position `pos` to the pre-RoPE vector.
template <class T>
TRIATTN_HOST_DEVICE void rope_unrotate(const rope_desc& r, T* x, int head_dim, double pos) {
  const int dim = rotary_dims(r, head_dim);
  for (int f = 0; f < dim / 2; ++f) {
    int re, im;
    rope_band_dims(r.style, dim, f, re, im);
    rotate_band(x, re, im, -pos * inv_freq(r, dim, f), 1.0 / r.attention_scale);
  }
}

/// Moves an already rotated vector from position `from` to position `to` (a pure rotation by
/// the difference; the scale a is already applied and stays). Used to re-number positions.
template <class T>
TRIATTN_HOST_DEVICE void rope_shift(const rope_desc& r, T* x, int head_dim, double from, double to) {
  const int dim = rotary_dims(r, head_dim);
  for (int f = 0; f < dim / 2; ++f) {
    int re, im;
    rope_band_dims(r.style, dim, f, re, im);
    rotate_band(x, re, im, (to - from) * inv_freq(r, dim, f), 1.0);
  }
}

/// Checks a description against a head size; throws `triattn::error` naming `api`.
inline void validate_rope(const char* api, const rope_desc& r, int head_dim) {
  TRIATTN_CHECK(head_dim > 0 && head_dim % 2 == 0, api, "head_dim ", head_dim, " must be even and positive");
  const int dim = rotary_dims(r, head_dim);
  TRIATTN_CHECK(dim % 2 == 0 && dim <= head_dim, api, "rotary_dim ", r.rotary_dim,
                " must be even and <= head_dim ", head_dim);
  TRIATTN_CHECK(r.inv_freq_table != nullptr || r.theta > 1.0, api, "rope theta ", r.theta, " must be > 1");
  TRIATTN_CHECK(r.attention_scale > 0.0, api, "rope attention_scale ", r.attention_scale, " must be > 0");
  TRIATTN_CHECK(r.scaling.type == rope_scaling_type::none || r.scaling.factor > 0.0, api,
                "rope scaling factor ", r.scaling.factor, " must be > 0");
}

TRIATTN_NAMESPACE_END
