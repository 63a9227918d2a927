// .npy files: byte-exact np.save output, round trips of every kind and shape, the header
// grammar numpy writes (versions 1.0, 2.0, 3.0; any key order, quotes, commas, whitespace),
// and one test per validation rule whose message names the API, the file and the value.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "support/npy_bytes.hpp"
#include "support/random.hpp"
#include "test_helpers.hpp"
#include "triattn/core/dtype.hpp"
#include "triattn/io/npy.hpp"

namespace {

namespace io = triattn::io;
using io::element_kind;
using shape_t = std::vector<std::int64_t>;
using triattn_test::bytes_of;
using triattn_test::npy_file;
using triattn_test::require_error;

const char* const parse_api = "triattn::io::parse_npy: K.npy: ";

std::vector<std::byte> zeros(std::size_t n) { return std::vector<std::byte>(n); }

io::npy_array parse(const std::vector<std::byte>& b) { return io::parse_npy(b, "K.npy"); }

void require_parse_error(const std::vector<std::byte>& b, std::string_view problem) {
  require_error([&] { parse(b); }, {std::string(parse_api), problem});
}

/// A header dict with a well-formed shape around `body`, for the error tests.
std::vector<std::byte> f32_file(std::string_view dict, std::size_t data_bytes) {
  return npy_file(1, dict, zeros(data_bytes));
}

/// Random element bytes for `kind`: values a real file would hold.
std::vector<std::byte> random_elements(element_kind kind, std::size_t n, std::mt19937_64& g) {
  std::vector<std::byte> out(n * io::element_bytes(kind));
  const auto put = [&](std::size_t i, const auto& v) { std::memcpy(out.data() + i * sizeof v, &v, sizeof v); };
  std::normal_distribution<double> normal(0.0, 100.0);
  for (std::size_t i = 0; i < n; ++i) {
    switch (kind) {
      case element_kind::f16:
        put(i, triattn::float_to_half_bits(static_cast<float>(normal(g))));
        break;
      case element_kind::f32:
        put(i, static_cast<float>(normal(g)));
        break;
      case element_kind::f64:
        put(i, normal(g));
        break;
      case element_kind::i32:
        put(i, static_cast<std::int32_t>(g()));
        break;
      case element_kind::i64:
        put(i, static_cast<std::int64_t>(g()));
        break;
    }
  }
  return out;
}

const element_kind all_kinds[] = {element_kind::f16, element_kind::f32, element_kind::f64, element_kind::i32,
                                  element_kind::i64};

}  // namespace

TEST_CASE("npy: element kinds") {
  CHECK(io::element_bytes(element_kind::f16) == 2);
  CHECK(io::element_bytes(element_kind::f32) == 4);
  CHECK(io::element_bytes(element_kind::f64) == 8);
  CHECK(io::element_bytes(element_kind::i32) == 4);
  CHECK(io::element_bytes(element_kind::i64) == 8);
  CHECK(std::string(io::element_kind_name(element_kind::f16)) == "float16");
  CHECK(std::string(io::element_kind_name(element_kind::f32)) == "float32");
  CHECK(std::string(io::element_kind_name(element_kind::f64)) == "float64");
  CHECK(std::string(io::element_kind_name(element_kind::i32)) == "int32");
  CHECK(std::string(io::element_kind_name(element_kind::i64)) == "int64");
}

TEST_CASE("npy: serialize_npy writes exactly what np.save writes") {
  // np.save(f, np.array([1, 2, 3], dtype=np.float32)) with numpy 2.4: 140 bytes.
  const std::string expected = std::string("\x93NUMPY\x01\x00\x76\x00", 10) +
                               "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }" + std::string(60, ' ') +
                               "\n" + std::string("\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x00\x40\x40", 12);
  REQUIRE(expected.size() == 140);
  const float values[] = {1.0f, 2.0f, 3.0f};
  const shape_t shape = {3};
  CHECK(triattn_test::text_of(io::serialize_npy(element_kind::f32, shape, values)) == expected);

  const io::npy_array a = parse(bytes_of(expected));
  CHECK(a.kind == element_kind::f32);
  CHECK(a.shape == shape);
  CHECK(a.to_float() == std::vector<float>{1.0f, 2.0f, 3.0f});
}

