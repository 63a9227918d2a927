// safetensors files: the reference implementation's own byte vectors, round trips of every
// dtype, deterministic and aligned layout, hand-built files, and one test per validation
// rule whose message names the API, the file and the value.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "support/random.hpp"
#include "test_helpers.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/io/json.hpp"
#include "triattn/io/safetensors.hpp"

namespace {

namespace io = triattn::io;
using metadata_t = std::map<std::string, std::string>;
using shape_t = std::vector<std::int64_t>;
using triattn_test::bytes_of;
using triattn_test::require_error;
using triattn_test::text_of;

const std::string parse_api = "triattn::io::safetensors_file::parse: x.safetensors: ";

template <class T>
std::vector<std::byte> raw(const std::vector<T>& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
  return out;
}

/// A file built by hand: the 8-byte length of `header`, `header`, then `data_bytes` bytes.
std::vector<std::byte> st_file(std::string_view header, std::size_t data_bytes) {
  std::vector<std::byte> out;
  for (std::size_t i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((header.size() >> (8 * i)) & 0xff));
  for (const char c : header) out.push_back(static_cast<std::byte>(c));
  out.resize(out.size() + data_bytes, std::byte{0x5a});
  return out;
}

io::safetensors_file parse(std::vector<std::byte> b) {
  return io::safetensors_file::parse(std::move(b), "x.safetensors");
}

void require_parse_error(std::string_view header, std::size_t data_bytes, std::string_view problem) {
  INFO("header: " << std::string(header));
  require_error([&] { parse(st_file(header, data_bytes)); }, {parse_api, problem});
}

/// `{"w": {<fields>}}` for the tests of one entry.
std::string one(std::string_view fields) { return "{\"w\":{" + std::string(fields) + "}}"; }

/// Element size of a dtype, for the layout checks.
std::size_t dtype_bytes(const std::string& d) { return io::detail::find_safetensors_dtype(d)->bytes; }

}  // namespace

