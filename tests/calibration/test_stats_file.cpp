// The triattn.stats.v1 file: bit-exact round trips (through a file and in memory), and every
// malformed field of a hand-built file reported by name.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/safetensors.hpp"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using triattn::query_stats;
using triattn::io::safetensors_entry;

/// A fresh folder under the system's temporary folder, removed at scope exit.
struct temp_dir {
  fs::path path;
  temp_dir() {
    path = fs::temp_directory_path() / ("triattn_stats_test_" + std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
};

/// Random stats whose floats exercise the bit patterns a text format would lose: subnormals,
/// -0, extremes, and doubles that no float holds.
query_stats random_stats(std::mt19937_64& g) {
  query_stats s;
  s.num_layers = 3;
  s.num_q_heads = 6;
  s.num_kv_heads = 2;
  s.head_dim = 10;
  s.style = triattn::rope_style::interleaved;
  s.attention_scale = 0.1 * std::log(32.0) + 1.0;
  std::uniform_real_distribution<double> w(1e-6, 1.0);
  for (int f = 0; f < s.num_bands(); ++f) s.inv_freq.push_back(w(g));
  const std::size_t n = s.row(s.num_layers, 0);
  s.q_mean_real = triattn_test::normal_floats(g, n);
  s.q_mean_imag = triattn_test::normal_floats(g, n);
  s.q_abs_mean = triattn_test::normal_floats(g, n);
  for (float& m : s.q_abs_mean) m = std::abs(m);  // a mean modulus is never negative
  s.q_mean_real[0] = -0.0f;
  s.q_mean_real[1] = std::numeric_limits<float>::denorm_min();
  s.q_mean_imag[2] = std::numeric_limits<float>::max();
  s.q_abs_mean[3] = std::numeric_limits<float>::min();
  s.info = {{"model", "test/model \"quoted\" \xc3\xa9"}, {"num_tokens", "123"}, {"source", "unit test"}, {"x", ""}};
  return s;
}

bool same_bits(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return same_bits(std::as_bytes(std::span(a)), std::as_bytes(std::span(b)));
}

void require_identical(const query_stats& a, const query_stats& b) {
  CHECK(a.num_layers == b.num_layers);
  CHECK(a.num_q_heads == b.num_q_heads);
  CHECK(a.num_kv_heads == b.num_kv_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.style == b.style);
  CHECK(same_bits(std::vector<double>{a.attention_scale}, std::vector<double>{b.attention_scale}));
  CHECK(same_bits(a.inv_freq, b.inv_freq));
  CHECK(same_bits(a.q_mean_real, b.q_mean_real));
  CHECK(same_bits(a.q_mean_imag, b.q_mean_imag));
  CHECK(same_bits(a.q_abs_mean, b.q_abs_mean));
  CHECK(a.info == b.info);
}

/// A file built tensor by tensor, so that a test can break any one part of it.
struct raw_file {
  std::map<std::string, std::string> metadata{
      {"format", "triattn.stats.v1"}, {"rope_style", "half"}, {"num_kv_heads", "2"}, {"attention_scale", "1"}};
  std::vector<std::int64_t> q_shape{2, 4, 4};
  std::vector<float> q = std::vector<float>(32, 0.5f);
  std::vector<double> w{1.0, 0.1, 0.01, 0.001};
  std::vector<safetensors_entry> entries;

  raw_file(const raw_file&) = delete;  // the entries point into this object's vectors
  raw_file& operator=(const raw_file&) = delete;
  raw_file() {
    const auto q_bytes = std::as_bytes(std::span(q));
    entries = {{"q_mean_real", "F32", q_shape, q_bytes},
               {"q_mean_imag", "F32", q_shape, q_bytes},
               {"q_abs_mean", "F32", q_shape, q_bytes},
               {"inv_freq", "F64", {4}, std::as_bytes(std::span(w))}};
  }
  safetensors_entry& entry(const std::string& name) {
    for (auto& e : entries)
      if (e.name == name) return e;
    FAIL("no entry " << name);
    return entries.front();
  }
  void remove(const std::string& name) {
    std::erase_if(entries, [&](const auto& e) { return e.name == name; });
  }
  std::vector<std::byte> bytes() const { return triattn::io::serialize_safetensors(entries, metadata); }
};

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const triattn::error& e) {
    return e.what();
  }
  return "no error";
}

std::string parse_error(const raw_file& f) {
  return error_of([&] { triattn::parse_stats(f.bytes(), "S.safetensors"); });
}

}  // namespace