TEST_CASE("npy: header padding matches numpy for every shape length") {
  // (kind, shape, the spaces numpy puts between the dict and the final newline, total header
  // bytes incl. the 10-byte prefix), all measured with np.save (numpy 2.4). The spaces are
  // the growth room for the first axis (21 - its digits) plus the padding to a multiple of
  // 64; the last case is the one where numpy pads a full 64 bytes.
  struct row {
    element_kind kind;
    shape_t shape;
    std::string dict_shape;
    std::size_t spaces;
    std::size_t total;
  };
  const auto tuple_text = [](const shape_t& shape) {  // repr() of a shape of two or more dims
    std::string s = "(";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i > 0 ? ", " : "") + std::to_string(shape[i]);
    return s + ")";
  };
  const shape_t thirty_ones(30, 1);
  shape_t zero_then_ones(36, 1);
  zero_then_ones[0] = 0;
  const row rows[] = {
      {element_kind::f32, {3}, "(3,)", 60, 128},
      {element_kind::f16, {}, "()", 62, 128},
      {element_kind::i64, {0, 3}, "(0, 3)", 58, 128},
      {element_kind::f64, {2, 3, 4}, "(2, 3, 4)", 55, 128},
      {element_kind::i32, thirty_ones, tuple_text(thirty_ones), 38, 192},
      {element_kind::f32, zero_then_ones, tuple_text(zero_then_ones), 84, 256},
  };
  std::mt19937_64 g = triattn_test::rng(1);
  for (const row& r : rows) {
    const std::string dict = std::string("{'descr': '") + io::detail::npy_descr(r.kind) +
                             "', 'fortran_order': False, 'shape': " + r.dict_shape + ", }";
    const std::string header = dict + std::string(r.spaces, ' ') + "\n";
    REQUIRE(10 + header.size() == r.total);
    std::int64_t n = 1;
    for (const auto d : r.shape) n *= d;
    const auto data = random_elements(r.kind, static_cast<std::size_t>(n), g);
    const auto file = io::serialize_npy(r.kind, r.shape, data.data());
    CHECK(triattn_test::text_of(file) == triattn_test::text_of(npy_file(1, header, data)));
  }
}

TEST_CASE("npy: round trip of every kind and shape") {
  std::mt19937_64 g = triattn_test::rng(2);
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const shape_t shapes[] = {
      {},       {0},      {1},       {7},     {2, 0, 3}, {2, 3, 4}, {3, 1, 5, 1}, shape_t(30, 1), shape_t(64, 1),
      {0, big}, {big, 0}, {1 << 16}, {257, 3}};
  for (const element_kind kind : all_kinds) {
    for (const shape_t& shape : shapes) {
      INFO(io::element_kind_name(kind) << " " << io::detail::shape_string(shape));
      std::int64_t n = 1;
      for (const auto d : shape) n *= d;
      const auto data = random_elements(kind, static_cast<std::size_t>(n), g);
      const auto file = io::serialize_npy(kind, shape, data.data());
      const std::size_t header_total = file.size() - data.size();
      CHECK(header_total % 64 == 0);   // numpy's ARRAY_ALIGN
      CHECK(file[6] == std::byte{1});  // version 1.0
      CHECK(file[7] == std::byte{0});
      CHECK(file[header_total - 1] == static_cast<std::byte>('\n'));
      const io::npy_array a = parse(file);
      CHECK(a.kind == kind);
      CHECK(a.shape == shape);
      CHECK(a.size() == n);
      CHECK(a.data == data);
      const bool is_float = kind == element_kind::f16 || kind == element_kind::f32 || kind == element_kind::f64;
      if (is_float) {
        const std::vector<float> f = a.to_float();
        REQUIRE(f.size() == static_cast<std::size_t>(n));
        for (std::size_t i = 0; i < f.size(); ++i) {
          float expect = 0;
          if (kind == element_kind::f16) {
            std::uint16_t h;
            std::memcpy(&h, data.data() + 2 * i, 2);
            expect = triattn::half_bits_to_float(h);
          } else if (kind == element_kind::f32) {
            std::memcpy(&expect, data.data() + 4 * i, 4);
          } else {
            double d;
            std::memcpy(&d, data.data() + 8 * i, 8);
            expect = static_cast<float>(d);
          }
          if (f[i] != expect) FAIL("element " << i << ": " << f[i] << " != " << expect);
        }
      } else {
        const std::vector<std::int64_t> v = a.to_int64();
        REQUIRE(v.size() == static_cast<std::size_t>(n));
        for (std::size_t i = 0; i < v.size(); ++i) {
          std::int64_t expect = 0;
          if (kind == element_kind::i32) {
            std::int32_t x;
            std::memcpy(&x, data.data() + 4 * i, 4);
            expect = x;
          } else {
            std::memcpy(&expect, data.data() + 8 * i, 8);
          }
          if (v[i] != expect) FAIL("element " << i << ": " << v[i] << " != " << expect);
        }
      }
    }
  }
}

