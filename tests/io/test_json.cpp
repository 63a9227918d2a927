// The JSON parser of safetensors headers: what RFC 8259 allows parses to the right values,
// everything else (and anything deeper than the limit) throws a one-line triattn::error.
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "test_helpers.hpp"
#include "triattn/io/json.hpp"

namespace {

namespace json = triattn::io::json;
using json::value_type;
using triattn_test::require_error;

json::value parse(std::string_view text) { return json::parse(text, "h.json"); }

void require_malformed(std::string_view text, std::string_view problem) {
  INFO("input: " << std::string(text));
  require_error([&] { parse(text); }, {"triattn::io::json::parse: h.json: invalid JSON at byte ", problem});
}

}  // namespace

TEST_CASE("json: scalars, containers and whitespace") {
  const json::value v =
      parse(" \t\r\n{\"a\": [1, -2, 0, 3.5, -1e3, 2E-2, true, false, null, \"s\", {}, []],\n \"b\" : {\"c\": \"d\"}} ");
  REQUIRE(v.type == value_type::object);
  REQUIRE(v.keys == std::vector<std::string>{"a", "b"});
  const json::value& a = *v.find("a");
  REQUIRE(a.type == value_type::array);
  REQUIRE(a.items.size() == 12);
  CHECK(a.items[0].type == value_type::integer);
  CHECK(a.items[0].integer == 1);
  CHECK(a.items[1].integer == -2);
  CHECK(a.items[2].integer == 0);
  CHECK(a.items[3].type == value_type::number);
  CHECK(a.items[3].number == 3.5);
  CHECK(a.items[4].number == -1000.0);
  CHECK(a.items[5].number == 0.02);
  CHECK((a.items[6].type == value_type::boolean && a.items[6].boolean));
  CHECK((a.items[7].type == value_type::boolean && !a.items[7].boolean));
  CHECK(a.items[8].type == value_type::null);
  CHECK(a.items[9].text == "s");
  CHECK((a.items[10].type == value_type::object && a.items[10].keys.empty()));
  CHECK((a.items[11].type == value_type::array && a.items[11].items.empty()));
  CHECK(v.find("b")->find("c")->text == "d");
  CHECK(v.find("zz") == nullptr);
  CHECK(a.find("a") == nullptr);  // not an object
}

TEST_CASE("json: integer limits") {
  CHECK(parse("9223372036854775807").integer == INT64_MAX);
  CHECK(parse("-9223372036854775808").integer == INT64_MIN);
  CHECK(parse("-0").integer == 0);
  CHECK(parse("1.7976931348623157e308").number == 1.7976931348623157e308);
}

TEST_CASE("json: string escapes and UTF-8") {
  CHECK(parse(R"("\"\\\/\b\f\n\r\t")").text == "\"\\/\b\f\n\r\t");
  CHECK(parse(R"("\u0041\u00e9\u20AC")").text == "A\xc3\xa9\xe2\x82\xac");
  CHECK(parse(R"("\ud83d\ude00")").text == "\xf0\x9f\x98\x80");  // a surrogate pair
  CHECK(parse("\"caf\xc3\xa9 \xf0\x9f\x98\x80\"").text == "caf\xc3\xa9 \xf0\x9f\x98\x80");
  CHECK(parse(R"("\u0000")").text == std::string(1, '\0'));
}

TEST_CASE("json: append_string escapes what the parser decodes") {
  const std::string raw = std::string("q\"b\\s/\b\f\n\r\t\x01\x1f\x7f") + "\xc3\xa9";
  std::string out;
  json::append_string(out, raw);
  CHECK(out == "\"q\\\"b\\\\s/\\b\\f\\n\\r\\t\\u0001\\u001f\x7f\xc3\xa9\"");
  CHECK(parse(out).text == raw);
}

