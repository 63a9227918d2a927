// Corrupted and truncated input.
//
// In-process: a small valid triattn.stats.v1 file (made here with serialize_stats) cut at every
// length, with bytes flipped, inserted or deleted, header digits and syntax changed and random
// header-length fields, plus well-formed safetensors files whose stats content is wrong (bad
// metadata values, dtypes, shapes, tensor sets, non-finite values). Every case goes through
// triattn::parse_stats, and every 8th also through load_stats from a file: each either loads a
// valid query_stats (which round-trips) or throws triattn::error, both paths agreeing. Anything
// else (another exception, a crash, an out-of-bounds read under ASan) fails. load_stats's
// messages name the file also for refused values (NaN, a non-positive inv_freq).
//
// Through the executable: corrupted keys .npy and stats files that the in-process parsers
// reject make `triattn score triattention` exit with status 2, print one line naming the file,
// and write nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "support/random.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/io/safetensors.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;
using bytes_t = std::vector<std::byte>;
using triattn_test::cli::check_one_line_error;
using triattn_test::cli::run_cli;
using triattn_test::cli::scratch_dir;

constexpr int layers = 2, q_heads = 4, kv_heads = 2, head_dim = 8, tokens = 12;

triattn::query_stats small_stats(std::mt19937_64& g) {
  triattn::query_stats s;
  s.num_layers = layers;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.style = triattn::rope_style::interleaved;
  s.attention_scale = 1.25;
  for (int f = 0; f < head_dim / 2; ++f) s.inv_freq.push_back(std::pow(10000.0, -2.0 * f / head_dim));
  const std::size_t n = s.row(layers, 0);
  s.q_mean_real = triattn_test::normal_floats(g, n);
  s.q_mean_imag = triattn_test::normal_floats(g, n);
  for (std::size_t i = 0; i < n; ++i)
    s.q_abs_mean.push_back(1.5f * std::hypot(s.q_mean_real[i], s.q_mean_imag[i]) + 0.05f);
  s.info["model"] = "fuzz";
  return s;
}

bool same_stats(const triattn::query_stats& a, const triattn::query_stats& b) {
  return a.num_layers == b.num_layers && a.num_q_heads == b.num_q_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.style == b.style && a.attention_scale == b.attention_scale &&
         a.inv_freq == b.inv_freq && a.q_mean_real == b.q_mean_real && a.q_mean_imag == b.q_mean_imag &&
         a.q_abs_mean == b.q_abs_mean && a.info == b.info;
}

struct tally {
  int cases = 0;
  int loaded = 0;
};

/// What a load gave: the stats, or nothing when it threw triattn::error.
std::optional<triattn::query_stats> try_parse(const bytes_t& input) {
  try {
    return triattn::parse_stats(bytes_t(input.begin(), input.end()), "fuzz.safetensors");  // an exact-size copy
  } catch (const triattn::error&) {
    return std::nullopt;
  }
}

/// One case: parse_stats (and, every 8th case, load_stats on a file) either loads stats that
/// are valid and round-trip, or throws triattn::error. Returns whether it loaded.
bool check_case(const bytes_t& input, tally& t, const scratch_dir& dir) {
  ++t.cases;
  const std::optional<triattn::query_stats> s = try_parse(input);
  if (t.cases % 8 == 0) {
    const fs::path file = dir / "case.safetensors";
    triattn_test::cli::write_bytes(file, input);
    std::optional<triattn::query_stats> from_file;
    try {
      from_file = triattn::load_stats(file);
    } catch (const triattn::error&) {
    }
    REQUIRE(from_file.has_value() == s.has_value());
    if (s) REQUIRE(same_stats(*s, *from_file));
  }
  if (!s) return false;
  ++t.loaded;
  REQUIRE_NOTHROW(s->validate("fuzz"));
  REQUIRE(s->q_mean_real.size() == s->row(s->num_layers, 0));
  REQUIRE(s->inv_freq.size() == static_cast<std::size_t>(s->num_bands()));
  const auto again = try_parse(triattn::serialize_stats(*s));
  REQUIRE(again.has_value());
  REQUIRE(same_stats(*s, *again));
  return true;
}

std::uint64_t header_length(const bytes_t& b) {
  std::uint64_t n = 0;
  for (std::size_t k = 0; k < 8; ++k) n |= std::to_integer<std::uint64_t>(b[k]) << (8 * k);
  return n;
}

void set_header_length(bytes_t& b, std::uint64_t v) {
  for (std::size_t k = 0; k < 8; ++k) b[k] = static_cast<std::byte>((v >> (8 * k)) & 0xff);
}