TEST_CASE("npy: versions 1.0, 2.0 and 3.0 and every header style numpy could write") {
  std::mt19937_64 g = triattn_test::rng(3);
  const auto data = random_elements(element_kind::f32, 6, g);
  const std::string entries[] = {"'descr': '<f4'", "'fortran_order': False", "'shape': (2, 3)"};
  const int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  std::vector<std::string> dicts;
  for (const auto& o : orders) {
    const std::string body = entries[o[0]] + ", " + entries[o[1]] + ", " + entries[o[2]];
    dicts.push_back("{" + body + "}");
    dicts.push_back("{" + body + ", }" + std::string(17, ' ') + "\n");
  }
  dicts.push_back(R"({"descr": "<f4", "fortran_order": False, "shape": (2, 3)})");
  dicts.push_back(R"({"descr": '<f4', 'fortran_order': False, "shape": (2, 3,),})");
  dicts.push_back("  {\n\t'shape' :( 2 ,\t3 , ) ,'descr':'<f4'\r\n,'fortran_order'  :False ,\n}\n\n  ");
  dicts.push_back("{'descr':'<f4','fortran_order':False,'shape':(2,3)}");
  for (const int major : {1, 2, 3}) {
    for (const std::string& dict : dicts) {
      INFO("version " << major << ".0, header: " << dict);
      const io::npy_array a = parse(npy_file(major, dict, data));
      CHECK(a.kind == element_kind::f32);
      CHECK(a.shape == shape_t{2, 3});
      CHECK(a.data == data);
    }
  }
  // The shape forms: 0-d, 1-d (with its mandatory comma), n-d with an optional comma.
  const std::pair<std::string, shape_t> forms[] = {
      {"()", {}}, {"( )", {}}, {"(4,)", {4}}, {"(4 , )", {4}}, {"(1, 4)", {1, 4}}, {"(1, 4,)", {1, 4}}, {"(0,)", {0}}};
  for (const auto& [text, shape] : forms) {
    INFO("shape " << text);
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    const io::npy_array a =
        parse(npy_file(1, "{'descr': '<i8', 'fortran_order': False, 'shape': " + text + "}", zeros(8 * n)));
    CHECK(a.shape == shape);
  }
}

