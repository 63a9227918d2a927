// K-norm and KeyDiff (the key-only scorers): hand-built caches whose keep sets follow from the
// formulas, zero keys, exact ties, non-finite keys refused with the cache untouched, and the
// registry's entries. Their scores against the double-precision oracles over every view,
// dtype and granularity are the round matrix's (test_round_matrix.cpp).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "support/attention_free_reference.hpp"
#include "support/random.hpp"
#include "support/round_checks.hpp"
#include "support/views.hpp"
#include "triattn/core/round.hpp"
#include "triattn/policies/keydiff.hpp"
#include "triattn/policies/knorm.hpp"
#include "triattn/registry.hpp"

namespace {

using triattn_test::cache_layout;
using triattn_test::test_cache;
namespace ref = triattn_test::ref;

/// One layer, one kv head of head_dim 4, `keys` in slots 0.. at positions 0..
test_cache one_row(const std::vector<std::vector<double>>& keys, triattn::dtype type = triattn::dtype::f32) {
  auto g = triattn_test::rng(4100);
  triattn_test::cache_shape shape = triattn_test::random_shape(g, cache_layout::dense_nhd, type, 4, 1,
                                                               {.min_layers = 1, .max_layers = 1, .max_kv_heads = 1,
                                                                .max_half_dim = 2, .min_capacity = 8, .max_capacity = 8});
  shape.head_dim = 4;
  test_cache c(shape, g);
  c.length(0, 0) = static_cast<std::int32_t>(keys.size());
  for (std::size_t s = 0; s < keys.size(); ++s) {
    c.store_key(0, 0, static_cast<std::int64_t>(s), keys[s]);
    c.position(0, 0, static_cast<std::int64_t>(s)) = static_cast<std::int32_t>(s);
  }
  return c;
}

template <class P>
std::vector<std::int32_t> keep_of(test_cache& c, std::int64_t budget) {
  const P policy;
  const triattn::keep_plan plan = policy.plan(c.dense_view(), budget);
  return {plan.row(0, 0).begin(), plan.row(0, 0).end()};
}

}  // namespace

TEST_CASE("K-norm keeps the smallest keys and KeyDiff the least typical directions") {
  // Five keys along +x with norms 1..5, one along +y (norm 3) and one along -x (norm 2).
  const std::vector<std::vector<double>> keys = {{1, 0, 0, 0}, {2, 0, 0, 0}, {3, 0, 0, 0}, {0, 3, 0, 0},
                                                 {4, 0, 0, 0}, {5, 0, 0, 0}, {-2, 0, 0, 0}};
  test_cache c = one_row(keys);
  CHECK(keep_of<triattn::knorm>(c, 3) == std::vector<std::int32_t>{0, 1, 6});  // norms 1, 2, 2 (ties: lower slot)
  // The anchor is 4 x̂ + ŷ: −x is the least like it, then +y, then the +x keys (equal, slots 0..)
  CHECK(keep_of<triattn::keydiff>(c, 2) == std::vector<std::int32_t>{3, 6});
  CHECK(keep_of<triattn::keydiff>(c, 4) == std::vector<std::int32_t>{0, 1, 3, 6});
  // The scores are the oracle's
  std::vector<float> out(8, 7.0f);
  triattn::keydiff{}.score(c.dense_view(), out);
  const auto want = ref::keydiff_scores(c, 0, 0);
  for (std::size_t s = 0; s < keys.size(); ++s) CHECK(out[s] == Approx(want[s]).margin(1e-6));
  CHECK(out[7] == 7.0f);  // past the length: untouched
  triattn::knorm{}.score(c.dense_view(), out);
  for (std::size_t s = 0; s < keys.size(); ++s) CHECK(out[s] == Approx(ref::knorm_scores(c, 0, 0)[s]));
}

TEST_CASE("zero keys: K-norm keeps them first, KeyDiff scores them 0") {
  test_cache c = one_row({{1, 1, 0, 0}, {0, 0, 0, 0}, {1, 1, 0, 0}, {0, 0, 0, 0}, {0, -1, 0, 0}});
  CHECK(keep_of<triattn::knorm>(c, 2) == std::vector<std::int32_t>{1, 3});
  std::vector<float> out(8);
  triattn::keydiff{}.score(c.dense_view(), out);
  CHECK(out[1] == 0.0f);
  CHECK(out[3] == 0.0f);
  // An all-zero row: every score 0, the lowest slots kept.
  test_cache z = one_row({{0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}});
  CHECK(keep_of<triattn::keydiff>(z, 2) == std::vector<std::int32_t>{0, 1});
  CHECK(keep_of<triattn::knorm>(z, 1) == std::vector<std::int32_t>{0});
}

TEST_CASE("K-norm and KeyDiff refuse a non-finite key of a scored row, the cache untouched") {
  for (const auto type : {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16}) {
    test_cache c = one_row({{1, 0, 0, 0}, {2, 0, 0, 0}, {0, 1, 0, 0}, {3, 0, 0, 0}}, type);
    c.store_key(0, 0, 2, {0, std::numeric_limits<double>::infinity(), 0, 0});
    triattn::knorm kn;
    triattn::keydiff kd;
    triattn_test::check_rejected(c, [&] { kn.compress(c.dense_view(), 2); },
                                 {"triattn::compress", "layer 0 kv_head 0 slot 2", "inf", "keys must be finite"});
    triattn_test::check_rejected(c, [&] { kd.compress(c.dense_view(), 2); },
                                 {"triattn::compress", "layer 0 kv_head 0 slot 2", "keys must be finite"});
    std::vector<float> out(8);
    triattn_test::throws_with([&] { kd.score(c.dense_view(), out); }, {"triattn::keydiff::score", "slot 2"});
    // A row that fits the budget is not read: no error.
    CHECK_NOTHROW(kn.compress(c.dense_view(), 4));
  }
}

TEST_CASE("the registry offers knorm and keydiff with no inputs") {
  for (const char* name : {"knorm", "keydiff"}) {
    const triattn::policy_entry* e = triattn::find_policy(name);
    REQUIRE(e != nullptr);
    CHECK(!e->needs.values);
    CHECK(!e->needs.queries);
    CHECK(!e->needs.attention);
    CHECK(!e->needs.stats);
    CHECK(!e->takes_gqa);
    // Through the type-erased policy: the same keep sets as the class.
    auto g = triattn_test::rng(4101);
    test_cache c(triattn_test::random_shape(g, cache_layout::dense_hnd, triattn::dtype::bf16, 3, 2,
                                            {.min_capacity = 12, .max_capacity = 20}),
                 g);
    auto any = *e->create();
    const triattn::keep_plan got = any.plan(c.dense_view(), 5);
    const triattn::keep_plan want = std::string_view(name) == "knorm" ? triattn::knorm{}.plan(c.dense_view(), 5)
                                                                      : triattn::keydiff{}.plan(c.dense_view(), 5);
    CHECK(got.indices == want.indices);
    CHECK(got.offsets == want.offsets);
  }
}