/// One random corruption of a safetensors file `base` (header length field, header text, data).
bytes_t corrupt_safetensors(const bytes_t& base, std::mt19937_64& g) {
  static constexpr std::string_view syntax = "{}[]\",:\\ -+.0123456789eEtruefalsnFIU_";
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(g);
  };
  const std::size_t header_end = 8 + static_cast<std::size_t>(header_length(base));
  bytes_t m = base;
  switch (pick(0, 6)) {
    case 0:  // random bytes anywhere
      for (std::size_t k = pick(1, 4); k > 0; --k) m[pick(0, m.size() - 1)] = static_cast<std::byte>(pick(0, 255));
      break;
    case 1:  // syntax characters in the header
      for (std::size_t k = pick(1, 3); k > 0; --k)
        m[pick(8, header_end - 1)] = static_cast<std::byte>(syntax[pick(0, syntax.size() - 1)]);
      break;
    case 2: {  // a digit of the header (shapes, offsets, num_kv_heads, attention_scale) changed
      std::vector<std::size_t> digits;
      for (std::size_t i = 8; i < header_end; ++i)
        if (std::isdigit(std::to_integer<int>(m[i]))) digits.push_back(i);
      for (std::size_t k = pick(1, 2); k > 0; --k)
        m[digits[pick(0, digits.size() - 1)]] = static_cast<std::byte>('0' + pick(0, 9));
      break;
    }
    case 3: {  // the header-length field: near the truth, tiny, huge or anything
      const std::uint64_t truth = header_length(m);
      const std::uint64_t candidates[] = {0,
                                          1,
                                          2,
                                          truth - 1,
                                          truth + 1,
                                          truth - 8,
                                          truth + 8,
                                          truth + pick(0, 64) - 32,
                                          ~std::uint64_t{0},
                                          std::uint64_t{1} << 63,
                                          g(),
                                          m.size(),
                                          m.size() - 8};
      set_header_length(m, candidates[pick(0, std::size(candidates) - 1)]);
      break;
    }
    case 4: {  // bytes inserted
      const auto at = m.begin() + static_cast<std::ptrdiff_t>(pick(0, m.size()));
      bytes_t ins(pick(1, 8));
      for (auto& b : ins) b = static_cast<std::byte>(pick(0, 255));
      m.insert(at, ins.begin(), ins.end());
      break;
    }
    case 5: {  // bytes deleted
      const std::size_t at = pick(0, m.size() - 1);
      const std::size_t n = std::min(pick(1, 8), m.size() - at);
      m.erase(m.begin() + static_cast<std::ptrdiff_t>(at), m.begin() + static_cast<std::ptrdiff_t>(at + n));
      break;
    }
    default:  // cut short
      m.resize(pick(0, m.size() - 1));
      break;
  }
  return m;
}

/// One random corruption of a .npy file `base` (version 1.0: magic, version, 2-byte length).
bytes_t corrupt_npy(const bytes_t& base, std::mt19937_64& g) {
  static constexpr std::string_view syntax = "{}()\"',: -0123456789<>fiTrueFalse";
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(g);
  };
  const std::size_t header_end =
      10 + (std::to_integer<std::size_t>(base[8]) | std::to_integer<std::size_t>(base[9]) << 8);
  bytes_t m = base;
  switch (pick(0, 4)) {
    case 0:  // the magic, the version or the header text
      for (std::size_t k = pick(1, 3); k > 0; --k) m[pick(0, header_end - 1)] = static_cast<std::byte>(pick(0, 255));
      break;
    case 1:
      for (std::size_t k = pick(1, 3); k > 0; --k)
        m[pick(10, header_end - 1)] = static_cast<std::byte>(syntax[pick(0, syntax.size() - 1)]);
      break;
    case 2: {  // the header-length field
      const std::size_t v = pick(0, 1) ? header_end - 10 + pick(1, 16) : pick(0, 65535);
      m[8] = static_cast<std::byte>(v & 0xff);
      m[9] = static_cast<std::byte>((v >> 8) & 0xff);
      break;
    }
    case 3: {  // data removed or added
      if (pick(0, 1)) {
        m.resize(m.size() - pick(1, 8));
      } else {
        m.insert(m.end(), pick(1, 8), std::byte{0});
      }
      break;
    }
    default:
      m.resize(pick(0, m.size() - 1));
      break;
  }
  return m;
}

