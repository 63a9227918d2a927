/// \file triattn/io/npy.hpp
/// \brief NumPy `.npy` files: strict reading (versions 1.0, 2.0, 3.0) and writing (1.0,
/// byte-identical to `np.save`), little-endian and C order only.
///
/// Files are untrusted input: every length is checked before it is used, the header is
/// parsed by a bounded parser for the one Python dict literal numpy writes, and the data
/// must have exactly the size the header announces. Every error throws `triattn::error`
/// "<api>: <file>: <problem with its value>".
///
/// The `detail` helpers at the end of this header (little-endian loads, overflow-checked
/// sizes, whole-file reads, atomic writes) are shared with `safetensors.hpp`.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#endif

#include "triattn/core/dtype.hpp"
#include "triattn/core/error.hpp"

// Element data is copied with memcpy, which is only the little-endian file layout on a
// little-endian host (every platform triattn targets).
static_assert(std::endian::native == std::endian::little, "triattn/io assumes a little-endian host");

TRIATTN_NAMESPACE_BEGIN
namespace io {

/// Element types of a `.npy` file: '<f2', '<f4', '<f8', '<i4', '<i8'.
enum class element_kind : std::uint8_t { f16, f32, f64, i32, i64 };

/// Size of one element in bytes (0 for a value outside the enum).
inline std::size_t element_bytes(element_kind k) {
  switch (k) {
    case element_kind::f16:
      return 2;
    case element_kind::f32:
      return 4;
    case element_kind::f64:
      return 8;
    case element_kind::i32:
      return 4;
    case element_kind::i64:
      return 8;
  }
  return 0;
}

/// Name for messages: "float16", "float32", "float64", "int32", "int64".
inline const char* element_kind_name(element_kind k) {
  switch (k) {
    case element_kind::f16:
      return "float16";
    case element_kind::f32:
      return "float32";
    case element_kind::f64:
      return "float64";
    case element_kind::i32:
      return "int32";
    case element_kind::i64:
      return "int64";
  }
  return "?";
}

namespace detail {

/// The numpy `descr` of a kind: "<f2", ..., "<i8".
inline const char* npy_descr(element_kind k) {
  switch (k) {
    case element_kind::f16:
      return "<f2";
    case element_kind::f32:
      return "<f4";
    case element_kind::f64:
      return "<f8";
    case element_kind::i32:
      return "<i4";
    case element_kind::i64:
      return "<i8";
  }
  return "?";
}

inline constexpr std::array<element_kind, 5> all_element_kinds = {
    element_kind::f16, element_kind::f32, element_kind::f64, element_kind::i32, element_kind::i64};

/// "<name>: " for messages, or nothing when there is no file (in-memory serialisation).
inline std::string file_prefix(const std::string& name) { return name.empty() ? std::string() : name + ": "; }

/// Unsigned little-endian integer at `p` (the caller has checked that sizeof(T) bytes exist).
template <class T>
T load_le(const std::byte* p) {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v = static_cast<T>(v | (std::to_integer<T>(p[i]) << (8 * i)));
  return v;
}

/// Appends the `n` low bytes of `v`, little-endian.
inline void append_le(std::vector<std::byte>& out, std::uint64_t v, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffu));
}

/// a * b, or nullopt when it overflows.
inline std::optional<std::uint64_t> checked_mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return std::nullopt;
  return a * b;
}

