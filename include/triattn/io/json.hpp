/// \file triattn/io/json.hpp
/// \brief A minimal, strict, bounded JSON (RFC 8259) parser and string writer.
///
/// Made for safetensors headers, which are untrusted input: the parser never reads past the
/// text it is given, limits the nesting depth (so a hostile header cannot exhaust the stack)
/// and the number of values (so it cannot exhaust memory: `detail::max_values`),
/// and rejects everything RFC 8259 does not allow (trailing commas, leading zeros, lone
/// surrogates, invalid UTF-8, raw control characters) plus duplicate object keys and numbers
/// that do not fit (integers outside int64, finite literals that overflow a double).
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "triattn/core/error.hpp"

TRIATTN_NAMESPACE_BEGIN
namespace io {
namespace json {

/// The type of a JSON value. A number without fraction or exponent is an `integer`.
enum class value_type : std::uint8_t { null, boolean, integer, number, string, array, object };

/// Name for messages: "null", "boolean", "integer", "number", "string", "array", "object".
inline const char* type_name(value_type t) {
  switch (t) {
    case value_type::null:
      return "null";
    case value_type::boolean:
      return "boolean";
    case value_type::integer:
      return "integer";
    case value_type::number:
      return "number";
    case value_type::string:
      return "string";
    case value_type::array:
      return "array";
    case value_type::object:
      return "object";
  }
  return "?";
}

/// A parsed JSON value. An array keeps its elements in `items`; an object keeps its members
/// in document order, `keys[i]` naming `items[i]` (keys are unique: the parser rejects
/// duplicates).
struct value {
  value_type type = value_type::null;
  bool boolean = false;      ///< `boolean`
  std::int64_t integer = 0;  ///< `integer`
  double number = 0.0;       ///< `number`, and `integer` as a double
  std::string text;          ///< `string` (UTF-8, escapes decoded)
  std::vector<std::string> keys;
  std::vector<value> items;