/// Well-formed safetensors files whose stats content is wrong, or merely unusual: metadata
/// values, missing keys, dtypes, shapes, tensor sets, non-finite values.
bytes_t semantic_variant(const triattn::query_stats& s, std::mt19937_64& g,
                         std::vector<std::vector<std::byte>>& store) {
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(g);
  };
  auto c = triattn::detail::stats_contents_of("test", s);
  const auto keep = [&](std::vector<std::byte> b) -> std::span<const std::byte> {
    store.push_back(std::move(b));
    return store.back();
  };
  const auto entry = [&](std::string_view name) -> io::safetensors_entry& {
    for (auto& e : c.entries)
      if (e.name == name) return e;
    FAIL("no entry " << name);
    return c.entries.front();
  };
  static const std::string_view q_names[] = {"q_mean_real", "q_mean_imag", "q_abs_mean", "inv_freq"};
  switch (pick(0, 6)) {
    case 0: {  // a metadata value
      static const std::string_view keys[] = {"format", "rope_style", "num_kv_heads", "attention_scale"};
      static const std::string_view values[] = {"",
                                                "0",
                                                "1",
                                                "2",
                                                "3",
                                                "4",
                                                "8",
                                                "-2",
                                                "+2",
                                                " 2",
                                                "2 ",
                                                "1e400",
                                                "nan",
                                                "inf",
                                                "-1",
                                                "0.5",
                                                "1.25",
                                                "half",
                                                "interleaved",
                                                "neox",
                                                "triattn.stats.v1",
                                                "triattn.stats.v2",
                                                "\x01",
                                                "99999999999999999999"};
      c.metadata[std::string(keys[pick(0, 3)])] = std::string(values[pick(0, std::size(values) - 1)]);
      break;
    }
    case 1: {  // a metadata key removed
      static const std::string_view keys[] = {"format", "rope_style", "num_kv_heads", "attention_scale", "model"};
      c.metadata.erase(std::string(keys[pick(0, std::size(keys) - 1)]));
      break;
    }
    case 2: {  // a tensor stored in another dtype (with data of the matching size)
      auto& e = entry(q_names[pick(0, 3)]);
      static const std::string_view dtypes[] = {"F16", "BF16", "F32", "F64", "I32", "I64", "U8"};
      const std::string_view dt = dtypes[pick(0, std::size(dtypes) - 1)];
      const std::size_t elem = dt == "F64" || dt == "I64" ? 8 : dt == "U8" ? 1 : dt == "F32" || dt == "I32" ? 4 : 2;
      std::size_t count = 1;
      for (const auto d : e.shape) count *= static_cast<std::size_t>(d);
      std::vector<std::byte> b(count * elem);
      for (std::size_t i = 0; i < b.size(); ++i)
        b[i] = static_cast<std::byte>(dt.starts_with('F') ? (i % elem == elem - 1 ? 0x3f : 0x10) : 1);
      e.dtype = std::string(dt);
      e.data = keep(std::move(b));
      break;
    }
    case 3: {  // a tensor of another shape (with data of the matching size)
      auto& e = entry(q_names[pick(0, 3)]);
      std::vector<std::int64_t> shape = e.shape;
      switch (pick(0, 3)) {
        case 0:
          shape[pick(0, shape.size() - 1)] += pick(0, 1) ? 1 : -1;
          break;
        case 1:
          shape.push_back(1);
          break;
        case 2:
          shape.erase(shape.begin());
          break;
        default:
          shape[pick(0, shape.size() - 1)] = 0;
          break;
      }
      std::size_t count = 1;
      for (const auto d : shape) count *= static_cast<std::size_t>(std::max<std::int64_t>(d, 0));
      const std::size_t elem = e.dtype == "F64" ? 8 : 4;
      std::vector<std::byte> b(count * elem, std::byte{0});
      for (std::size_t i = elem - 1; i < b.size(); i += elem) b[i] = std::byte{0x3f};  // positive values
      e.shape = shape;
      e.data = keep(std::move(b));
      break;
    }
    case 4:  // a tensor missing
      c.entries.erase(c.entries.begin() + static_cast<std::ptrdiff_t>(pick(0, c.entries.size() - 1)));
      break;
    case 5: {  // an extra tensor
      static const std::string_view names[] = {"extra", "q_mean", "inv_freq2", "Q_ABS_MEAN"};
      c.entries.push_back({std::string(names[pick(0, 3)]), "F32", {1}, keep(std::vector<std::byte>(4))});
      break;
    }
    default: {  // a non-finite or non-positive value
      auto& e = entry(q_names[pick(0, 3)]);
      std::vector<std::byte> b(e.data.begin(), e.data.end());
      const std::size_t elem = e.dtype == "F64" ? 8 : 4;
      const std::size_t at = pick(0, b.size() / elem - 1) * elem;
      const double values[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                               -std::numeric_limits<double>::infinity(), 0.0, -1.0};
      const double v = values[pick(0, std::size(values) - 1)];
      if (elem == 8) {
        std::memcpy(b.data() + at, &v, 8);
      } else {
        const auto f = static_cast<float>(v);
        std::memcpy(b.data() + at, &f, 4);
      }
      e.data = keep(std::move(b));
      break;
    }
  }
  return io::serialize_safetensors(c.entries, c.metadata);
}

}  // namespace