TEST_CASE("safetensors: the reference implementation's byte vectors") {
  // From the tests of huggingface/safetensors (safetensors/src/tensor.rs).
  const std::vector<float> values = {0, 1, 2, 3, 4, 5};
  const io::safetensors_entry attn0{"attn0", "F32", {1, 1, 2, 3}, {}};
  std::vector<io::safetensors_entry> entries = {attn0};
  const auto data = raw(values);
  entries[0].data = data;
  const std::string expected = std::string("\x48\0\0\0\0\0\0\0", 8) +
                               R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" +
                               std::string(7, ' ') + text_of(data);
  REQUIRE(expected.size() == 8 + 72 + 24);
  CHECK(text_of(io::serialize_safetensors(entries, {})) == expected);
  const io::safetensors_file f = parse(bytes_of(expected));
  CHECK(f.names() == std::vector<std::string>{"attn0"});
  CHECK(io::tensor_to_float(f.get("attn0"), "attn0") == values);

  CHECK(text_of(io::serialize_safetensors({}, {})) == std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  const std::string with_metadata =
      std::string("\x28\0\0\0\0\0\0\0", 8) + R"({"__metadata__":{"framework":"pt"}})" + "     ";
  CHECK(text_of(io::serialize_safetensors({}, {{"framework", "pt"}})) == with_metadata);
  const io::safetensors_file m = parse(bytes_of(with_metadata));
  CHECK(m.metadata() == metadata_t{{"framework", "pt"}});
  CHECK(m.names().empty());
}

TEST_CASE("safetensors: round trip, layout and determinism") {
  std::mt19937_64 g = triattn_test::rng(11);
  std::normal_distribution<float> normal;
  const auto floats = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(g);
    return v;
  };
  std::vector<std::uint16_t> f16, bf16;
  for (const float x : floats(3)) f16.push_back(triattn::float_to_half_bits(x));
  for (const float x : floats(4)) bf16.push_back(triattn::float_to_bf16_bits(x));
  const std::vector<float> f32 = floats(6);
  const std::vector<double> f64 = {normal(g), 1e300};
  const std::vector<std::int64_t> i64 = {static_cast<std::int64_t>(g())};
  const std::vector<std::int32_t> i32 = {-7};
  const std::vector<std::uint8_t> u8 = {1, 2, 3, 4, 5};
  const std::vector<std::vector<std::byte>> buffers = {raw(f32), raw(f16), raw(i64), raw(bf16),
                                                       raw(u8),  raw(f64), {},       raw(i32)};
  std::vector<io::safetensors_entry> entries = {
      {"b.f32", "F32", {2, 3}, buffers[0]},   {"a.f16", "F16", {3}, buffers[1]}, {"c.i64", "I64", {}, buffers[2]},
      {"d.bf16", "BF16", {2, 2}, buffers[3]}, {"e.u8", "U8", {5}, buffers[4]},   {"f.f64", "F64", {2}, buffers[5]},
      {"g.empty", "F32", {0, 4}, buffers[6]}, {"h.i32", "I32", {1}, buffers[7]}};
  const metadata_t metadata = {{"format", "triattn.stats.v1"}, {"rope_style", "half"}, {"quote\"\n", "caf\xc3\xa9"}};
  const auto bytes = io::serialize_safetensors(entries, metadata);

  // Deterministic, whatever the order of the entries.
  CHECK(io::serialize_safetensors(entries, metadata) == bytes);
  std::shuffle(entries.begin(), entries.end(), g);
  CHECK(io::serialize_safetensors(entries, metadata) == bytes);

  const io::safetensors_file f = parse(bytes);
  CHECK(f.name() == "x.safetensors");
  CHECK(f.metadata() == metadata);
  CHECK(f.names() ==
        std::vector<std::string>{"a.f16", "b.f32", "c.i64", "d.bf16", "e.u8", "f.f64", "g.empty", "h.i32"});
  for (const io::safetensors_entry& e : entries) {
    INFO(e.name);
    const io::safetensors_tensor& t = f.get(e.name);
    CHECK(t.dtype == e.dtype);
    CHECK(t.shape == e.shape);
    CHECK(std::vector<std::byte>(t.data.begin(), t.data.end()) == std::vector<std::byte>(e.data.begin(), e.data.end()));
  }
  CHECK(f.find("nope") == nullptr);
  require_error([&] { (void)f.get("nope"); }, {"triattn::io::safetensors_file::get: x.safetensors: no tensor 'nope'"});

  // Layout: the header is padded to a multiple of 8, the tensors fill the buffer without
  // gaps in the order of descending element size (then name), each aligned to its size.
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | std::to_integer<std::uint64_t>(bytes[static_cast<std::size_t>(i)]);
  CHECK(n % 8 == 0);
  const io::json::value header =
      io::json::parse(std::string_view(reinterpret_cast<const char*>(bytes.data() + 8), n), "header");
  CHECK(header.keys.front() == "__metadata__");
  const std::vector<std::string> expected_order = {"__metadata__", "c.i64",  "f.f64", "b.f32", "g.empty",
                                                   "h.i32",        "d.bf16", "a.f16", "e.u8"};
  CHECK(header.keys == expected_order);
  std::int64_t end = 0;
  for (std::size_t i = 1; i < header.keys.size(); ++i) {
    const io::json::value& offsets = *header.items[i].find("data_offsets");
    CHECK(offsets.items[0].integer == end);
    CHECK(offsets.items[0].integer % static_cast<std::int64_t>(dtype_bytes(header.items[i].find("dtype")->text)) == 0);
    end = offsets.items[1].integer;
  }
  CHECK(static_cast<std::size_t>(end) == bytes.size() - 8 - n);

  // Without metadata there is no "__metadata__" key at all.
  const std::string plain = text_of(io::serialize_safetensors(entries, {}));
  CHECK(plain.find("__metadata__") == std::string::npos);
  CHECK(parse(bytes_of(plain)).metadata().empty());
}

TEST_CASE("safetensors: a hand-built file with padding and any key order") {
  const std::string header =
      " { \"b\" : {\"shape\": [2], \"data_offsets\": [0, 8], \"dtype\": \"F32\"},\n"
      "   \"__metadata__\": {\"k\": \"v\", \"\\u00e9\": \"\"},\n"
      "   \"a\": {\"dtype\": \"F64\", \"data_offsets\": [8, 16], \"shape\": []},\n"
      "   \"z\": {\"dtype\": \"F16\", \"data_offsets\": [8, 8], \"shape\": [0]} }        ";
  auto file = st_file(header, 16);
  const double d = -2.5;
  const float fs[2] = {1.5f, -3.0f};
  std::memcpy(file.data() + 8 + header.size(), fs, 8);
  std::memcpy(file.data() + 8 + header.size() + 8, &d, 8);
  const io::safetensors_file f = parse(file);
  CHECK(f.names() == std::vector<std::string>{"a", "b", "z"});
  CHECK(f.metadata() == metadata_t{{"k", "v"}, {"\xc3\xa9", ""}});
  CHECK(io::tensor_to_double(f.get("a"), "a") == std::vector<double>{-2.5});
  CHECK(io::tensor_to_float(f.get("b"), "b") == std::vector<float>{1.5f, -3.0f});
  CHECK(io::tensor_to_float(f.get("z"), "z").empty());
  CHECK(f.get("a").shape.empty());
}

