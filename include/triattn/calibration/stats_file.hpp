/// \file triattn/calibration/stats_file.hpp
/// \brief The `triattn.stats.v1` file: `query_stats` as safetensors (little-endian).
///
/// | tensor | dtype | shape |
/// | --- | --- | --- |
/// | `q_mean_real`, `q_mean_imag`, `q_abs_mean` | F32 | [num_layers, num_q_heads, head_dim/2] |
/// | `inv_freq` | F32 or F64 (written as F64) | [head_dim/2] |
///
/// `__metadata__`: `format` = `triattn.stats.v1`; `rope_style` = `half` | `interleaved`;
/// `num_kv_heads` (decimal); `attention_scale` (decimal, 1 when absent). Every other key
/// (`model`, `num_tokens`, `num_traces`, `source`, ...) is free-form and lands in
/// `query_stats::info`. A save/load round trip is exact.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "triattn/calibration/query_stats.hpp"
#include "triattn/core/config.hpp"
#include "triattn/core/error.hpp"
#include "triattn/core/rope.hpp"
#include "triattn/io/safetensors.hpp"

TRIATTN_NAMESPACE_BEGIN

/// The value of the `format` metadata key.
inline constexpr std::string_view stats_format = "triattn.stats.v1";

namespace detail {

/// The metadata keys the format defines; `query_stats::info` holds all others.
inline constexpr std::string_view stats_reserved_keys[] = {"format", "rope_style", "num_kv_heads", "attention_scale"};
inline constexpr std::string_view stats_q_tensors[] = {"q_mean_real", "q_mean_imag", "q_abs_mean"};

/// Parses all of `text` as a number with `std::from_chars`; false on anything else
/// (sign prefixes, spaces, trailing characters, overflow).
template <class T>
bool parse_full(std::string_view text, T& out) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return !text.empty() && ec == std::errc() && ptr == end;
}

/// `query_stats` from a parsed safetensors file; `api` and `f.name()` prefix every error.
inline query_stats stats_from_safetensors(const char* api, const io::safetensors_file& f) {
  const std::string& file = f.name();
  const auto& meta = f.metadata();
  const auto meta_value = [&](std::string_view key) -> const std::string* {
    const auto it = meta.find(std::string(key));
    return it == meta.end() ? nullptr : &it->second;
  };

  // Metadata.
  const std::string* format = meta_value("format");
  TRIATTN_CHECK(format != nullptr, api, file, ": metadata format is missing (not a ", stats_format, " file?)");
  TRIATTN_CHECK(*format == stats_format, api, file, ": metadata format \"", io::detail::printable(*format),
                "\" is not ", stats_format);
  query_stats s;
  const std::string* style = meta_value("rope_style");
  TRIATTN_CHECK(style != nullptr, api, file, ": metadata rope_style is missing");
  TRIATTN_CHECK(*style == "half" || *style == "interleaved", api, file, ": metadata rope_style \"",
                io::detail::printable(*style), "\" is not half or interleaved");
  s.style = *style == "half" ? rope_style::half : rope_style::interleaved;
  const std::string* kv_heads = meta_value("num_kv_heads");
  TRIATTN_CHECK(kv_heads != nullptr, api, file, ": metadata num_kv_heads is missing");
  TRIATTN_CHECK(parse_full(*kv_heads, s.num_kv_heads) && s.num_kv_heads > 0, api, file, ": metadata num_kv_heads \"",
                io::detail::printable(*kv_heads), "\" is not a positive decimal");
  if (const std::string* scale = meta_value("attention_scale")) {
    TRIATTN_CHECK(parse_full(*scale, s.attention_scale) && std::isfinite(s.attention_scale) && s.attention_scale > 0.0,
                  api, file, ": metadata attention_scale \"", io::detail::printable(*scale),
                  "\" is not a positive decimal");
  }
  for (const auto& [key, value] : meta) {
    bool reserved = false;
    for (const std::string_view r : stats_reserved_keys) reserved = reserved || key == r;
    if (!reserved) s.info[key] = value;
  }

  // Tensors: nothing but the four of the format.
  for (const std::string& name : f.names()) {
    bool known = name == "inv_freq";
    for (const std::string_view t : stats_q_tensors) known = known || name == t;
    TRIATTN_CHECK(known, api, file, ": unexpected tensor ", io::detail::printable(name), " (", stats_format,
                  " holds q_mean_real, q_mean_imag, q_abs_mean, inv_freq)");
  }
  const auto tensor = [&](std::string_view name) -> const io::safetensors_tensor& {
    const io::safetensors_tensor* t = f.find(name);
    TRIATTN_CHECK(t != nullptr, api, file, ": tensor ", name, " is missing");
    return *t;
  };
  // q_mean_real fixes the shape; the others must match it.
  const io::safetensors_tensor& first = tensor(stats_q_tensors[0]);
  const std::vector<std::int64_t>& shape = first.shape;
  constexpr std::int64_t max_dim = std::numeric_limits<int>::max() / 2;
  TRIATTN_CHECK(shape.size() == 3 && shape[0] > 0 && shape[1] > 0 && shape[2] > 0 && shape[0] <= max_dim &&
                    shape[1] <= max_dim && shape[2] <= max_dim,
                api, file, ": ", stats_q_tensors[0], " has shape ", io::detail::shape_string(shape),
                ", expected [num_layers, num_q_heads, head_dim/2], all >= 1");
  for (const std::string_view name : stats_q_tensors) {
    const io::safetensors_tensor& t = tensor(name);
    TRIATTN_CHECK(t.dtype == "F32", api, file, ": ", name, " has dtype ", t.dtype, ", expected F32");
    TRIATTN_CHECK(t.shape == shape, api, file, ": ", name, " has shape ", io::detail::shape_string(t.shape),
                  ", expected ", io::detail::shape_string(shape), " (from ", stats_q_tensors[0], ")");
  }
  const io::safetensors_tensor& freq = tensor("inv_freq");
  TRIATTN_CHECK(freq.dtype == "F32" || freq.dtype == "F64", api, file, ": inv_freq has dtype ", freq.dtype,
                ", expected F32 or F64");
  TRIATTN_CHECK(freq.shape == std::vector<std::int64_t>{shape[2]}, api, file, ": inv_freq has shape ",
                io::detail::shape_string(freq.shape), ", expected ",
                io::detail::shape_string(std::vector<std::int64_t>{shape[2]}), " (from ", stats_q_tensors[0], ")");

  s.num_layers = static_cast<int>(shape[0]);
  s.num_q_heads = static_cast<int>(shape[1]);
  s.head_dim = static_cast<int>(2 * shape[2]);
  TRIATTN_CHECK(s.num_q_heads % s.num_kv_heads == 0, api, file, ": num_q_heads ", s.num_q_heads, " (from ",
                stats_q_tensors[0], ") is not a multiple of metadata num_kv_heads ", s.num_kv_heads);
  s.q_mean_real = io::tensor_to_float(first, "q_mean_real");
  s.q_mean_imag = io::tensor_to_float(tensor("q_mean_imag"), "q_mean_imag");
  s.q_abs_mean = io::tensor_to_float(tensor("q_abs_mean"), "q_abs_mean");
  s.inv_freq = io::tensor_to_double(freq, "inv_freq");
  // validate()'s messages name the field; prefix the file too, as every other message here does.
  const std::string where = std::string(api) + ": " + file;
  s.validate(where.c_str());
  return s;
}