TEST_CASE("npy: every validation rule names the API, the file and the value") {
  const std::string ok_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  const auto ok = npy_file(1, ok_dict, zeros(24));
  REQUIRE(parse(ok).shape == shape_t{2, 3});

  // The prefix.
  require_parse_error(bytes_of("\x93NUMP"), "file is 5 bytes, too short for a .npy header");
  require_parse_error({}, "file is 0 bytes");
  auto bad_magic = ok;
  bad_magic[5] = std::byte{'X'};
  require_parse_error(bad_magic, "not a .npy file (no \\x93NUMPY magic)");
  for (const auto& [major, minor, text] : {std::tuple{4, 0, "4.0"}, std::tuple{1, 1, "1.1"}, std::tuple{0, 0, "0.0"}}) {
    auto v = ok;
    v[6] = static_cast<std::byte>(major);
    v[7] = static_cast<std::byte>(minor);
    require_parse_error(v, std::string("format version ") + text + " is not supported (expected 1.0, 2.0 or 3.0)");
  }
  require_parse_error(std::vector<std::byte>(ok.begin(), ok.begin() + 9),
                      "file is 9 bytes, too short for a version 1.0 header length");
  const auto v2 = npy_file(2, ok_dict);
  require_parse_error(std::vector<std::byte>(v2.begin(), v2.begin() + 11),
                      "file is 11 bytes, too short for a version 2.0 header length");
  auto huge = npy_file(2, "");
  huge[8] = std::byte{0};
  huge[9] = std::byte{0};
  huge[10] = std::byte{0x20};  // 0x200000 = 2 MiB
  require_parse_error(huge, "header length 2097152 exceeds the limit of 1048576 bytes");
  auto long_len = ok;
  long_len[8] = std::byte{0xff};
  long_len[9] = std::byte{0x00};
  require_parse_error(long_len, "header length 255 exceeds the " + std::to_string(ok.size() - 10) +
                                    " bytes after the header length field (truncated file?)");

  // The header grammar.
  const auto dict_error = [](std::string_view dict, std::string_view problem) {
    INFO("header: " << std::string(dict));
    require_parse_error(f32_file(dict, 24), problem);
  };
  dict_error("['descr']", "malformed header at byte 0: expected '{', found '['");
  dict_error("{'descr': '<f4', 'fortran_order': False}", "header has no 'shape' key");
  dict_error("{'shape': (2, 3), 'fortran_order': False}", "header has no 'descr' key");
  dict_error("{'descr': '<f4', 'shape': (2, 3)}", "header has no 'fortran_order' key");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'foo': 1}",
             "unknown key 'foo' (expected 'descr', 'fortran_order' and 'shape')");
  dict_error("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", "duplicate key 'descr'");
  dict_error("{'descr' '<f4'}", "expected ':', found '''");
  dict_error("{'descr': '<f4' 'shape': (2, 3)}", "expected ',' or '}', found '''");
  dict_error("{'descr': '<f4, 'fortran_order': False, 'shape': (2, 3)}", "expected ',' or '}', found 'f'");
  dict_error("{'descr': '<f4", "unterminated string");
  dict_error("{'descr': '<\\x66\\x34'}", "escape sequences are not supported");
  dict_error("{'descr': '<f\xc3\xa9'}", "unexpected byte 0xc3 in a string");
  dict_error("{'descr': '<f4',,}", "expected a quoted string, found ','");
  dict_error("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", "expected a quoted string, found '['");
  dict_error("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3)}", "fortran_order must be True or False, found '0'");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}", "expected '(', found '['");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (6)}",
             "shape (6) is not a tuple: a 1-d shape needs a trailing comma");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3}", "expected ',' or ')' in the shape, found '}'");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x)}", "expected a dimension, found 'x'");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (02, 3)}", "leading zero in a dimension");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3)}", "negative dimension -3 in the shape");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}",
             "dimension 99999999999999999999 does not fit in int64");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} x", "unexpected 'x' after the dict");
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)", "expected ',' or '}', found end of header");
  std::string many = "{'descr': '<f4', 'fortran_order': False, 'shape': (1";
  for (int i = 1; i < 65; ++i) many += ", 1";
  dict_error(many + ")}", "more than 64 dimensions");

  // The values.
  dict_error("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3)}",
             "fortran_order True is not supported (C order only)");
  dict_error("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3)}",
             "dtype '>f4' is big-endian; only little-endian ('<') is supported");
  for (const char* descr : {"<i2", "|u1", "|f4", "=f4", "<f16", "<c8", "f4", ""}) {
    dict_error(std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (2, 3)}",
               std::string("dtype '") + descr + "' is not supported (expected <f2, <f4, <f8, <i4 or <i8)");
  }
  dict_error("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}",
             "shape [4294967296, 4294967296] of float32 overflows the addressable size");
  dict_error("{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,)}",
             "shape [2305843009213693952] of float64 overflows the addressable size");  // 2^61 * 8 = 2^64

  // The data.
  require_parse_error(f32_file(ok_dict, 20), "data is 20 bytes but shape [2, 3] of float32 needs 24 (truncated file)");
  require_parse_error(f32_file(ok_dict, 0), "data is 0 bytes but shape [2, 3] of float32 needs 24");
  require_parse_error(f32_file(ok_dict, 28), "4 trailing bytes after the 24 bytes of data of shape [2, 3]");
}

TEST_CASE("npy: conversions check the kind and the data size") {
  io::npy_array ints{element_kind::i32, {2}, zeros(8)};
  require_error([&] { (void)ints.to_float(); },
                {"triattn::io::npy_array::to_float: the array holds int32, not floats"});
  io::npy_array floats{element_kind::f16, {2}, zeros(4)};
  require_error([&] { (void)floats.to_int64(); },
                {"triattn::io::npy_array::to_int64: the array holds float16, not integers"});
  io::npy_array short_data{element_kind::f32, {2, 2}, zeros(12)};
  require_error([&] { (void)short_data.to_float(); },
                {"triattn::io::npy_array::to_float: data holds 12 bytes but shape [2, 2] of float32 needs 16"});
  io::npy_array zero_d{element_kind::i64, {}, zeros(8)};
  CHECK(zero_d.size() == 1);
  CHECK(zero_d.to_int64() == std::vector<std::int64_t>{0});
}

TEST_CASE("npy: check_shape") {
  const io::npy_array a{element_kind::f32, {2, 8, 100, 128}, {}};
  io::check_shape(a, shape_t{2, 8, 100, 128}, "K.npy", "keys");
  io::check_shape(a, shape_t{-1, 8, -1, 128}, "K.npy", "keys");
  require_error(
      [&] {
        io::check_shape(a, shape_t{2, 8, -1, 64}, "K.npy", "keys");
      },
      {"triattn::io::check_shape: K.npy: keys has shape [2, 8, 100, 128] but expected [2, 8, *, 64]"});
  require_error(
      [&] {
        io::check_shape(a, shape_t{2, 8, 100}, "K.npy", "keys");
      },
      {"triattn::io::check_shape: K.npy: keys has shape [2, 8, 100, 128] but expected [2, 8, 100]"});
  const io::npy_array scalar{element_kind::f32, {}, {}};
  io::check_shape(scalar, shape_t{}, "s.npy", "scale");
  require_error([&] { io::check_shape(scalar, shape_t{-1}, "s.npy", "scale"); },
                {"triattn::io::check_shape: s.npy: scale has shape [] but expected [*]"});
}