TEST_CASE("save_stats / load_stats round trip is bit-exact", "[stats_file]") {
  auto g = triattn_test::rng(10);
  const query_stats s = random_stats(g);
  temp_dir dir;
  const fs::path path = dir.path / "s.safetensors";
  triattn::save_stats(path, s);
  const query_stats loaded = triattn::load_stats(path);
  require_identical(s, loaded);

  // In memory, deterministic, and a reload re-serializes to the same bytes.
  const std::vector<std::byte> bytes = triattn::serialize_stats(s);
  require_identical(s, triattn::parse_stats(bytes, "mem"));
  CHECK(bytes == triattn::serialize_stats(s));
  CHECK(bytes == triattn::serialize_stats(loaded));

  // The tensors are what the format says: inv_freq F64, the rest F32 [layers, q_heads, bands].
  const auto f = triattn::io::safetensors_file::read(path);
  CHECK(f.get("inv_freq").dtype == "F64");
  CHECK(f.get("q_mean_imag").shape == std::vector<std::int64_t>{3, 6, 5});
  CHECK(f.metadata().at("format") == "triattn.stats.v1");
  CHECK(f.metadata().at("rope_style") == "interleaved");
  CHECK(f.metadata().at("num_kv_heads") == "2");
  CHECK(f.metadata().at("model") == s.info.at("model"));
}

TEST_CASE("load_stats accepts inv_freq as F32 and a missing attention_scale", "[stats_file]") {
  raw_file f;
  const std::vector<float> w32{1.0f, 0.1f, 0.01f, 0.001f};
  f.entry("inv_freq") = {"inv_freq", "F32", {4}, std::as_bytes(std::span(w32))};
  f.metadata.erase("attention_scale");
  f.metadata["source"] = "hand-built";
  const query_stats s = triattn::parse_stats(f.bytes(), "S.safetensors");
  CHECK(s.attention_scale == 1.0);
  CHECK(s.inv_freq[1] == double{0.1f});
  CHECK(s.num_layers == 2);
  CHECK(s.num_q_heads == 4);
  CHECK(s.head_dim == 8);
  CHECK(s.style == triattn::rope_style::half);
  CHECK(s.info == std::map<std::string, std::string>{{"source", "hand-built"}});
}

