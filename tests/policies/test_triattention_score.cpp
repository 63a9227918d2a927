// TriAttention's folded scorer against the per-offset oracle of spec §4
// (support/triattention_reference.hpp) on random keys and statistics: both pairings, GQA groups
// 1-8, f32/f16/bf16 keys, post- and pre-RoPE keys, attention scale != 1, offset horizons,
// max aggregation, the ablations, round starts up to 10^6.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "triattn/core/error.hpp"
#include "triattn/policies/triattention.hpp"
#include "triattn/policies/triattention_math.hpp"

namespace {

using triattn_test::cache_layout;
using triattn_test::test_cache;
namespace ref = triattn_test::ref;

/// Moves the positions of `c` so that the largest lies just below a round start drawn from
/// [1, 10^6] but no lower than the positions' span (a smaller one would make the first
/// position negative); returns that round start.
std::int64_t shift_positions_below_random_round(test_cache& c, std::mt19937_64& g) {
  const auto [first, last] = std::minmax_element(c.positions.begin(), c.positions.end());
  const std::int64_t span = std::int64_t{*last} - *first + 1;
  const std::int64_t r = std::uniform_int_distribution<std::int64_t>(1, 1000000)(g);
  const std::int64_t round_start = std::max(r, span);
  const std::int64_t shift = round_start - 1 - *last;
  for (auto& p : c.positions) p = static_cast<std::int32_t>(p + shift);
  return round_start;
}

/// Largest |oracle score| of a row (0 for an empty row).
double row_scale(const std::vector<double>& row) {
  double m = 0.0;
  for (const double x : row) m = std::max(m, std::abs(x));
  return m;
}

}  // namespace

TEST_CASE("TriAttention offsets are the powers of two up to offset_max") {
  CHECK(triattn::triattention_num_offsets(65536) == 17);
  CHECK(triattn::triattention_num_offsets(1) == 1);
  CHECK(triattn::triattention_num_offsets(16) == 5);
  CHECK(triattn::triattention_num_offsets(127) == 7);
  CHECK(triattn::triattention_num_offsets(128) == 8);
  CHECK(triattn::triattention_num_offsets(std::numeric_limits<std::int64_t>::max()) == 63);
  CHECK(triattn::triattention_offset(16) == 65536);
}