TEST_CASE("json: UTF-8 validation") {
  CHECK(json::is_valid_utf8("plain \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf"));
  CHECK_FALSE(json::is_valid_utf8("\xc0\x80"));          // overlong NUL
  CHECK_FALSE(json::is_valid_utf8("\xe0\x80\xaf"));      // overlong '/'
  CHECK_FALSE(json::is_valid_utf8("\xed\xa0\x80"));      // a UTF-16 surrogate
  CHECK_FALSE(json::is_valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  CHECK_FALSE(json::is_valid_utf8("\xf5\x80\x80\x80"));
  CHECK_FALSE(json::is_valid_utf8("\x80"));      // a lone continuation byte
  CHECK_FALSE(json::is_valid_utf8("\xe2\x82"));  // truncated at the end
  CHECK_FALSE(json::is_valid_utf8("\xe2\x28\xa1"));
}

TEST_CASE("json: depth limit") {
  const auto nested = [](std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  CHECK(parse(nested(json::default_max_depth)).type == value_type::array);
  require_malformed(nested(json::default_max_depth + 1), "nesting deeper than 64 levels");
  require_malformed(std::string(100000, '['), "nesting deeper than 64 levels");  // no stack overflow
  require_error([] { json::parse("{\"a\":{\"b\":[]}}", "x", "my::api", 2); },
                {"my::api: x: invalid JSON at byte 10: nesting deeper than 2 levels"});
  CHECK(json::parse("{\"a\":{\"b\":1}}", "x", "my::api", 2).type == value_type::object);
}

TEST_CASE("json: value limit bounds the memory of a document") {
  // Issue 15: a parsed value costs about 100 bytes, so a 100 MB header of "0," took 8.6 GB.
  const auto zeros = [](std::size_t n) {
    std::string s = "[";
    for (std::size_t i = 0; i < n; ++i) s += i ? ",0" : "0";
    return s + "]";
  };
  CHECK(parse(zeros(json::detail::max_values - 1)).items.size() == json::detail::max_values - 1);  // the array is one
  require_malformed(zeros(json::detail::max_values), "more than 1048576 JSON values");
  require_malformed(zeros(20'000'000), "more than 1048576 JSON values");
}

TEST_CASE("json: malformed input throws") {
  require_malformed("", "unexpected end of input");
  require_malformed("   ", "unexpected end of input");
  require_malformed("\"abc", "unterminated string");
  require_malformed("\"abc\\", "unterminated string");
  require_malformed("{\"a\": \"b}", "unterminated string");
  require_malformed(R"("\x")", "invalid escape \\'x'");
  require_malformed(R"("\u12G4")", "invalid hex digit 'G'");
  require_malformed(R"("\u12")", "invalid hex digit '\"'");
  require_malformed(R"("\u12)", "unterminated \\u escape");
  require_malformed(R"("\ude00")", "lone low surrogate");
  require_malformed(R"("\ud83d")", "high surrogate not followed by a \\u low surrogate");
  require_malformed(R"("\ud83d\u0041")", "high surrogate not followed by a low surrogate");
  require_malformed("\"a\tb\"", "raw control character byte 0x09");
  require_malformed("\"\xc0\x80\"", "invalid UTF-8");
  require_malformed("\"\xed\xa0\x80\"", "invalid UTF-8");
  require_malformed("\"\xe2\x82\"", "invalid UTF-8");
  require_malformed("{} x", "byte 3: unexpected 'x' after the value");
  require_malformed("1 2", "unexpected '2' after the value");
  require_malformed("[1,]", "unexpected ']', expected a value");
  require_malformed("{\"a\":1,}", "expected a string key, found '}'");
  require_malformed("{\"a\" 1}", "expected ':', found '1'");
  require_malformed("{'a':1}", "expected a string key, found '''");
  require_malformed("{\"a\":1 \"b\":2}", "expected ',' or '}', found '\"'");
  require_malformed("[1 2]", "expected ',' or ']', found '2'");
  require_malformed("[1", "unexpected end of input, expected ',' or ']'");
  require_malformed("{\"a\":1,\"a\":2}", "byte 7: duplicate key");
  require_malformed("tru", "invalid literal, expected 'true'");
  require_malformed("nul", "invalid literal, expected 'null'");
  require_malformed("NaN", "unexpected 'N', expected a value");
  require_malformed("Infinity", "unexpected 'I'");
  require_malformed("+1", "unexpected '+'");
  require_malformed("01", "leading zero");
  require_malformed("-", "expected a digit in a number, found end of input");
  require_malformed("-a", "expected a digit in a number, found 'a'");
  require_malformed("1.", "expected a digit after '.'");
  require_malformed("1.e5", "expected a digit after '.'");
  require_malformed("1e", "expected a digit in an exponent");
  require_malformed("1e+", "expected a digit in an exponent");
  require_malformed(".5", "unexpected '.'");
  require_malformed("9223372036854775808", "number 9223372036854775808 is out of range");
  require_malformed("-9223372036854775809", "number -9223372036854775809 is out of range");
  require_malformed("1e400", "number 1e400 is out of range");
  require_malformed("-1e400", "number -1e400 is out of range");
  require_malformed(std::string(1000, '9'), "number " + std::string(40, '9') + "... is out of range");
  require_malformed("\x01", "unexpected byte 0x01, expected a value");
}