/// Bytes of a tensor of `shape` (non-negative dims) with `elem`-byte elements, or nullopt when
/// the element count exceeds int64 or the byte count exceeds uint64. Multiplies left to right,
/// as numpy and the safetensors reference do.
inline std::optional<std::uint64_t> checked_bytes(std::span<const std::int64_t> shape, std::uint64_t elem) {
  std::uint64_t count = 1;
  for (const std::int64_t d : shape) {
    const auto next = checked_mul(count, static_cast<std::uint64_t>(d));
    if (!next || *next > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    count = *next;
  }
  return checked_mul(count, elem);
}

/// "[2, 8, 256, 128]"; with `wildcard`, -1 prints as "*" (any size). A shape of more than 8
/// dims prints its first 8 and their count: a message stays one short line whatever a file
/// declares (a hostile safetensors shape may hold a million dims).
inline std::string shape_string(std::span<const std::int64_t> shape, bool wildcard = false) {
  constexpr std::size_t max_dims = 8;
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i == max_dims) {
      os << ", ... (" << shape.size() << " dims)";
      break;
    }
    if (i > 0) os << ", ";
    if (wildcard && shape[i] == -1) {
      os << '*';
    } else {
      os << shape[i];
    }
  }
  os << ']';
  return os.str();
}

/// An untrusted string made safe for a terminal line: control bytes (C0, DEL, and the C1
/// controls U+0080..U+009F, which start escape sequences too) as \xNN, cut after `max_len`
/// bytes (at a UTF-8 boundary; 80 for messages, npos: whole).
inline std::string printable(std::string_view s, std::size_t max_len = 80) {
  static constexpr char hex[] = "0123456789abcdef";
  std::size_t len = std::min(s.size(), max_len);
  while (len < s.size() && len > 0 && (static_cast<unsigned char>(s[len]) & 0xc0) == 0x80) --len;
  std::string out;
  const auto escape = [&](unsigned char u) {
    out += "\\x";
    out += hex[u >> 4];
    out += hex[u & 0xf];
  };
  for (std::size_t i = 0; i < len; ++i) {
    const auto u = static_cast<unsigned char>(s[i]);
    const auto next = i + 1 < len ? static_cast<unsigned char>(s[i + 1]) : 0u;
    if (u == 0xc2 && next >= 0x80 && next <= 0x9f) {  // C1 as UTF-8
      escape(u);
      escape(static_cast<unsigned char>(next));
      ++i;
    } else if (u < 0x20 || u == 0x7f) {
      escape(u);
    } else {
      out += s[i];
    }
  }
  if (len < s.size()) out += "...";
  return out;
}

/// Decodes `data` as consecutive `Stored` values (memcpy: no alignment needed) into `Out`.
template <class Out, class Stored, class Decode>
std::vector<Out> decode_elements(std::span<const std::byte> data, Decode decode) {
  std::vector<Out> out(data.size() / sizeof(Stored));
  for (std::size_t i = 0; i < out.size(); ++i) {
    Stored s;
    std::memcpy(&s, data.data() + i * sizeof(Stored), sizeof(Stored));
    out[i] = decode(s);
  }
  return out;
}

/// The reason of the last failed C/C++ I/O call, for messages.
inline std::string errno_text(int err) { return err != 0 ? std::generic_category().message(err) : "I/O error"; }

/// The whole file at `path`.
inline std::vector<std::byte> read_file(const std::filesystem::path& path, const char* api) {
  const std::string name = path.string();
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  TRIATTN_CHECK(!ec, api, name, ": cannot read: ", ec.message());
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  TRIATTN_CHECK(in.is_open(), api, name, ": cannot open: ", errno_text(errno));
  std::vector<std::byte> bytes(static_cast<std::size_t>(size));
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size));
  TRIATTN_CHECK(static_cast<std::uintmax_t>(in.gcount()) == size, api, name, ": read ", in.gcount(), " of ", size,
                " bytes");
  return bytes;
}

/// Throws naming `api` and `path` unless `path` is a regular file or does not exist: outputs
/// are written by a rename, which would replace a device, a FIFO, a socket, a folder or a
/// symbolic link. Tools call it before their work, so a bad output path costs nothing.
inline void check_output_path(const std::filesystem::path& path, const char* api) {
  const std::string name = path.string();
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::symlink_status(path, ec);
  if (ec || !std::filesystem::exists(st)) return;
  TRIATTN_CHECK(!std::filesystem::is_symlink(st), api, name,
                ": is a symbolic link: the output is written by a rename, which would replace the link");
  TRIATTN_CHECK(std::filesystem::is_regular_file(st), api, name,
                ": is not a regular file (a device, a FIFO, a socket or a folder): the output is written by a "
                "rename, which would replace it");
}

