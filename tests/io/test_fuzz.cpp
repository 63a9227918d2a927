// Fuzzed input: small valid .npy and safetensors files, cut at every length, with bytes
// flipped, inserted or deleted, with random header-length fields and with header bytes
// replaced by syntax characters. Each case must either parse to something consistent or
// throw triattn::error; ASan/UBSan builds catch any read out of bounds (each case is parsed
// from an exactly-sized heap copy).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "support/npy_bytes.hpp"
#include "support/random.hpp"
#include "test_helpers.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/io/safetensors.hpp"

namespace {

namespace io = triattn::io;
using bytes_t = std::vector<std::byte>;
using triattn_test::bytes_of;

/// Where a file keeps its header: the length field and the end of the header text.
struct layout {
  std::size_t len_pos;
  std::size_t len_bytes;
  std::size_t header_end;
};

struct tally {
  int cases = 0;
  int parsed = 0;
};

/// Parses an exactly-sized copy; false when it threw triattn::error (any other exception
/// escapes and fails the test).
bool try_parse(const bytes_t& input, const std::function<void(bytes_t)>& parse, tally& t) {
  ++t.cases;
  bytes_t exact(input.begin(), input.end());
  try {
    parse(std::move(exact));
  } catch (const triattn::error&) {
    return false;
  }
  ++t.parsed;
  return true;
}

/// Every proper prefix of `base` is a truncated file and must be rejected.
void truncations(const bytes_t& base, const std::function<void(bytes_t)>& parse, tally& t) {
  for (std::size_t n = 0; n < base.size(); ++n) {
    if (try_parse(bytes_t(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(n)), parse, t)) {
      FAIL("the prefix of " << n << " of " << base.size() << " bytes parsed");
    }
  }
}

/// `count` random mutations of `base`, mostly in the header, where the parsers branch.
void mutations(const bytes_t& base, const layout& l, int count, std::mt19937_64& g,
               const std::function<void(bytes_t)>& parse, tally& t) {
  static constexpr std::string_view syntax = "{}[]()\"',:\\ \n-+.0123456789eETrueFalsnu<>|f4i8";
  const auto pick = [&](std::size_t lo, std::size_t hi) {  // uniform in [lo, hi]
    return std::uniform_int_distribution<std::size_t>(lo, hi)(g);
  };
  const auto random_byte = [&] { return static_cast<std::byte>(pick(0, 255)); };
  const auto syntax_byte = [&] { return static_cast<std::byte>(syntax[pick(0, syntax.size() - 1)]); };
  const auto header_pos = [&] {
    return pick(l.len_pos + l.len_bytes, std::max(l.header_end, l.len_pos + l.len_bytes + 1) - 1);
  };
  for (int i = 0; i < count; ++i) {
    bytes_t m = base;
    switch (pick(0, 5)) {
      case 0:  // flip random bytes anywhere
        for (std::size_t k = pick(1, 4); k > 0; --k) m[pick(0, m.size() - 1)] = random_byte();
        break;
      case 1:  // replace header bytes with syntax characters
        for (std::size_t k = pick(1, 3); k > 0; --k) m[header_pos()] = syntax_byte();
        break;
      case 2: {  // insert bytes
        const auto at = m.begin() + static_cast<std::ptrdiff_t>(pick(0, m.size()));
        bytes_t ins(pick(1, 8));
        const bool syntactic = pick(0, 1) == 0;
        for (auto& b : ins) b = syntactic ? syntax_byte() : random_byte();
        m.insert(at, ins.begin(), ins.end());
        break;
      }
      case 3: {  // delete bytes
        const std::size_t at = pick(0, m.size() - 1);
        const std::size_t n = std::min(pick(1, 8), m.size() - at);
        m.erase(m.begin() + static_cast<std::ptrdiff_t>(at), m.begin() + static_cast<std::ptrdiff_t>(at + n));
        break;
      }
      case 4: {  // a random header-length field: near the truth, tiny, huge or anything
        std::uint64_t truth = 0;
        for (std::size_t k = 0; k < l.len_bytes; ++k)
          truth |= std::to_integer<std::uint64_t>(m[l.len_pos + k]) << (8 * k);
        const std::uint64_t candidates[] = {0,
                                            1,
                                            truth - 1,
                                            truth + 1,
                                            truth + pick(0, 64) - 32,
                                            ~std::uint64_t{0},
                                            g(),
                                            m.size(),
                                            m.size() - l.len_pos - l.len_bytes};
        const std::uint64_t v = candidates[pick(0, std::size(candidates) - 1)];
        for (std::size_t k = 0; k < l.len_bytes; ++k) m[l.len_pos + k] = static_cast<std::byte>((v >> (8 * k)) & 0xff);
        break;
      }
      default:  // a random byte string with the right magic (npy) or length (safetensors) prefix
        m.resize(l.len_pos + l.len_bytes + pick(0, 64));
        for (std::size_t k = l.len_pos + l.len_bytes; k < m.size(); ++k)
          m[k] = pick(0, 1) ? syntax_byte() : random_byte();
        break;
    }
    try_parse(m, parse, t);
  }
}

void check_npy(bytes_t b) {
  const io::npy_array a = io::parse_npy(b, "fuzz.npy");
  for (const std::int64_t d : a.shape) REQUIRE(d >= 0);
  REQUIRE(a.data.size() == static_cast<std::size_t>(a.size()) * io::element_bytes(a.kind));
  const bool is_float =
      a.kind == io::element_kind::f16 || a.kind == io::element_kind::f32 || a.kind == io::element_kind::f64;
  const std::size_t n = is_float ? a.to_float().size() : a.to_int64().size();
  REQUIRE(n == static_cast<std::size_t>(a.size()));
}

void check_safetensors(bytes_t b) {
  const std::size_t file_size = b.size();
  const io::safetensors_file f = io::safetensors_file::parse(std::move(b), "fuzz.safetensors");
  std::vector<std::span<const std::byte>> spans;
  std::size_t total = 0;
  for (const std::string& name : f.names()) {
    const io::safetensors_tensor& t = f.get(name);
    const auto* d = io::detail::find_safetensors_dtype(t.dtype);
    REQUIRE(d != nullptr);
    REQUIRE(io::detail::checked_bytes(t.shape, d->bytes) == t.data.size());
    if (t.dtype == "F16" || t.dtype == "BF16" || t.dtype == "F32" || t.dtype == "F64") {
      io::tensor_to_float(t, name);  // reads every byte of the span
    }
    if (!t.data.empty()) spans.push_back(t.data);
    total += t.data.size();
  }
  REQUIRE(total <= file_size);
  std::sort(spans.begin(), spans.end(), [](const auto& x, const auto& y) { return std::less<>()(x.data(), y.data()); });
  for (std::size_t i = 1; i < spans.size(); ++i) {
    REQUIRE_FALSE(std::less<>()(spans[i].data(), spans[i - 1].data() + spans[i - 1].size()));
  }
}

/// A hand-made .npy file with header `dict` in format version `major` and `data_bytes` bytes
/// of a fixed non-zero pattern.
bytes_t npy_by_hand(int major, std::string_view dict, std::size_t data_bytes) {
  bytes_t data(data_bytes);
  for (std::size_t i = 0; i < data_bytes; ++i) data[i] = static_cast<std::byte>(i * 37);
  return triattn_test::npy_file(major, dict, data);
}

}  // namespace