TEST_CASE("corrupted stats files load as valid stats or throw triattn::error", "[cli][fuzz]") {
  auto g = triattn_test::rng(31);
  const scratch_dir dir("cli_fuzz_stats");
  const triattn::query_stats stats = small_stats(g);
  const bytes_t base = triattn::serialize_stats(stats);
  tally t;
  REQUIRE(check_case(base, t, dir));
  REQUIRE(same_stats(*try_parse(base), stats));

  // Every proper prefix is a truncated file.
  for (std::size_t n = 0; n < base.size(); ++n) {
    INFO("prefix of " << n << " of " << base.size() << " bytes");
    CHECK_FALSE(check_case(bytes_t(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(n)), t, dir));
  }
  // Random corruptions.
  for (int i = 0; i < 1000; ++i) check_case(corrupt_safetensors(base, g), t, dir);
  // Well-formed safetensors with wrong stats content.
  std::vector<std::vector<std::byte>> store;
  int semantic_loaded = 0;
  for (int i = 0; i < 400; ++i) {
    store.clear();
    const bytes_t variant = semantic_variant(stats, g, store);
    if (check_case(variant, t, dir)) ++semantic_loaded;
  }
  std::printf("stats fuzz: %d of %d cases loaded (%d of 400 semantic variants)\n", t.loaded, t.cases, semantic_loaded);
  INFO(t.loaded << " of " << t.cases << " cases loaded; " << semantic_loaded << " of 400 semantic variants");
  CHECK(t.cases >= 1000 + 400 + static_cast<int>(base.size()));
  CHECK(t.loaded > 1);            // some harmless changes (a metadata value, a data byte) load
  CHECK(t.loaded < t.cases / 2);  // but most corruptions are refused
  CHECK(semantic_loaded < 200);
}

TEST_CASE("stats content that is wrong is refused by parse_stats", "[cli][fuzz]") {
  auto g = triattn_test::rng(32);
  const triattn::query_stats stats = small_stats(g);
  const auto refused = [&](const std::map<std::string, std::string>& meta_changes,
                           const std::vector<std::string>& drop_meta = {}) {
    auto c = triattn::detail::stats_contents_of("test", stats);
    for (const auto& [k, v] : meta_changes) c.metadata[k] = v;
    for (const auto& k : drop_meta) c.metadata.erase(k);
    return !try_parse(io::serialize_safetensors(c.entries, c.metadata)).has_value();
  };
  CHECK(refused({{"num_kv_heads", "3"}}));  // 4 q-heads
  CHECK(refused({{"num_kv_heads", "0"}}));
  CHECK(refused({{"num_kv_heads", "-2"}}));
  CHECK(refused({{"num_kv_heads", " 2"}}));
  CHECK(refused({{"attention_scale", "nan"}}));
  CHECK(refused({{"attention_scale", "0"}}));
  CHECK(refused({{"attention_scale", "1e400"}}));
  CHECK(refused({{"rope_style", "neox"}}));
  CHECK(refused({{"format", "triattn.stats.v2"}}));
  CHECK(refused({}, {"format"}));
  CHECK(refused({}, {"rope_style"}));
  CHECK(refused({}, {"num_kv_heads"}));
  // Accepted changes load as they say.
  auto c = triattn::detail::stats_contents_of("test", stats);
  c.metadata["num_kv_heads"] = "4";
  c.metadata.erase("attention_scale");
  const auto s = try_parse(io::serialize_safetensors(c.entries, c.metadata));
  REQUIRE(s.has_value());
  CHECK(s->num_kv_heads == 4);
  CHECK(s->attention_scale == 1.0);
}