/// Writes `bytes` to a temporary file next to `path`, flushes it to the device (fsync), then
/// renames it over `path` and flushes the folder: readers never see a half-written file, a
/// failed write leaves no file behind, and after a power loss the file is the old one or the
/// new one, never an empty one. `path` must be a regular file or not exist: a rename would
/// replace a device, a FIFO or a symbolic link (`--out /dev/null` as root would replace the
/// system's /dev/null), so those are refused before anything is written.
inline void write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes,
                                  const char* api) {
  const std::string name = path.string();
  check_output_path(path, api);
  std::random_device rd;
  std::ostringstream suffix;
  suffix << ".tmp." << std::hex << rd() << rd();  // unique among concurrent writers
  std::filesystem::path tmp = path;
  tmp += suffix.str();
  std::error_code ignored;
#if defined(__unix__) || defined(__APPLE__)
  {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    TRIATTN_CHECK(fd >= 0, api, name, ": cannot create ", tmp.string(), ": ", errno_text(errno));
    std::size_t done = 0;
    int err = 0;
    while (done < bytes.size() && err == 0) {
      const ::ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n < 0 && errno != EINTR) {
        err = errno;
      } else if (n == 0) {
        err = EIO;  // no progress and no error: do not spin
      }
    }
    if (err == 0 && ::fsync(fd) != 0) err = errno;
    if (::close(fd) != 0 && err == 0) err = errno;
    if (err != 0) {
      std::filesystem::remove(tmp, ignored);
      ::TRIATTN_NAMESPACE::detail::fail(api, name, ": cannot write ", tmp.string(), ": ", errno_text(err));
    }
  }
#else
  {
    errno = 0;
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TRIATTN_CHECK(out.is_open(), api, name, ": cannot create ", tmp.string(), ": ", errno_text(errno));
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      const int err = errno;
      std::filesystem::remove(tmp, ignored);
      ::TRIATTN_NAMESPACE::detail::fail(api, name, ": cannot write ", tmp.string(), ": ", errno_text(err));
    }
  }
#endif
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ignored);
    ::TRIATTN_NAMESPACE::detail::fail(api, name, ": cannot rename ", tmp.string(), " to it: ", ec.message());
  }
#if defined(__unix__) || defined(__APPLE__)
  // The rename itself is durable once the folder is flushed.
  const std::filesystem::path folder = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  if (const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
#endif
}

/// numpy's NPY_MAXDIMS (numpy 2); it also keeps every header we write within version 1.0.
inline constexpr std::size_t npy_max_dims = 64;
/// Headers longer than this are rejected before they are parsed.
inline constexpr std::size_t npy_max_header_bytes = std::size_t{1} << 20;

/// The header dict of a .npy file.
struct npy_header {
  std::string descr;
  bool fortran_order = false;
  std::vector<std::int64_t> shape;
};

/// Parser for the one Python literal numpy writes: {'descr': '<f4', 'fortran_order': False,
/// 'shape': (2, 3), } with the keys in any order, ' or " quotes, optional trailing commas and
/// any whitespace. Every access is bounds-checked through at_end() / peek().
class npy_header_parser {
 public:
  npy_header_parser(std::string_view text, const char* api, const std::string& name)
      : text_(text), api_(api), name_(name) {}