TEST_CASE("safetensors: gaps and trailing bytes are refused, as the reference implementation does") {
  // Issue 15: both were accepted. The tensors must tile the data buffer exactly.
  const std::string two =
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}";
  require_parse_error(two, 12, "4 bytes before tensor 'b' [8, 12] belong to no tensor");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]"), 8,
                      "4 bytes before tensor 'w' [4, 8] belong to no tensor");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]"), 11,
                      "3 bytes follow the last tensor's data");
  require_parse_error("{}", 5, "5 bytes follow the last tensor's data");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]"), 1,
                      "1 bytes follow the last tensor's data");
}

TEST_CASE("safetensors: conversions") {
  const std::vector<float> values = {1.0f, -0.5f, 65504.0f, 3.0e-5f};
  std::vector<std::uint16_t> h, b;
  for (const float x : values) {
    h.push_back(triattn::float_to_half_bits(x));
    b.push_back(triattn::float_to_bf16_bits(x));
  }
  const auto hb = raw(h), bb = raw(b), fb = raw(values);
  const std::vector<double> doubles = {0.1, -1e-300};
  const auto db = raw(doubles);
  const io::safetensors_tensor th{"F16", {4}, hb}, tb{"BF16", {2, 2}, bb}, tf{"F32", {4}, fb}, td{"F64", {2}, db};
  const auto f16 = io::tensor_to_float(th, "h");
  const auto bf16 = io::tensor_to_float(tb, "b");
  for (std::size_t i = 0; i < values.size(); ++i) {
    CHECK(f16[i] == triattn::half_bits_to_float(h[i]));
    CHECK(bf16[i] == triattn::bf16_bits_to_float(b[i]));
  }
  CHECK(io::tensor_to_float(tf, "f") == values);
  CHECK(io::tensor_to_float(td, "d") == std::vector<float>{0.1f, -0.0f});
  CHECK(io::tensor_to_double(td, "d") == doubles);
  CHECK(io::tensor_to_double(tf, "f") == std::vector<double>(values.begin(), values.end()));

  const std::vector<std::byte> eight(8);
  require_error(
      [&] {
        io::tensor_to_float(io::safetensors_tensor{"I64", {1}, eight}, "s.safetensors: idx");
      },
      {"triattn::io::tensor_to_float: s.safetensors: idx: dtype I64 is not a float type "
       "(expected F16, BF16, F32 or F64)"});
  require_error(
      [&] {
        io::tensor_to_double(io::safetensors_tensor{"F16", {4}, eight}, "s.safetensors: q");
      },
      {"triattn::io::tensor_to_double: s.safetensors: q: dtype F16 is not F32 or F64"});
  require_error(
      [&] {
        io::tensor_to_float(io::safetensors_tensor{"F32", {3}, eight}, "s.safetensors: q");
      },
      {"triattn::io::tensor_to_float: s.safetensors: q: data holds 8 bytes but shape [3] of F32 needs 12"});
  require_error(
      [&] {
        io::tensor_to_double(io::safetensors_tensor{"F8", {8}, eight}, "s.safetensors: q");
      },
      {"triattn::io::tensor_to_double: s.safetensors: q: dtype 'F8' is not supported"});
}

TEST_CASE("safetensors: the file is move-only and moves keep the tensors valid") {
  static_assert(!std::is_copy_constructible_v<io::safetensors_file>);
  static_assert(!std::is_copy_assignable_v<io::safetensors_file>);
  const std::vector<float> values = {4, 5};
  const auto data = raw(values);
  const std::vector<io::safetensors_entry> entries = {{"w", "F32", {2}, data}};
  io::safetensors_file f = parse(io::serialize_safetensors(entries, {}));
  const std::byte* p = f.get("w").data.data();
  io::safetensors_file g = std::move(f);
  CHECK(g.get("w").data.data() == p);
  CHECK(io::tensor_to_float(g.get("w"), "w") == values);
  io::safetensors_file h = parse(io::serialize_safetensors({}, {}));
  h = std::move(g);
  CHECK(io::tensor_to_float(h.get("w"), "w") == values);
}