TEST_CASE("fuzz: npy") {
  std::mt19937_64 g = triattn_test::rng(21);
  const float f[6] = {1, -2, 3.5f, 0, 1e30f, -1e-30f};
  const std::int64_t shape23[2] = {2, 3};
  const std::int64_t shape04[2] = {0, 4};
  struct base {
    bytes_t bytes;
    layout l;
  };
  const std::string v2 = R"({"shape": (3,), "fortran_order": False, "descr": "<i8",}  )"
                         "\n";
  const std::string v3 = "{'descr':'<f2','fortran_order':False,'shape':()}";
  const base bases[] = {
      {io::serialize_npy(io::element_kind::f32, shape23, f), {8, 2, 128}},
      {io::serialize_npy(io::element_kind::f64, shape04, nullptr), {8, 2, 128}},
      {npy_by_hand(2, v2, 24), {8, 4, 12 + v2.size()}},
      {npy_by_hand(3, v3, 2), {8, 4, 12 + v3.size()}},
  };
  tally t;
  for (const base& b : bases) {
    REQUIRE(try_parse(b.bytes, check_npy, t));
    truncations(b.bytes, check_npy, t);
    mutations(b.bytes, b.l, 400, g, check_npy, t);
  }
  INFO(t.parsed << " of " << t.cases << " cases parsed");
  CHECK(t.cases >= 1000);
  CHECK(t.parsed > 0);
  CHECK(t.parsed < t.cases);
}

TEST_CASE("fuzz: safetensors") {
  std::mt19937_64 g = triattn_test::rng(22);
  const float f[6] = {1, -2, 3.5f, 0, 1e30f, -1e-30f};
  const std::uint16_t h[3] = {0x3c00, 0xc000, 0x7c00};
  const std::int64_t i[1] = {-5};
  const auto span_of = [](const auto& arr) { return std::as_bytes(std::span(arr)); };
  const std::vector<io::safetensors_entry> entries = {
      {"w.f32", "F32", {2, 3}, span_of(f)}, {"h", "F16", {3}, span_of(h)}, {"idx", "I64", {}, span_of(i)}};
  const bytes_t serialized = io::serialize_safetensors(entries, {{"format", "fuzz"}, {"k\\\"", "\\u00e9"}});
  std::uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = n << 8 | std::to_integer<std::uint64_t>(serialized[static_cast<std::size_t>(k)]);

  const std::string hand =
      " {\"b\" : {\"shape\": [2], \"data_offsets\": [0, 8], \"dtype\": \"F32\"},\n"
      "  \"__metadata__\": {\"k\": \"v\\u00e9\\n\"},\n"
      "  \"a\": {\"dtype\": \"BF16\", \"data_offsets\": [8, 12], \"shape\": [2, 1]}}   ";
  bytes_t hand_file;
  for (std::size_t k = 0; k < 8; ++k) hand_file.push_back(static_cast<std::byte>((hand.size() >> (8 * k)) & 0xff));
  const bytes_t hb = bytes_of(hand);
  hand_file.insert(hand_file.end(), hb.begin(), hb.end());
  for (std::size_t k = 0; k < 12; ++k) hand_file.push_back(static_cast<std::byte>(k * 29));

  tally t;
  const std::pair<bytes_t, layout> bases[] = {{serialized, {0, 8, 8 + n}}, {hand_file, {0, 8, 8 + hand.size()}}};
  for (const auto& [bytes, l] : bases) {
    REQUIRE(try_parse(bytes, check_safetensors, t));
    truncations(bytes, check_safetensors, t);
    mutations(bytes, l, 600, g, check_safetensors, t);
  }
  INFO(t.parsed << " of " << t.cases << " cases parsed");
  CHECK(t.cases >= 1000);
  CHECK(t.parsed > 0);
  CHECK(t.parsed < t.cases);
}