  npy_header run() {
    npy_header h;
    bool seen[3] = {false, false, false};  // descr, fortran_order, shape
    skip_ws();
    expect('{');
    while (true) {
      skip_ws();
      if (!at_end() && peek() == '}') break;  // empty dict or a trailing comma
      const std::size_t key_pos = pos_;
      const std::string key = quoted();
      skip_ws();
      expect(':');
      skip_ws();
      int which = 0;
      if (key == "descr") {
        which = 0;
        h.descr = quoted();
      } else if (key == "fortran_order") {
        which = 1;
        h.fortran_order = boolean();
      } else if (key == "shape") {
        which = 2;
        h.shape = shape();
      } else {
        pos_ = key_pos;
        fail("unknown key '", printable(key), "' (expected 'descr', 'fortran_order' and 'shape')");
      }
      if (seen[which]) {
        pos_ = key_pos;
        fail("duplicate key '", key, "'");
      }
      seen[which] = true;
      skip_ws();
      if (!at_end() && peek() == ',') {
        ++pos_;
        continue;
      }
      if (at_end() || peek() != '}') fail("expected ',' or '}', found ", describe());
      break;
    }
    ++pos_;  // the '}'
    skip_ws();
    if (!at_end()) fail("unexpected ", describe(), " after the dict");
    const char* keys[3] = {"descr", "fortran_order", "shape"};
    for (int i = 0; i < 3; ++i) {
      TRIATTN_CHECK(seen[i], api_, name_, ": header has no '", keys[i], "' key");
    }
    return h;
  }

 private:
  template <class... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    ::TRIATTN_NAMESPACE::detail::fail(api_, name_, ": malformed header at byte ", pos_, ": ", parts...);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  /// The next byte for messages: 'c' when printable ASCII, else its hex value.
  std::string describe() const {
    if (at_end()) return "end of header";
    static constexpr char hex[] = "0123456789abcdef";
    const auto c = static_cast<unsigned char>(peek());
    if (c >= 0x20 && c < 0x7f) return std::string("'") + peek() + "'";
    return std::string("byte 0x") + hex[c >> 4] + hex[c & 0xf];
  }

  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }

  void expect(char c) {
    if (at_end() || peek() != c) fail("expected '", c, "', found ", describe());
    ++pos_;
  }

  /// A '...' or "..." string of printable ASCII without escapes (all numpy writes).
  std::string quoted() {
    if (at_end() || (peek() != '\'' && peek() != '"')) fail("expected a quoted string, found ", describe());
    const char quote = peek();
    const std::size_t start = ++pos_;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = peek();
      if (c == quote) break;
      if (c == '\\') fail("escape sequences are not supported");
      const auto u = static_cast<unsigned char>(c);
      if (u < 0x20 || u >= 0x7f) fail("unexpected ", describe(), " in a string");
      ++pos_;
    }
    std::string s(text_.substr(start, pos_ - start));
    ++pos_;
    return s;
  }

  bool boolean() {
    for (const bool b : {true, false}) {
      const std::string_view word = b ? "True" : "False";
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return b;
      }
    }
    fail("fortran_order must be True or False, found ", describe());
  }

  std::int64_t dimension() {
    const std::size_t start = pos_;
    const bool negative = !at_end() && peek() == '-';
    if (negative) ++pos_;
    if (at_end() || peek() < '0' || peek() > '9') fail("expected a dimension, found ", describe());
    if (peek() == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' && text_[pos_ + 1] <= '9') {
      fail("leading zero in a dimension");
    }
    const std::size_t digits_start = pos_;
    while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
    const std::string_view digits = text_.substr(digits_start, pos_ - digits_start);
    std::int64_t v = 0;
    if (std::from_chars(digits.data(), digits.data() + digits.size(), v).ec != std::errc{}) {
      pos_ = start;
      fail("dimension ", printable(digits), " does not fit in int64");
    }
    if (negative) {
      pos_ = start;
      fail("negative dimension -", v, " in the shape");
    }
    return v;
  }

  /// "()", "(3,)", "(2, 3)", "(2, 3,)"; "(3)" is an int in Python, not a tuple.
  std::vector<std::int64_t> shape() {
    std::vector<std::int64_t> dims;
    expect('(');
    skip_ws();
    if (!at_end() && peek() == ')') {
      ++pos_;
      return dims;
    }
    while (true) {
      if (dims.size() == npy_max_dims) fail("more than ", npy_max_dims, " dimensions");
      dims.push_back(dimension());
      skip_ws();
      if (!at_end() && peek() == ',') {
        ++pos_;
        skip_ws();
        if (!at_end() && peek() == ')') break;
        continue;
      }
      if (!at_end() && peek() == ')') {
        if (dims.size() == 1) fail("shape (", dims[0], ") is not a tuple: a 1-d shape needs a trailing comma");
        break;
      }
      fail("expected ',' or ')' in the shape, found ", describe());
    }
    ++pos_;  // the ')'
    return dims;
  }

  std::string_view text_;
  const char* api_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

}  // namespace detail