TEST_CASE("safetensors: every parse rule names the API, the file and the value") {
  const std::string w = "\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]";
  REQUIRE(parse(st_file(one(w), 8)).get("w").shape == shape_t{2});

  require_error([] { parse(bytes_of("\x01\x02\x03\x04\x05")); },
                {parse_api, "file is 5 bytes, too short for the 8-byte header length"});
  auto over_limit = st_file("", 0);
  over_limit[0] = std::byte{0x01};
  over_limit[1] = std::byte{0x00};
  over_limit[2] = std::byte{0x40};
  over_limit[3] = std::byte{0x06};  // 0x06400001 = 100 MiB + 1
  require_error([&] { parse(over_limit); },
                {parse_api, "header length 104857601 exceeds the limit of 104857600 bytes"});
  auto past_end = st_file("{}", 10);
  past_end[0] = std::byte{100};
  require_error([&] { parse(past_end); },
                {parse_api, "header length 100 exceeds the 12 bytes after the length field (truncated file?)"});
  auto all_ones = st_file("{}", 0);
  std::fill(all_ones.begin(), all_ones.begin() + 8, std::byte{0xff});
  require_error([&] { parse(all_ones); }, {parse_api, "header length 18446744073709551615 exceeds the limit"});

  require_parse_error("", 0, "invalid JSON at byte 0: unexpected end of input");
  require_parse_error("{\"w\":", 0, "invalid JSON at byte 5: unexpected end of input");
  require_parse_error("{} {}", 0, "invalid JSON at byte 3: unexpected '{' after the value");
  require_parse_error("{\"w\":{},\"w\":{}}", 0, "invalid JSON at byte 8: duplicate key");
  require_parse_error("{\"\xff\":{}}", 0, "invalid JSON at byte 2: invalid UTF-8 in a string");
  require_parse_error("[]", 0, "the header is a JSON array, expected an object");
  require_parse_error("\"x\"", 0, "the header is a JSON string, expected an object");
  require_parse_error("{\"w\":5}", 0,
                      "tensor 'w': entry is a JSON integer, expected an object with dtype, shape and data_offsets");
  require_parse_error(one(w + ",\"extra\":1"), 8,
                      "tensor 'w': unknown field 'extra' (expected dtype, shape and data_offsets)");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[2]"), 8, "tensor 'w': missing field 'data_offsets'");
  require_parse_error(one("\"shape\":[2],\"data_offsets\":[0,8]"), 8, "tensor 'w': missing field 'dtype'");
  require_parse_error(one("\"dtype\":5,\"shape\":[2],\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': field 'dtype' is a JSON integer, expected string");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': field 'shape' is a JSON string, expected array");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{}"), 8,
                      "tensor 'w': field 'data_offsets' is a JSON object, expected array");
  require_parse_error(one("\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': dtype 'Q4' is not supported (expected BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, "
                      "F16, BF16, I32, U32, F32, F64, I64, U64)");
  require_parse_error(one("\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]"), 8, "dtype 'f32' is not supported");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': shape element 1 is -1, expected a non-negative integer");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': shape element 0 is number, expected a non-negative integer");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': shape element 0 is string");
  for (const char* offsets : {"[0]", "[0,8,8]", "[-1,8]", "[0,8.0]", "[0,null]", "[]"}) {
    require_parse_error(one(std::string("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":") + offsets), 8,
                        "tensor 'w': data_offsets must be [begin, end] with two non-negative integers");
  }
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]"), 8,
                      "number 99999999999999999999 is out of range");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]"), 8,
                      "tensor 'w': data_offsets [8, 0] begin > end");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]"), 8,
                      "tensor 'w': data_offsets [0, 16] end exceeds the data buffer of 8 bytes (truncated file?)");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]"), 8,
                      "tensor 'w': data holds 8 bytes but shape [3] of F32 needs 12");
  require_parse_error(one("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]"), 0,
                      "tensor 'w': shape [4294967296, 4294967296] of F32 overflows the addressable size");
  require_parse_error(one("\"dtype\":\"U8\",\"shape\":[4611686018427387904,2],\"data_offsets\":[0,0]"), 0,
                      "shape [4611686018427387904, 2] of U8 overflows");  // 2^63 elements
  require_parse_error(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
      12, "tensors 'a' [0, 8] and 'b' [4, 12] overlap");
  require_parse_error(
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[3,5]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[10],\"data_offsets\":[0,10]}}",
      12, "tensors 'b' [0, 10] and 'a' [3, 5] overlap");
  require_parse_error("{\"__metadata__\":[]}", 0, "__metadata__ is a JSON array, expected an object of strings");
  require_parse_error("{\"__metadata__\":{\"n\":1}}", 0,
                      "__metadata__ value of 'n' is a JSON integer, expected a string");
  // A hostile name is quoted on one line (require_error checks that there is no newline).
  require_parse_error("{\"a\\nb\":5}", 0, "tensor 'a\\x0ab': entry is a JSON integer");
}