TEST_CASE("every malformed field of a stats file is reported by name", "[stats_file][errors]") {
  const std::vector<float> q3(24, 0.5f);
  const std::vector<double> w3{1.0, 0.1, 0.01};
  const std::vector<double> q64(32, 0.5);
  const std::vector<std::uint16_t> w16(4, 0x3c00);
  const std::vector<float> q2d(32, 0.5f);

  // Replaces one tensor of a valid file and returns the parse error.
  const auto with_tensor = [](const safetensors_entry& e) {
    raw_file f;
    f.entry(e.name) = e;
    return parse_error(f);
  };
  SECTION("shapes") {
    CHECK_THAT(with_tensor({"q_abs_mean", "F32", {2, 4, 3}, std::as_bytes(std::span(q3))}),
               Contains("triattn::parse_stats: S.safetensors: q_abs_mean has shape [2, 4, 3], "
                        "expected [2, 4, 4] (from q_mean_real)"));
    CHECK_THAT(with_tensor({"q_mean_real", "F32", {8, 4}, std::as_bytes(std::span(q2d))}),
               Contains("S.safetensors: q_mean_real has shape [8, 4], expected [num_layers"));
    CHECK_THAT(with_tensor({"inv_freq", "F64", {3}, std::as_bytes(std::span(w3))}),
               Contains("S.safetensors: inv_freq has shape [3], expected [4] (from q_mean_real)"));
  }
  SECTION("dtypes") {
    CHECK_THAT(with_tensor({"q_mean_imag", "F64", {2, 4, 4}, std::as_bytes(std::span(q64))}),
               Contains("S.safetensors: q_mean_imag has dtype F64, expected F32"));
    CHECK_THAT(with_tensor({"inv_freq", "F16", {4}, std::as_bytes(std::span(w16))}),
               Contains("S.safetensors: inv_freq has dtype F16, expected F32 or F64"));
  }
  SECTION("missing and unexpected tensors") {
    for (const char* name : {"q_mean_real", "q_mean_imag", "q_abs_mean", "inv_freq"}) {
      raw_file f;
      f.remove(name);
      CHECK_THAT(parse_error(f), Contains(std::string("S.safetensors: tensor ") + name + " is missing"));
    }
    raw_file f;
    f.entries.push_back({"k_mean", "F32", f.q_shape, std::as_bytes(std::span(f.q))});
    CHECK_THAT(parse_error(f), Contains("S.safetensors: unexpected tensor k_mean"));
  }
  SECTION("metadata") {
    const auto with = [](const std::string& key, const char* value) {
      raw_file f;
      if (value == nullptr) {
        f.metadata.erase(key);
      } else {
        f.metadata[key] = value;
      }
      return parse_error(f);
    };
    CHECK_THAT(with("format", nullptr), Contains("S.safetensors: metadata format is missing"));
    CHECK_THAT(with("format", "foo"), Contains("S.safetensors: metadata format \"foo\" is not triattn.stats.v1"));
    CHECK_THAT(with("rope_style", nullptr), Contains("metadata rope_style is missing"));
    CHECK_THAT(with("rope_style", "neox"), Contains("metadata rope_style \"neox\" is not half or interleaved"));
    CHECK_THAT(with("num_kv_heads", nullptr), Contains("metadata num_kv_heads is missing"));
    for (const char* bad : {"x", "0", "-2", "+2", " 2", "2.0", "2x", "", "99999999999"})
      CHECK_THAT(with("num_kv_heads", bad),
                 Contains(std::string("metadata num_kv_heads \"") + bad + "\" is not a positive decimal"));
    for (const char* bad : {"abc", "0", "-1", "inf", "nan", "1.5x", ""})
      CHECK_THAT(with("attention_scale", bad),
                 Contains(std::string("metadata attention_scale \"") + bad + "\" is not a positive decimal"));
    CHECK_THAT(
        with("num_kv_heads", "3"),
        Contains("S.safetensors: num_q_heads 4 (from q_mean_real) is not a multiple of metadata num_kv_heads 3"));
  }
  SECTION("values") {
    std::vector<float> bad(32, 0.5f);
    bad[5] = std::nanf("");
    CHECK_THAT(with_tensor({"q_abs_mean", "F32", {2, 4, 4}, std::as_bytes(std::span(bad))}),
               Contains("triattn::parse_stats") && Contains("q_abs_mean[5] = nan is not finite"));
    raw_file f;
    f.w[2] = -0.5;
    CHECK_THAT(parse_error(f), Contains("inv_freq[2] = -0.5"));
  }
  SECTION("corrupt files name the file") {
    std::vector<std::byte> bytes = raw_file().bytes();
    bytes.erase(bytes.end() - 3, bytes.end());  // truncated
    CHECK_THAT(error_of([&] { triattn::parse_stats(bytes, "S.safetensors"); }), Contains("S.safetensors"));
    std::vector<std::byte> garbage(64, std::byte{0x7b});
    CHECK_THAT(error_of([&] { triattn::parse_stats(garbage, "G.safetensors"); }), Contains("G.safetensors"));
    temp_dir dir;
    CHECK_THAT(error_of([&] { triattn::load_stats(dir.path / "absent.safetensors"); }), Contains("absent.safetensors"));
    // load_stats names itself and the path.
    raw_file f;
    f.metadata["format"] = "foo";
    const fs::path path = dir.path / "S.safetensors";
    triattn::io::write_safetensors(path, f.entries, f.metadata);
    CHECK_THAT(error_of([&] { triattn::load_stats(path); }),
               Contains("triattn::load_stats: " + path.string() + ": metadata format \"foo\""));
  }
}

TEST_CASE("save_stats refuses invalid stats and reserved info keys before writing", "[stats_file][errors]") {
  auto g = triattn_test::rng(11);
  temp_dir dir;
  const fs::path path = dir.path / "s.safetensors";
  query_stats s = random_stats(g);
  s.q_mean_imag.pop_back();
  CHECK_THAT(error_of([&] { triattn::save_stats(path, s); }),
             Contains("triattn::save_stats") && Contains("q_mean_imag holds 89 values"));
  s = random_stats(g);
  s.info["format"] = "other";
  CHECK_THAT(error_of([&] { triattn::save_stats(path, s); }),
             Contains("triattn::save_stats") && Contains("info key format is reserved"));
  s.info.erase("format");
  s.info["num_kv_heads"] = "1";
  CHECK_THAT(error_of([&] { triattn::serialize_stats(s); }),
             Contains("triattn::serialize_stats") && Contains("info key num_kv_heads is reserved"));
  CHECK_FALSE(fs::exists(path));
}