/// An array read from a `.npy` file.
struct npy_array {
  element_kind kind = element_kind::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;  ///< C order, little-endian, exactly size() * element_bytes(kind) bytes

  /// Number of elements: the product of `shape` (1 for a 0-d array).
  std::int64_t size() const {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) n *= d;
    return n;
  }

  /// The elements as float32 (f16 exactly, f64 rounded to nearest). Throws for integer kinds.
  std::vector<float> to_float() const {
    const char* api = "triattn::io::npy_array::to_float";
    check_data(api);
    switch (kind) {
      case element_kind::f16:
        return detail::decode_elements<float, std::uint16_t>(data, half_bits_to_float);
      case element_kind::f32:
        return detail::decode_elements<float, float>(data, [](float x) { return x; });
      case element_kind::f64:
        return detail::decode_elements<float, double>(data, [](double x) { return static_cast<float>(x); });
      default:
        break;
    }
    ::TRIATTN_NAMESPACE::detail::fail(api, "the array holds ", element_kind_name(kind),
                                      ", not floats (expected float16, float32 or float64)");
  }

  /// The elements as int64. Throws for float kinds.
  std::vector<std::int64_t> to_int64() const {
    const char* api = "triattn::io::npy_array::to_int64";
    check_data(api);
    switch (kind) {
      case element_kind::i32:
        return detail::decode_elements<std::int64_t, std::int32_t>(data,
                                                                   [](std::int32_t x) { return std::int64_t{x}; });
      case element_kind::i64:
        return detail::decode_elements<std::int64_t, std::int64_t>(data, [](std::int64_t x) { return x; });
      default:
        break;
    }
    ::TRIATTN_NAMESPACE::detail::fail(api, "the array holds ", element_kind_name(kind),
                                      ", not integers (expected int32 or int64)");
  }

 private:
  /// A hand-built array may be inconsistent; never decode past `data`.
  void check_data(const char* api) const {
    const auto bytes = detail::checked_bytes(shape, element_bytes(kind));
    TRIATTN_CHECK(bytes && *bytes == data.size(), api, "data holds ", data.size(), " bytes but shape ",
                  detail::shape_string(shape), " of ", element_kind_name(kind), " needs ",
                  bytes ? std::to_string(*bytes) : std::string("an impossible size"));
  }
};