/// What a stats file holds: its metadata and tensor entries (which view `s`'s vectors).
struct stats_contents {
  std::map<std::string, std::string> metadata;
  std::vector<io::safetensors_entry> entries;
};

/// The file contents of `s`, after `s.validate(api)`.
inline stats_contents stats_contents_of(const char* api, const query_stats& s) {
  s.validate(api);
  for (const std::string_view r : stats_reserved_keys)
    TRIATTN_CHECK(!s.info.contains(std::string(r)), api, "info key ", r, " is reserved for the format");
  stats_contents c;
  c.metadata.insert(s.info.begin(), s.info.end());
  c.metadata["format"] = std::string(stats_format);
  c.metadata["rope_style"] = s.style == rope_style::half ? "half" : "interleaved";
  c.metadata["num_kv_heads"] = std::to_string(s.num_kv_heads);
  // Shortest representation that reads back as the same double.
  char buf[64];
  const auto written = std::to_chars(buf, buf + sizeof buf, s.attention_scale);
  c.metadata["attention_scale"] = std::string(buf, written.ptr);

  const std::vector<std::int64_t> q_shape{s.num_layers, s.num_q_heads, s.num_bands()};
  // Host memory is the file layout: triattn/io asserts a little-endian host.
  const auto bytes_of = [](const auto& v) { return std::as_bytes(std::span(v)); };
  c.entries = {
      {"inv_freq", "F64", {s.num_bands()}, bytes_of(s.inv_freq)},
      {"q_abs_mean", "F32", q_shape, bytes_of(s.q_abs_mean)},
      {"q_mean_imag", "F32", q_shape, bytes_of(s.q_mean_imag)},
      {"q_mean_real", "F32", q_shape, bytes_of(s.q_mean_real)},
  };
  return c;
}

}  // namespace detail

/// Parses a `triattn.stats.v1` file held in memory; `name` identifies it in errors. Every
/// malformed field throws `triattn::error` naming `triattn::parse_stats`, `name` and the field.
inline query_stats parse_stats(std::vector<std::byte> bytes, const std::string& name) {
  return detail::stats_from_safetensors("triattn::parse_stats", io::safetensors_file::parse(std::move(bytes), name));
}

/// Reads a `triattn.stats.v1` file. Every malformed field throws `triattn::error` naming
/// `triattn::load_stats`, the file and the field, e.g.
/// `triattn::load_stats: S.safetensors: q_abs_mean has shape [36, 32, 63], expected [36, 32, 64] (from q_mean_real)`.
inline query_stats load_stats(const std::filesystem::path& path) {
  return detail::stats_from_safetensors("triattn::load_stats", io::safetensors_file::read(path));
}

/// The file contents `save_stats` writes (after `query_stats::validate`).
inline std::vector<std::byte> serialize_stats(const query_stats& s) {
  const detail::stats_contents c = detail::stats_contents_of("triattn::serialize_stats", s);
  return io::serialize_safetensors(c.entries, c.metadata);
}

/// Writes `s` as a `triattn.stats.v1` file (inv_freq as F64, so a reload is bit-identical).
/// `s.info` becomes free-form metadata; it may not use the format's own keys. An invalid `s`
/// throws before the file is touched.
inline void save_stats(const std::filesystem::path& path, const query_stats& s) {
  const detail::stats_contents c = detail::stats_contents_of("triattn::save_stats", s);
  io::write_safetensors(path, c.entries, c.metadata);
}

TRIATTN_NAMESPACE_END
