/// \file triattn/io/safetensors.hpp
/// \brief safetensors files: strict reading and deterministic writing.
///
/// Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON (possibly padded
/// with spaces), then the data buffer. The JSON maps each tensor name to
/// {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data buffer) and may
/// hold "__metadata__": {string: string}. Files are untrusted input: every length and offset
/// is checked before it is used, and every error throws `triattn::error`
/// "<api>: <file>: <problem with its value>".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "triattn/core/dtype.hpp"
#include "triattn/core/error.hpp"
#include "triattn/io/json.hpp"
#include "triattn/io/npy.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace io {

/// One tensor of a parsed file. `data` points into the `safetensors_file` that owns it.
struct safetensors_tensor {
  std::string dtype;  ///< as in the file: "F32", "F64", "F16", "BF16", "I64", "I32", "U8", ...
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;  ///< exactly product(shape) * element size bytes
};

/// One tensor to write. `data` must hold exactly product(shape) * element size bytes.
struct safetensors_entry {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};

namespace detail {

struct safetensors_dtype {
  const char* name;
  std::size_t bytes;
};

/// The dtypes of the reference implementation with whole-byte elements, in its order of
/// increasing alignment: the writer places tensors by descending rank, as the reference does,
/// so every tensor is aligned to its element size and the data buffer has no gaps.
inline constexpr safetensors_dtype safetensors_dtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
    {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};

/// The entry of `name` in `safetensors_dtypes`, or nullptr.
inline const safetensors_dtype* find_safetensors_dtype(std::string_view name) {
  for (const auto& d : safetensors_dtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

/// "BOOL, U8, ..., U64" for messages.
inline std::string safetensors_dtype_list() {
  std::string s;
  for (const auto& d : safetensors_dtypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

/// Reference: files with a larger header are rejected as hostile.
inline constexpr std::uint64_t safetensors_max_header_bytes = 100u << 20;

/// Checks that a (dtype, shape, data size) triple is consistent and returns the dtype.
/// `where` is the message prefix up to the problem ("<file>: tensor 'x': ").
inline const safetensors_dtype& check_tensor(std::string_view dtype, std::span<const std::int64_t> shape,
                                             std::size_t data_bytes, const char* api, const std::string& where) {
  const safetensors_dtype* d = find_safetensors_dtype(dtype);
  TRIATTN_CHECK(d != nullptr, api, where, "dtype '", printable(dtype), "' is not supported (expected ",
                safetensors_dtype_list(), ")");
  for (const std::int64_t dim : shape) {
    TRIATTN_CHECK(dim >= 0, api, where, "shape ", shape_string(shape), " has a negative dimension ", dim);
  }
  const auto need = checked_bytes(shape, d->bytes);
  TRIATTN_CHECK(need.has_value(), api, where, "shape ", shape_string(shape), " of ", d->name,
                " overflows the addressable size");
  TRIATTN_CHECK(*need == data_bytes, api, where, "data holds ", data_bytes, " bytes but shape ", shape_string(shape),
                " of ", d->name, " needs ", *need);
  return *d;
}

/// A JSON value that must be a non-negative integer.
inline std::optional<std::int64_t> non_negative(const json::value& v) {
  if (v.type != json::value_type::integer || v.integer < 0) return std::nullopt;
  return v.integer;
}

}  // namespace detail

/// A parsed safetensors file. It owns the bytes that the tensors' spans point into, so it is
/// move-only: a move keeps the byte buffer (and the spans) in place, a copy would not.
class safetensors_file {
 public:
  /// Parses the bytes of a file; `name` names it in messages.
  static safetensors_file parse(std::vector<std::byte> bytes, const std::string& name) {
    return parse_bytes(std::move(bytes), name, "triattn::io::safetensors_file::parse");
  }

  /// Reads and parses the file at `path` (messages name it as `path.string()`).
  static safetensors_file read(const std::filesystem::path& path) {
    const char* api = "triattn::io::safetensors_file::read";
    return parse_bytes(detail::read_file(path, api), path.string(), api);
  }

  safetensors_file(safetensors_file&&) = default;
  safetensors_file& operator=(safetensors_file&&) = default;
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;
  ~safetensors_file() = default;

  /// The "__metadata__" object; empty when the file has none.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// The tensor called `tensor`, or nullptr.
  const safetensors_tensor* find(std::string_view tensor) const {
    const auto it = tensors_.find(tensor);
    return it == tensors_.end() ? nullptr : &it->second;
  }

  /// The tensor called `tensor`; throws "triattn::io::safetensors_file::get: <file>: no tensor 'x'".
  const safetensors_tensor& get(std::string_view tensor) const {
    const safetensors_tensor* t = find(tensor);
    TRIATTN_CHECK(t != nullptr, "triattn::io::safetensors_file::get", name_, ": no tensor '", detail::printable(tensor),
                  "'");
    return *t;
  }

  /// The tensor names, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& [n, t] : tensors_) out.push_back(n);
    return out;
  }

  /// The file name used in messages.
  const std::string& name() const { return name_; }

 private:
  safetensors_file() = default;

  static safetensors_file parse_bytes(std::vector<std::byte> bytes, const std::string& name, const char* api) {
    safetensors_file f;
    f.name_ = name;
    f.bytes_ = std::move(bytes);
    const std::vector<std::byte>& b = f.bytes_;
    TRIATTN_CHECK(b.size() >= 8, api, name, ": file is ", b.size(), " bytes, too short for the 8-byte header length");
    const auto header_len = detail::load_le<std::uint64_t>(b.data());
    TRIATTN_CHECK(header_len <= detail::safetensors_max_header_bytes, api, name, ": header length ", header_len,
                  " exceeds the limit of ", detail::safetensors_max_header_bytes, " bytes");
    TRIATTN_CHECK(header_len <= b.size() - 8, api, name, ": header length ", header_len, " exceeds the ", b.size() - 8,
                  " bytes after the length field (truncated file?)");
    const auto n = static_cast<std::size_t>(header_len);
    const json::value root = json::parse(std::string_view(reinterpret_cast<const char*>(b.data() + 8), n), name, api);
    TRIATTN_CHECK(root.type == json::value_type::object, api, name, ": the header is a JSON ",
                  json::type_name(root.type), ", expected an object");

    const std::span<const std::byte> buffer(b.data() + 8 + n, b.size() - 8 - n);
    struct extent {
      std::uint64_t begin, end;
      const std::string* name;
    };
    std::vector<extent> extents;
    for (std::size_t i = 0; i < root.keys.size(); ++i) {
      const std::string& key = root.keys[i];
      const json::value& v = root.items[i];
      if (key == "__metadata__") {
        f.metadata_ = parse_metadata(v, api, name);
        continue;
      }
      const std::string where = name + ": tensor '" + detail::printable(key) + "': ";
      auto [tensor, begin, end] = parse_tensor(v, buffer.size(), api, where);
      tensor.data = buffer.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
      const auto it = f.tensors_.emplace(key, std::move(tensor)).first;
      if (end > begin) extents.push_back({begin, end, &it->first});
    }
    // The tensors tile the buffer exactly, as the reference implementation requires: no two
    // share a byte (empty tensors hold none), none leaves a gap, and no byte follows the last.
    std::sort(extents.begin(), extents.end(),
              [](const extent& x, const extent& y) { return x.begin != y.begin ? x.begin < y.begin : x.end < y.end; });
    std::uint64_t covered = 0;
    for (std::size_t i = 0; i < extents.size(); ++i) {
      const extent& c = extents[i];
      if (i > 0) {
        const extent& p = extents[i - 1];
        TRIATTN_CHECK(c.begin >= p.end, api, name, ": tensors '", detail::printable(*p.name), "' [", p.begin, ", ",
                      p.end, "] and '", detail::printable(*c.name), "' [", c.begin, ", ", c.end, "] overlap");
      }
      TRIATTN_CHECK(c.begin == covered, api, name, ": ", c.begin - covered, " bytes before tensor '",
                    detail::printable(*c.name), "' [", c.begin, ", ", c.end, "] belong to no tensor");
      covered = c.end;
    }
    TRIATTN_CHECK(covered == buffer.size(), api, name, ": ", buffer.size() - covered,
                  " bytes follow the last tensor's data");
    return f;
  }

  static std::map<std::string, std::string> parse_metadata(const json::value& v, const char* api,
                                                           const std::string& name) {
    TRIATTN_CHECK(v.type == json::value_type::object, api, name, ": __metadata__ is a JSON ", json::type_name(v.type),
                  ", expected an object of strings");
    std::map<std::string, std::string> out;
    for (std::size_t i = 0; i < v.keys.size(); ++i) {
      TRIATTN_CHECK(v.items[i].type == json::value_type::string, api, name, ": __metadata__ value of '",
                    detail::printable(v.keys[i]), "' is a JSON ", json::type_name(v.items[i].type),
                    ", expected a string");
      out.emplace(v.keys[i], v.items[i].text);
    }
    return out;
  }

  struct parsed_tensor {
    safetensors_tensor tensor;
    std::uint64_t begin, end;
  };

  /// One header entry: exactly dtype, shape and data_offsets, consistent with each other and
  /// inside the data buffer.
  static parsed_tensor parse_tensor(const json::value& v, std::size_t buffer_size, const char* api,
                                    const std::string& where) {
    TRIATTN_CHECK(v.type == json::value_type::object, api, where, "entry is a JSON ", json::type_name(v.type),
                  ", expected an object with dtype, shape and data_offsets");
    for (const std::string& key : v.keys) {
      TRIATTN_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", api, where, "unknown field '",
                    detail::printable(key), "' (expected dtype, shape and data_offsets)");
    }
    const auto field = [&](const char* key, json::value_type type) -> const json::value& {
      const json::value* f = v.find(key);
      TRIATTN_CHECK(f != nullptr, api, where, "missing field '", key, "'");
      TRIATTN_CHECK(f->type == type, api, where, "field '", key, "' is a JSON ", json::type_name(f->type),
                    ", expected ", json::type_name(type));
      return *f;
    };
    parsed_tensor p;
    p.tensor.dtype = field("dtype", json::value_type::string).text;
    const json::value& shape = field("shape", json::value_type::array);
    for (std::size_t i = 0; i < shape.items.size(); ++i) {
      const auto d = detail::non_negative(shape.items[i]);
      TRIATTN_CHECK(d.has_value(), api, where, "shape element ", i, " is ",
                    shape.items[i].type == json::value_type::integer ? std::to_string(shape.items[i].integer)
                                                                     : json::type_name(shape.items[i].type),
                    ", expected a non-negative integer");
      p.tensor.shape.push_back(*d);
    }
    const json::value& offsets = field("data_offsets", json::value_type::array);
    const auto begin = offsets.items.size() == 2 ? detail::non_negative(offsets.items[0]) : std::nullopt;
    const auto end = offsets.items.size() == 2 ? detail::non_negative(offsets.items[1]) : std::nullopt;
    TRIATTN_CHECK(begin && end, api, where, "data_offsets must be [begin, end] with two non-negative integers");
    p.begin = static_cast<std::uint64_t>(*begin);
    p.end = static_cast<std::uint64_t>(*end);
    TRIATTN_CHECK(p.begin <= p.end, api, where, "data_offsets [", p.begin, ", ", p.end, "] begin > end");
    TRIATTN_CHECK(p.end <= buffer_size, api, where, "data_offsets [", p.begin, ", ", p.end,
                  "] end exceeds the data buffer of ", buffer_size, " bytes (truncated file?)");
    detail::check_tensor(p.tensor.dtype, p.tensor.shape, static_cast<std::size_t>(p.end - p.begin), api, where);
    return p;
  }

  std::string name_;
  std::vector<std::byte> bytes_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, safetensors_tensor, std::less<>> tensors_;
};

namespace detail {

inline std::vector<std::byte> serialize_safetensors(std::span<const safetensors_entry> tensors,
                                                    const std::map<std::string, std::string>& metadata, const char* api,
                                                    const std::string& name) {
  const std::string prefix = file_prefix(name);
  // Order in the buffer: descending dtype rank, then name. Deterministic, gap-free and
  // aligned (see safetensors_dtypes).
  std::vector<std::pair<std::size_t, const safetensors_entry*>> order;  // (rank, entry)
  std::set<std::string_view> names;
  for (const safetensors_entry& e : tensors) {
    const std::string where = prefix + "tensor '" + printable(e.name) + "': ";
    TRIATTN_CHECK(json::is_valid_utf8(e.name), api, where, "the name is not valid UTF-8");
    TRIATTN_CHECK(e.name != "__metadata__", api, where, "the name is reserved for the metadata");
    TRIATTN_CHECK(names.insert(e.name).second, api, where, "the name appears twice");
    const safetensors_dtype& d = check_tensor(e.dtype, e.shape, e.data.size(), api, where);
    order.emplace_back(static_cast<std::size_t>(&d - safetensors_dtypes), &e);
  }
  for (const auto& [key, value] : metadata) {
    TRIATTN_CHECK(json::is_valid_utf8(key) && json::is_valid_utf8(value), api, prefix, "__metadata__ entry '",
                  printable(key), "' is not valid UTF-8");
  }
  std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first > y.first : x.second->name < y.second->name;
  });

  // The same compact JSON as the reference (serde_json): metadata first, then the tensors in
  // buffer order; padded with spaces so the data buffer starts 8-byte aligned.
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (auto it = metadata.begin(); it != metadata.end(); ++it) {
      if (it != metadata.begin()) header += ',';
      json::append_string(header, it->first);
      header += ':';
      json::append_string(header, it->second);
    }
    header += '}';
  }
  std::uint64_t offset = 0;
  for (const auto& [rank, e] : order) {
    if (header.size() > 1) header += ',';
    json::append_string(header, e->name);
    header += ":{\"dtype\":\"";
    header += e->dtype;
    header += "\",\"shape\":[";
    for (std::size_t i = 0; i < e->shape.size(); ++i) {
      if (i > 0) header += ',';
      header += std::to_string(e->shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + ',';
    offset += e->data.size();
    header += std::to_string(offset) + "]}";
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');

  std::vector<std::byte> out;
  out.reserve(8 + header.size() + static_cast<std::size_t>(offset));
  append_le(out, header.size(), 8);
  for (const char c : header) out.push_back(static_cast<std::byte>(c));
  for (const auto& [rank, e] : order) out.insert(out.end(), e->data.begin(), e->data.end());
  return out;
}

/// The dtype of `t` after checking that its data matches its shape (a hand-built tensor may not).
inline const safetensors_dtype& checked_tensor(const safetensors_tensor& t, const char* api, const std::string& what) {
  return check_tensor(t.dtype, t.shape, t.data.size(), api, what + ": ");
}

}  // namespace detail

/// The bytes of a safetensors file holding `tensors` and, when non-empty, `metadata`.
/// Deterministic: the same input gives the same bytes. Tensors are laid out gap-free by
/// descending element alignment, then by name (as the reference implementation does), so
/// each is aligned to its element size; the header is padded with spaces to a multiple of 8.
inline std::vector<std::byte> serialize_safetensors(std::span<const safetensors_entry> tensors,
                                                    const std::map<std::string, std::string>& metadata) {
  return detail::serialize_safetensors(tensors, metadata, "triattn::io::serialize_safetensors", "");
}

/// Writes `serialize_safetensors(tensors, metadata)` to `path` through a temporary file in
/// the same folder and a rename, so a failed write leaves no partial file.
inline void write_safetensors(const std::filesystem::path& path, std::span<const safetensors_entry> tensors,
                              const std::map<std::string, std::string>& metadata) {
  const char* api = "triattn::io::write_safetensors";
  detail::write_file_atomically(path, detail::serialize_safetensors(tensors, metadata, api, path.string()), api);
}

/// The elements of an F16, BF16, F32 or F64 tensor as float32 (F64 rounded to nearest).
/// `what` names the tensor in messages (e.g. "stats.safetensors: q_mean_real").
inline std::vector<float> tensor_to_float(const safetensors_tensor& t, const std::string& what) {
  const char* api = "triattn::io::tensor_to_float";
  const std::string_view d = detail::checked_tensor(t, api, what).name;
  if (d == "F16") return detail::decode_elements<float, std::uint16_t>(t.data, half_bits_to_float);
  if (d == "BF16") return detail::decode_elements<float, std::uint16_t>(t.data, bf16_bits_to_float);
  if (d == "F32") return detail::decode_elements<float, float>(t.data, [](float x) { return x; });
  TRIATTN_CHECK(d == "F64", api, what, ": dtype ", d, " is not a float type (expected F16, BF16, F32 or F64)");
  return detail::decode_elements<float, double>(t.data, [](double x) { return static_cast<float>(x); });
}

/// The elements of an F32 or F64 tensor as float64 (exact). `what` names the tensor in messages.
inline std::vector<double> tensor_to_double(const safetensors_tensor& t, const std::string& what) {
  const char* api = "triattn::io::tensor_to_double";
  const std::string_view d = detail::checked_tensor(t, api, what).name;
  if (d == "F32") return detail::decode_elements<double, float>(t.data, [](float x) { return double{x}; });
  TRIATTN_CHECK(d == "F64", api, what, ": dtype ", d, " is not F32 or F64");
  return detail::decode_elements<double, double>(t.data, [](double x) { return x; });
}

}  // namespace io
TRIATTN_NAMESPACE_END