TEST_CASE("TriAttention folded scores equal the per-offset oracle") {
  auto g = triattn_test::rng(901);
  std::uniform_int_distribution<int> page(1, 5);
  int case_index = 0;
  for (const auto style : {triattn::rope_style::half, triattn::rope_style::interleaved}) {
    for (const int group : {1, 2, 4, 8}) {
      for (const auto type : triattn_test::all_dtypes) {
        for (const auto keys : {triattn::key_state::post_rope, triattn::key_state::pre_rope}) {
          for (const std::int64_t offset_max : {16, 128, 65536}) {
            for (const auto aggregation : {triattn::offset_aggregation::mean, triattn::offset_aggregation::max}) {
              ++case_index;
              auto shape =
                  triattn_test::random_shape(g, triattn_test::all_layouts[case_index % 4], type, page(g), group);
              shape.keys = keys;
              shape.rope.style = style;
              shape.rope.theta = case_index % 2 == 0 ? 1e4 : 1e6;
              shape.rope.attention_scale = case_index % 3 == 0 ? 1.0 : 1.0 + 0.1 * std::log(4.0);  // YaRN x4 mscale
              // The tolerance is relative to a row's largest |score|, which reflects the size of
              // the terms only over several keys (one key's score may cancel to ~0): rows are
              // empty or hold >= 8 keys.
              shape.capacity = std::max<std::int64_t>(shape.capacity, 8);
              test_cache c(shape, g);
              for (auto& n : c.lengths) n = n == 0 ? 0 : std::max(n, 8);
              const std::int64_t r = shift_positions_below_random_round(c, g);
              const auto stats = ref::tri_random_stats(g, c.geometry());

              triattn::triattention_config cfg;
              cfg.offset_max = offset_max;
              cfg.aggregation = aggregation;
              cfg.disable_trig = case_index % 3 == 1;  // every other combination sees each ablation
              cfg.disable_norm = case_index % 3 == 2;
              ref::tri_score_options o = ref::tri_options_for(c);
              o.offset_max = offset_max;
              o.use_max = aggregation == triattn::offset_aggregation::max;
              o.disable_trig = cfg.disable_trig;
              o.disable_norm = cfg.disable_norm;
              INFO(shape.describe() << (style == triattn::rope_style::half ? " half" : " interleaved")
                                    << (keys == triattn::key_state::pre_rope ? " pre-RoPE" : " post-RoPE") << " a "
                                    << shape.rope.attention_scale << " r " << r << " offset_max " << offset_max
                                    << (o.use_max ? " max" : " mean") << " disable_trig " << o.disable_trig
                                    << " disable_norm " << o.disable_norm);

              const triattn::triattention policy(stats, cfg);
              const auto H = static_cast<std::size_t>(c.geometry().num_q_heads);
              std::vector<float> out(static_cast<std::size_t>(shape.num_layers) * H * shape.capacity,
                                     std::numeric_limits<float>::quiet_NaN());
              c.with_view([&](const auto& v) { policy.score(v, r, out); });

              const auto want = ref::tri_cache_scores(c, stats, r, o);
              for (int l = 0; l < shape.num_layers; ++l)
                for (std::size_t qh = 0; qh < H; ++qh) {
                  const auto& row = want[l][qh];
                  const double tol = 1e-5 * row_scale(row);
                  const float* got = out.data() + (l * H + qh) * shape.capacity;
                  for (std::size_t s = 0; s < row.size(); ++s) {
                    INFO("layer " << l << " q_head " << qh << " slot " << s);
                    REQUIRE(std::abs(got[s] - row[s]) <= tol);
                  }
                  for (auto s = static_cast<std::int64_t>(row.size()); s < shape.capacity; ++s)
                    REQUIRE(std::isnan(got[s]));  // slots past the length are left as they were
                }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("TriAttention norm term is offset-independent and equals the trig-free score") {
  // disable_trig with max aggregation must not depend on r (a zero trig term per offset).
  auto g = triattn_test::rng(902);
  auto shape = triattn_test::random_shape(g, cache_layout::dense_nhd, triattn::dtype::f32, 4, 2);
  test_cache c(shape, g);
  const auto stats = ref::tri_random_stats(g, c.geometry());
  triattn::triattention_config cfg;
  cfg.disable_trig = true;
  cfg.aggregation = triattn::offset_aggregation::max;
  const triattn::triattention policy(stats, cfg);
  const auto n = static_cast<std::size_t>(shape.num_layers) * c.geometry().num_q_heads * shape.capacity;
  std::vector<float> a(n, 0.0f), b(n, 0.0f);
  policy.score(c.dense_view(), 1000, a);
  policy.score(c.dense_view(), 987654, b);
  CHECK(a == b);
}

TEST_CASE("TriAttention score rejects bad outputs, non-finite keys and mismatched stats") {
  auto g = triattn_test::rng(903);
  auto shape = triattn_test::random_shape(g, cache_layout::dense_hnd, triattn::dtype::bf16, 4, 2);
  shape.capacity = 8;
  test_cache c(shape, g);
  for (auto& n : c.lengths) n = 8;
  const auto stats = ref::tri_random_stats(g, c.geometry());
  const triattn::triattention policy(stats);
  const auto n = static_cast<std::size_t>(shape.num_layers) * c.geometry().num_q_heads * shape.capacity;
  std::vector<float> out(n + 1);
  CHECK_THROWS_WITH(policy.score(c.dense_view(), 100, out),
                    Catch::Contains("triattn::triattention::score") && Catch::Contains("output holds"));
  // Issue 15, item 6: round start + offset must not overflow int64; scores are not written.
  out.assign(n, -1.0f);
  for (const std::int64_t r : {std::int64_t{1} << 31 | 1, std::numeric_limits<std::int64_t>::max(), std::int64_t{-1}})
    CHECK_THROWS_WITH(policy.score(c.dense_view(), r, out),
                      Catch::Contains("triattn::triattention::score") &&
                          Catch::Contains("round start " + std::to_string(r) + " must be in [0, 2^31]"));
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == -1.0f; }));
  out.resize(n + 1);

  const int l = shape.num_layers - 1, h = shape.num_kv_heads - 1;
  auto key = c.key(l, h, 5);
  key[1] = std::numeric_limits<double>::infinity();
  c.store_key(l, h, 5, key);
  out.resize(n);
  CHECK_THROWS_WITH(policy.score(c.dense_view(), 100, out),
                    Catch::Contains("triattn::triattention::score") &&
                        Catch::Contains("layer " + std::to_string(l) + " kv_head " + std::to_string(h) + " slot 5"));

  auto other = stats;
  other.style = triattn::rope_style::interleaved;
  CHECK_THROWS_WITH(triattn::triattention(other).score(c.dense_view(), 100, out), Catch::Contains("rope_style"));
}