TEST_CASE("npy: serialize_npy rejects invalid arrays") {
  const float x[4] = {};
  const auto err = [&](element_kind kind, const shape_t& shape, const void* data, std::string_view problem) {
    require_error([&] { io::serialize_npy(kind, shape, data); }, {"triattn::io::serialize_npy: ", problem});
  };
  err(element_kind::f32, {2, -1}, x, "shape [2, -1] has a negative dimension -1");
  err(element_kind::f32, {1LL << 40, 1LL << 40}, x, "shape [1099511627776, 1099511627776] of float32 overflows");
  err(element_kind::f32, {3}, nullptr, "data is null but shape [3] holds 12 bytes");
  err(element_kind::f32, shape_t(65, 1), x, "shape has 65 dimensions (at most 64)");
  err(static_cast<element_kind>(9), {1}, x, "invalid element_kind 9");
  CHECK(parse(io::serialize_npy(element_kind::f32, shape_t{0, 5}, nullptr)).shape == shape_t{0, 5});
}

TEST_CASE("npy: write_npy and read_npy") {
  triattn_test::scratch_dir dir;
  std::mt19937_64 g = triattn_test::rng(4);
  const auto data = random_elements(element_kind::f64, 12, g);
  const shape_t shape = {3, 4};
  const auto path = dir.path() / "scores.npy";
  io::write_npy(path, element_kind::f64, shape, data.data());
  CHECK(dir.files() == std::vector<std::string>{"scores.npy"});  // no temporary file left
  const io::npy_array a = io::read_npy(path);
  CHECK(a.kind == element_kind::f64);
  CHECK(a.shape == shape);
  CHECK(a.data == data);

  // Overwriting replaces the whole file.
  const std::int64_t idx[2] = {7, 9};
  io::write_npy(path, element_kind::i64, shape_t{2}, idx);
  CHECK(io::read_npy(path).to_int64() == std::vector<std::int64_t>{7, 9});
  CHECK(dir.files() == std::vector<std::string>{"scores.npy"});

  // A rejected array writes nothing and leaves the old file alone.
  require_error([&] { io::write_npy(path, element_kind::f32, shape_t{-2}, data.data()); },
                {"triattn::io::write_npy: " + path.string() + ": shape [-2] has a negative dimension -2"});
  CHECK(io::read_npy(path).to_int64() == std::vector<std::int64_t>{7, 9});
  CHECK(dir.files() == std::vector<std::string>{"scores.npy"});

  // A missing folder: nothing is created.
  const auto nowhere = dir.path() / "missing" / "x.npy";
  require_error([&] { io::write_npy(nowhere, element_kind::f32, shape_t{1}, data.data()); },
                {"triattn::io::write_npy: " + nowhere.string() + ": cannot create "});
  CHECK_FALSE(std::filesystem::exists(dir.path() / "missing"));

  // The target is a folder: refused before a temporary file exists (a rename would replace
  // whatever is not a regular file).
  std::filesystem::create_directory(dir.path() / "folder.npy");
  require_error([&] { io::write_npy(dir.path() / "folder.npy", element_kind::f32, shape_t{1}, data.data()); },
                {"triattn::io::write_npy: " + (dir.path() / "folder.npy").string() + ": is not a regular file"});
  CHECK(dir.files().size() == 2);

  // Reading: a missing file, and a bad file reported under read_npy's name.
  require_error([&] { io::read_npy(dir.path() / "none.npy"); },
                {"triattn::io::read_npy: " + (dir.path() / "none.npy").string() + ": cannot read: "});
  require_error([&] { io::read_npy(dir.path() / "folder.npy"); },
                {"triattn::io::read_npy: " + (dir.path() / "folder.npy").string() + ": cannot read: "});
  const auto bad = dir.path() / "bad.npy";
  {
    const auto bytes = npy_file(1, "{'descr': '<i2', 'fortran_order': False, 'shape': (1,)}", zeros(2));
    std::ofstream(bad, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  require_error([&] { io::read_npy(bad); }, {"triattn::io::read_npy: " + bad.string() +
                                             ": dtype '<i2' is not supported (expected <f2, <f4, <f8, <i4 or <i8)"});
}