  /// The member `key` of an object, or nullptr (also for non-objects).
  const value* find(std::string_view key) const {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return &items[i];
    }
    return nullptr;
  }
};

/// Length of the valid UTF-8 sequence that starts at `s[pos]` (1 to 4), or 0 when the bytes
/// there are not one (overlong forms, surrogates and code points above U+10FFFF are invalid).
inline std::size_t utf8_sequence_length(std::string_view s, std::size_t pos) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char lead = byte(pos);
  if (lead < 0x80) return 1;
  std::size_t len = 0;
  unsigned char lo = 0x80;  // allowed range of the second byte: excludes overlongs/surrogates
  unsigned char hi = 0xbf;
  if (lead >= 0xc2 && lead <= 0xdf) {
    len = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    len = 3;
    if (lead == 0xe0) lo = 0xa0;
    if (lead == 0xed) hi = 0x9f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    len = 4;
    if (lead == 0xf0) lo = 0x90;
    if (lead == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (s.size() - pos < len) return 0;
  if (byte(pos + 1) < lo || byte(pos + 1) > hi) return 0;
  for (std::size_t i = 2; i < len; ++i) {
    if ((byte(pos + i) & 0xc0) != 0x80) return 0;
  }
  return len;
}

/// True when `s` is entirely valid UTF-8.
inline bool is_valid_utf8(std::string_view s) {
  for (std::size_t pos = 0; pos < s.size();) {
    const std::size_t len = utf8_sequence_length(s, pos);
    if (len == 0) return false;
    pos += len;
  }
  return true;
}

/// Appends `s` (valid UTF-8) as a quoted JSON string, escaping as serde_json does: `"` and
/// `\`, the short escapes for \b \f \n \r \t, `\u00XX` for the other control characters.
inline void append_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (u < 0x20) {
          out += "\\u00";
          out += hex[u >> 4];
          out += hex[u & 0xf];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

namespace detail {

/// Recursive-descent parser over a string_view: every access goes through `at_end()` /
/// `peek()`, so no input can make it read out of bounds.
/// The most values one document may hold: far above any safetensors header (a model of 10,000
/// tensors holds about 60,000), and about 100 MB of parsed values at most.
inline constexpr std::size_t max_values = std::size_t{1} << 20;

class parser {
 public:
  parser(std::string_view text, const std::string& name, const char* api, std::size_t max_depth)
      : text_(text), name_(name), api_(api), max_depth_(max_depth) {}

  value run() {
    skip_ws();
    value v = parse_value(0);
    skip_ws();
    if (!at_end()) fail("unexpected ", describe(), " after the value");
    return v;
  }

 private:
  template <class... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    ::TRIATTN_NAMESPACE::detail::fail(api_, name_, ": invalid JSON at byte ", pos_, ": ", parts...);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  unsigned char peek() const { return static_cast<unsigned char>(text_[pos_]); }

  /// The next byte for messages: 'c' when printable, else its hex value, or "end of input".
  std::string describe() const {
    if (at_end()) return "end of input";
    static constexpr char hex[] = "0123456789abcdef";
    const unsigned char c = peek();
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    return std::string("byte 0x") + hex[c >> 4] + hex[c & 0xf];
  }

  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }

  void expect(char c, const char* what) {
    if (at_end() || peek() != static_cast<unsigned char>(c)) fail("expected ", what, ", found ", describe());
    ++pos_;
  }

  value parse_value(std::size_t depth) {
    if (at_end()) fail("unexpected end of input, expected a value");
    // Each value costs about 100 bytes parsed, so "[0,0,0,...]" would cost 50 times its text:
    // the count is bounded, and with it the memory of any document.
    if (++values_ > max_values) fail("more than ", max_values, " JSON values");
    switch (peek()) {
      case '{':
        return parse_container(depth, true);
      case '[':
        return parse_container(depth, false);
      case '"': {
        value v;
        v.type = value_type::string;
        v.text = parse_string();
        return v;
      }
      case 't':
        return parse_literal("true", value_type::boolean, true);
      case 'f':
        return parse_literal("false", value_type::boolean, false);
      case 'n':
        return parse_literal("null", value_type::null, false);
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return parse_number();
        fail("unexpected ", describe(), ", expected a value");
    }
  }

  value parse_literal(std::string_view word, value_type type, bool b) {
    if (text_.substr(pos_, word.size()) != word) fail("invalid literal, expected '", word, "'");
    pos_ += word.size();
    value v;
    v.type = type;
    v.boolean = b;
    return v;
  }

  /// Objects and arrays share the comma/bracket logic; objects add "key":.
  value parse_container(std::size_t depth, bool object) {
    if (depth + 1 > max_depth_) fail("nesting deeper than ", max_depth_, " levels");
    const char close = object ? '}' : ']';
    ++pos_;
    value v;
    v.type = object ? value_type::object : value_type::array;
    std::set<std::string, std::less<>> seen;  // duplicate detection in O(n log n)
    skip_ws();
    if (!at_end() && peek() == static_cast<unsigned char>(close)) {
      ++pos_;
      return v;
    }
    while (true) {
      skip_ws();
      if (object) {
        if (at_end() || peek() != '"') fail("expected a string key, found ", describe());
        const std::size_t key_pos = pos_;
        std::string key = parse_string();
        if (!seen.insert(key).second) {
          pos_ = key_pos;
          fail("duplicate key");
        }
        v.keys.push_back(std::move(key));
        skip_ws();
        expect(':', "':'");
        skip_ws();
      }
      v.items.push_back(parse_value(depth + 1));
      skip_ws();
      if (at_end()) fail("unexpected end of input, expected ',' or '", close, "'");
      if (peek() == static_cast<unsigned char>(close)) {
        ++pos_;
        return v;
      }
      expect(',', object ? "',' or '}'" : "',' or ']'");
    }
  }

  unsigned hex4() {
    unsigned u = 0;
    for (int i = 0; i < 4; ++i) {
      if (at_end()) fail("unterminated \\u escape");
      const unsigned char c = peek();
      unsigned d = 0;
      if (c >= '0' && c <= '9') {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10u;
      } else if (c >= 'A' && c <= 'F') {
        d = c - 'A' + 10u;
      } else {
        fail("invalid hex digit ", describe(), " in a \\u escape");
      }
      u = u * 16 + d;
      ++pos_;
    }
    return u;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    const auto put = [&](unsigned b) { out += static_cast<char>(b); };
    if (cp < 0x80) {
      put(cp);
    } else if (cp < 0x800) {
      put(0xc0 | (cp >> 6));
      put(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      put(0xe0 | (cp >> 12));
      put(0x80 | ((cp >> 6) & 0x3f));
      put(0x80 | (cp & 0x3f));
    } else {
      put(0xf0 | (cp >> 18));
      put(0x80 | ((cp >> 12) & 0x3f));
      put(0x80 | ((cp >> 6) & 0x3f));
      put(0x80 | (cp & 0x3f));
    }
  }

  /// `\uXXXX`, already past the `u`; a high surrogate must be followed by `\u` + low.
  unsigned parse_unicode_escape() {
    const unsigned u = hex4();
    if (u >= 0xdc00 && u <= 0xdfff) fail("lone low surrogate in a \\u escape");
    if (u < 0xd800 || u > 0xdbff) return u;
    if (text_.substr(pos_, 2) != "\\u") fail("high surrogate not followed by a \\u low surrogate");
    pos_ += 2;
    const unsigned low = hex4();
    if (low < 0xdc00 || low > 0xdfff) fail("high surrogate not followed by a low surrogate");
    return 0x10000u + ((u - 0xd800u) << 10) + (low - 0xdc00u);
  }

  std::string parse_string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const unsigned char c = peek();
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("raw control character ", describe(), " in a string");
      if (c == '\\') {
        ++pos_;
        if (at_end()) fail("unterminated string");
        const unsigned char e = peek();
        ++pos_;
        switch (e) {
          case '"':
            out += '"';
            break;
          case '\\':
            out += '\\';
            break;
          case '/':
            out += '/';
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u':
            append_utf8(out, parse_unicode_escape());
            break;
          default:
            --pos_;
            fail("invalid escape \\", describe());
        }
        continue;
      }
      const std::size_t len = utf8_sequence_length(text_, pos_);
      if (len == 0) fail("invalid UTF-8 in a string");
      out.append(text_.substr(pos_, len));
      pos_ += len;
    }
  }

  void digits() {
    while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
  }

  void require_digit(const char* where) {
    if (at_end() || peek() < '0' || peek() > '9') fail("expected a digit ", where, ", found ", describe());
  }

  value parse_number() {
    const std::size_t start = pos_;
    if (peek() == '-') ++pos_;
    require_digit("in a number");
    if (peek() == '0') {
      ++pos_;
      if (!at_end() && peek() >= '0' && peek() <= '9') fail("leading zero in a number");
    } else {
      digits();
    }
    bool integral = true;
    if (!at_end() && peek() == '.') {
      integral = false;
      ++pos_;
      require_digit("after '.'");
      digits();
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      require_digit("in an exponent");
      digits();
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    value v;
    std::errc ec{};
    if (integral) {
      v.type = value_type::integer;
      ec = std::from_chars(first, last, v.integer).ec;
      v.number = static_cast<double>(v.integer);
    } else {
      v.type = value_type::number;
      ec = std::from_chars(first, last, v.number).ec;
    }
    if (ec != std::errc{}) {
      pos_ = start;
      // Bounded quote: a hostile header may hold megabytes of digits.
      const std::string_view literal = text_.substr(start, std::min<std::size_t>(last - first, 40));
      fail("number ", literal, last - first > 40 ? "..." : "", " is out of range");
    }
    return v;
  }

  std::string_view text_;
  const std::string& name_;
  const char* api_;
  std::size_t max_depth_;
  std::size_t pos_ = 0;
  std::size_t values_ = 0;
};

}  // namespace detail

/// Default nesting limit: far above any safetensors header (depth 3), far below the stack.
inline constexpr std::size_t default_max_depth = 64;

/// Parses `text` as one JSON value (surrounding whitespace allowed). Throws `triattn::error`
/// "<api>: <name>: invalid JSON at byte <offset>: <problem>" on any malformed input.
inline value parse(std::string_view text, const std::string& name, const char* api = "triattn::io::json::parse",
                   std::size_t max_depth = default_max_depth) {
  return detail::parser(text, name, api, max_depth).run();
}

}  // namespace json
}  // namespace io
TRIATTN_NAMESPACE_END