TEST_CASE("safetensors: serialize rejects what it could not read back") {
  const std::vector<std::byte> eight(8);
  const auto err = [&](std::vector<io::safetensors_entry> entries, const metadata_t& metadata,
                       std::string_view problem) {
    require_error([&] { io::serialize_safetensors(entries, metadata); },
                  {"triattn::io::serialize_safetensors: ", problem});
  };
  err({{"w", "F31", {2}, eight}}, {}, "tensor 'w': dtype 'F31' is not supported");
  err({{"w", "F32", {3}, eight}}, {}, "tensor 'w': data holds 8 bytes but shape [3] of F32 needs 12");
  err({{"w", "F32", {-2}, eight}}, {}, "tensor 'w': shape [-2] has a negative dimension -2");
  err({{"w", "F32", {2}, eight}, {"w", "I64", {1}, eight}}, {}, "tensor 'w': the name appears twice");
  err({{"__metadata__", "F32", {2}, eight}}, {}, "tensor '__metadata__': the name is reserved for the metadata");
  err({{"bad\xff", "F32", {2}, eight}}, {}, "the name is not valid UTF-8");
  err({}, {{"k", "\xc3"}}, "__metadata__ entry 'k' is not valid UTF-8");
}

TEST_CASE("safetensors: write_safetensors and read") {
  triattn_test::scratch_dir dir;
  const std::vector<float> values = {1, 2, 3};
  const auto data = raw(values);
  const std::vector<io::safetensors_entry> entries = {{"q", "F32", {3}, data}};
  const auto path = dir.path() / "stats.safetensors";
  io::write_safetensors(path, entries, {{"format", "triattn.stats.v1"}});
  CHECK(dir.files() == std::vector<std::string>{"stats.safetensors"});
  const io::safetensors_file f = io::safetensors_file::read(path);
  CHECK(f.name() == path.string());
  CHECK(f.metadata().at("format") == "triattn.stats.v1");
  CHECK(io::tensor_to_float(f.get("q"), "q") == values);

  // A rejected entry writes nothing and leaves the old file alone.
  const std::vector<io::safetensors_entry> bad = {{"q", "F32", {4}, data}};
  require_error([&] { io::write_safetensors(path, bad, {}); },
                {"triattn::io::write_safetensors: " + path.string() +
                 ": tensor 'q': data holds 12 bytes but shape [4] of F32 needs 16"});
  CHECK(dir.files() == std::vector<std::string>{"stats.safetensors"});
  CHECK(io::safetensors_file::read(path).metadata().at("format") == "triattn.stats.v1");

  const auto nowhere = dir.path() / "missing" / "s.safetensors";
  require_error([&] { io::write_safetensors(nowhere, entries, {}); },
                {"triattn::io::write_safetensors: " + nowhere.string() + ": cannot create "});
  CHECK(dir.files() == std::vector<std::string>{"stats.safetensors"});

  require_error(
      [&] { io::safetensors_file::read(dir.path() / "none.safetensors"); },
      {"triattn::io::safetensors_file::read: " + (dir.path() / "none.safetensors").string() + ": cannot read: "});
  const auto truncated = dir.path() / "cut.safetensors";
  {
    const auto bytes = io::serialize_safetensors(entries, {});
    std::ofstream(truncated, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size() - 1));
  }
  require_error([&] { io::safetensors_file::read(truncated); },
                {"triattn::io::safetensors_file::read: " + truncated.string() +
                 ": tensor 'q': data_offsets [0, 12] end exceeds the data buffer of 11 bytes (truncated file?)"});
}