namespace detail {

inline npy_array parse_npy(std::span<const std::byte> bytes, const std::string& name, const char* api) {
  static constexpr unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  const std::size_t size = bytes.size();
  TRIATTN_CHECK(size >= 8, api, name, ": file is ", size, " bytes, too short for a .npy header");
  TRIATTN_CHECK(std::memcmp(bytes.data(), magic, sizeof magic) == 0, api, name,
                ": not a .npy file (no \\x93NUMPY magic)");
  const auto major = std::to_integer<unsigned>(bytes[6]);
  const auto minor = std::to_integer<unsigned>(bytes[7]);
  TRIATTN_CHECK((major == 1 || major == 2 || major == 3) && minor == 0, api, name, ": format version ", major, ".",
                minor, " is not supported (expected 1.0, 2.0 or 3.0)");
  // Version 1.0 stores the header length as u16, 2.0 and 3.0 (UTF-8 header) as u32.
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  const std::size_t prefix = 8 + len_bytes;
  TRIATTN_CHECK(size >= prefix, api, name, ": file is ", size, " bytes, too short for a version ", major,
                ".0 header length");
  const std::size_t header_len =
      major == 1 ? load_le<std::uint16_t>(bytes.data() + 8) : load_le<std::uint32_t>(bytes.data() + 8);
  TRIATTN_CHECK(header_len <= npy_max_header_bytes, api, name, ": header length ", header_len, " exceeds the limit of ",
                npy_max_header_bytes, " bytes");
  TRIATTN_CHECK(header_len <= size - prefix, api, name, ": header length ", header_len, " exceeds the ", size - prefix,
                " bytes after the header length field (truncated file?)");
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + prefix), header_len);
  npy_header h = npy_header_parser(text, api, name).run();

  TRIATTN_CHECK(!h.fortran_order, api, name, ": fortran_order True is not supported (C order only)");
  TRIATTN_CHECK(h.descr.empty() || h.descr[0] != '>', api, name, ": dtype '", printable(h.descr),
                "' is big-endian; only little-endian ('<') is supported");
  const auto kind = std::find_if(all_element_kinds.begin(), all_element_kinds.end(),
                                 [&](element_kind k) { return h.descr == npy_descr(k); });
  TRIATTN_CHECK(kind != all_element_kinds.end(), api, name, ": dtype '", printable(h.descr),
                "' is not supported (expected <f2, <f4, <f8, <i4 or <i8)");
  const auto need = checked_bytes(h.shape, element_bytes(*kind));
  TRIATTN_CHECK(need.has_value(), api, name, ": shape ", shape_string(h.shape), " of ", element_kind_name(*kind),
                " overflows the addressable size");
  const std::size_t have = size - prefix - header_len;
  TRIATTN_CHECK(have >= *need, api, name, ": data is ", have, " bytes but shape ", shape_string(h.shape), " of ",
                element_kind_name(*kind), " needs ", *need, " (truncated file)");
  TRIATTN_CHECK(have == *need, api, name, ": ", have - *need, " trailing bytes after the ", *need,
                " bytes of data of shape ", shape_string(h.shape));

  npy_array a;
  a.kind = *kind;
  a.shape = std::move(h.shape);
  const auto first = bytes.begin() + static_cast<std::ptrdiff_t>(prefix + header_len);
  a.data.assign(first, bytes.end());
  return a;
}

/// Validates (kind, shape, data) for writing and returns the byte count of the data.
inline std::size_t check_npy_input(element_kind kind, std::span<const std::int64_t> shape, const void* data,
                                   const char* api, const std::string& name) {
  const std::string where = file_prefix(name);
  TRIATTN_CHECK(element_bytes(kind) != 0, api, where, "invalid element_kind ", static_cast<int>(kind));
  TRIATTN_CHECK(shape.size() <= npy_max_dims, api, where, "shape has ", shape.size(), " dimensions (at most ",
                npy_max_dims, ")");
  for (const std::int64_t d : shape) {
    TRIATTN_CHECK(d >= 0, api, where, "shape ", shape_string(shape), " has a negative dimension ", d);
  }
  const auto bytes = checked_bytes(shape, element_bytes(kind));
  TRIATTN_CHECK(bytes && std::in_range<std::size_t>(*bytes), api, where, "shape ", shape_string(shape), " of ",
                element_kind_name(kind), " overflows the addressable size");
  TRIATTN_CHECK(data != nullptr || *bytes == 0, api, where, "data is null but shape ", shape_string(shape), " holds ",
                *bytes, " bytes");
  return static_cast<std::size_t>(*bytes);
}