TEST_CASE("load_stats names the file for every refused value", "[cli][fuzz]") {
  // stats_file.hpp: "Every malformed field throws triattn::error naming triattn::load_stats, the
  // file and the field" -- also the values that query_stats::validate checks.
  auto g = triattn_test::rng(34);
  const scratch_dir dir("cli_fuzz_values");
  const triattn::query_stats stats = small_stats(g);
  const fs::path file = dir / "bad_values.safetensors";
  const auto refused_with_name = [&](const char* tensor, std::size_t index, double value) {
    auto c = triattn::detail::stats_contents_of("test", stats);
    std::vector<std::byte> b;
    for (auto& e : c.entries) {
      if (e.name != tensor) continue;
      b.assign(e.data.begin(), e.data.end());
      if (e.dtype == "F64") {
        std::memcpy(b.data() + 8 * index, &value, 8);
      } else {
        const auto f = static_cast<float>(value);
        std::memcpy(b.data() + 4 * index, &f, 4);
      }
      e.data = b;
    }
    triattn_test::cli::write_bytes(file, io::serialize_safetensors(c.entries, c.metadata));
    INFO(tensor << "[" << index << "] = " << value);
    try {
      (void)triattn::load_stats(file);
      FAIL("loaded");
    } catch (const triattn::error& e) {
      INFO("message: " << e.what());
      CHECK(std::string(e.what()).find(file.string()) != std::string::npos);
      CHECK(std::string(e.what()).find(tensor) != std::string::npos);
    }
  };
  refused_with_name("q_mean_real", 3, std::numeric_limits<double>::quiet_NaN());
  refused_with_name("q_mean_imag", 0, std::numeric_limits<double>::infinity());
  refused_with_name("q_abs_mean", 5, -std::numeric_limits<double>::infinity());
  refused_with_name("inv_freq", 1, 0.0);
  refused_with_name("inv_freq", 2, -1.0);
}

TEST_CASE("the CLI refuses corrupted keys and stats files with one line and no output", "[cli][fuzz]") {
  auto g = triattn_test::rng(33);
  const scratch_dir dir("cli_fuzz");
  const triattn::query_stats stats = small_stats(g);
  const std::string stats_file = (dir / "stats.safetensors").string();
  const std::string keys_file = (dir / "keys.npy").string();
  const std::string out = (dir / "scores.npy").string();
  triattn::save_stats(stats_file, stats);
  const std::int64_t shape[] = {layers, kv_heads, tokens, head_dim};
  const std::vector<float> keys = triattn_test::normal_floats(g, std::size_t{layers} * kv_heads * tokens * head_dim);
  io::write_npy(keys_file, io::element_kind::f32, shape, keys.data());
  const auto args = [&](const std::string& s, const std::string& k) {
    return std::vector<std::string>{"score", "triattention",  "--stats", s,       "--keys",
                                    k,       "--round-start", "20",      "--out", out};
  };
  {  // the uncorrupted files work
    const auto r = run_cli(dir, args(stats_file, keys_file));
    INFO(r.err);
    REQUIRE(r.code == 0);
    REQUIRE(fs::exists(out));
    fs::remove(out);
  }
  const bytes_t keys_bytes = triattn_test::cli::read_bytes(keys_file);
  const bytes_t stats_bytes = triattn_test::cli::read_bytes(stats_file);
  const auto before = dir.listing();

  constexpr int per_kind = 24;
  int npy_cases = 0, stats_cases = 0;
  for (int attempt = 0; attempt < 2000 && (npy_cases < per_kind || stats_cases < per_kind); ++attempt) {
    const bool npy = npy_cases < per_kind && (stats_cases >= per_kind || attempt % 2 == 0);
    const bytes_t bad = npy ? corrupt_npy(keys_bytes, g) : corrupt_safetensors(stats_bytes, g);
    // Only inputs the library itself refuses: a corruption can be harmless (a padding space
    // turned into a tab, a data byte changed).
    bool refused = false;
    try {
      if (npy) {
        (void)io::parse_npy(bad, "bad.npy");
      } else {
        (void)triattn::parse_stats(bad, "bad.safetensors");
      }
    } catch (const triattn::error&) {
      refused = true;
    }
    if (!refused) continue;
    (npy ? npy_cases : stats_cases)++;
    const std::string bad_file = (dir / (npy ? "bad_keys.npy" : "bad_stats.safetensors")).string();
    triattn_test::cli::write_bytes(bad_file, bad);
    const auto r = npy ? run_cli(dir, args(stats_file, bad_file)) : run_cli(dir, args(bad_file, keys_file));
    check_one_line_error(r, {bad_file});
    CHECK_FALSE(fs::exists(out));
    fs::remove(bad_file);
    CHECK(dir.listing() == before);
  }
  CHECK(npy_cases == per_kind);
  CHECK(stats_cases == per_kind);
}