inline std::vector<std::byte> serialize_npy(element_kind kind, std::span<const std::int64_t> shape, const void* data,
                                            const char* api, const std::string& name) {
  const std::size_t data_bytes = check_npy_input(kind, shape, data, api, name);
  // Exactly np.save: keys sorted, repr() of the shape tuple, then spare spaces so the first
  // axis can grow in place (numpy's GROWTH_AXIS_MAX_DIGITS = 21), then spaces and a newline
  // up to a multiple of 64 bytes (numpy's ARRAY_ALIGN) counting the 10-byte prefix.
  std::string dict = "{'descr': '";
  dict += npy_descr(kind);
  dict += "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) dict += ", ";
    dict += std::to_string(shape[i]);
  }
  if (shape.size() == 1) dict += ',';
  dict += "), }";
  if (!shape.empty()) dict.append(21 - std::to_string(shape[0]).size(), ' ');
  const std::size_t pad = 64 - (10 + dict.size() + 1) % 64;
  dict.append(pad, ' ');
  dict += '\n';

  std::vector<std::byte> out;
  out.reserve(10 + dict.size() + data_bytes);
  for (const char c : std::string_view("\x93NUMPY\x01\x00", 8)) out.push_back(static_cast<std::byte>(c));
  append_le(out, dict.size(), 2);  // at most ~1.5 KiB with <= 64 dims: always fits version 1.0
  for (const char c : dict) out.push_back(static_cast<std::byte>(c));
  const auto* p = static_cast<const std::byte*>(data);
  if (data_bytes > 0) out.insert(out.end(), p, p + data_bytes);
  return out;
}

}  // namespace detail

/// Parses the bytes of a `.npy` file (versions 1.0, 2.0, 3.0; '<f2', '<f4', '<f8', '<i4',
/// '<i8'; C order). `name` names the file in messages. Throws `triattn::error` for anything
/// else, including truncated data and trailing bytes.
inline npy_array parse_npy(std::span<const std::byte> bytes, const std::string& name) {
  return detail::parse_npy(bytes, name, "triattn::io::parse_npy");
}

/// Reads and parses the `.npy` file at `path` (messages name it as `path.string()`).
inline npy_array read_npy(const std::filesystem::path& path) {
  const char* api = "triattn::io::read_npy";
  return detail::parse_npy(detail::read_file(path, api), path.string(), api);
}

/// The bytes `np.save` writes for a C-order array of `kind` and `shape` whose elements are
/// at `data` (version 1.0; the header padded to a multiple of 64 bytes, newline included).
/// `data` may be null only when the array is empty.
inline std::vector<std::byte> serialize_npy(element_kind kind, std::span<const std::int64_t> shape, const void* data) {
  return detail::serialize_npy(kind, shape, data, "triattn::io::serialize_npy", "");
}

/// Writes `serialize_npy(kind, shape, data)` to `path` through a temporary file in the same
/// folder and a rename, so a failed write leaves no partial file.
inline void write_npy(const std::filesystem::path& path, element_kind kind, std::span<const std::int64_t> shape,
                      const void* data) {
  const char* api = "triattn::io::write_npy";
  detail::write_file_atomically(path, detail::serialize_npy(kind, shape, data, api, path.string()), api);
}

/// Requires `a.shape` to match `expected`, where -1 matches any size. Throws
/// "triattn::io::check_shape: <name>: <what> has shape [2, 8, 100] but expected [2, 8, *, 128]".
inline void check_shape(const npy_array& a, std::span<const std::int64_t> expected, const std::string& name,
                        const char* what) {
  bool ok = a.shape.size() == expected.size();
  for (std::size_t i = 0; ok && i < expected.size(); ++i) ok = expected[i] == -1 || expected[i] == a.shape[i];
  TRIATTN_CHECK(ok, "triattn::io::check_shape", name, ": ", what, " has shape ", detail::shape_string(a.shape),
                " but expected ", detail::shape_string(expected, true));
}

}  // namespace io
TRIATTN_NAMESPACE_END
