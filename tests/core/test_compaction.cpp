// In-place compaction on dense and paged layouts against a gather done on copies of the rows.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/random.hpp"
#include "support/views.hpp"
#include "triattn/core/compaction.hpp"

namespace {

using triattn_test::cache_layout;
using triattn_test::cache_shape;
using triattn_test::test_cache;
using index_list = std::vector<std::int32_t>;

/// Two per-slot state arrays: one float per KV head (contiguous, via make_slot_state) and
/// two int64 rows per KV head (a GQA group of 2) with padded row and layer strides.
struct slot_arrays {
  int heads;
  std::int64_t capacity, row_stride, layer_stride;
  std::vector<float> per_head;
  std::vector<std::int64_t> per_query;

  slot_arrays(const cache_shape& s, std::mt19937_64& g)
      : heads(s.num_kv_heads), capacity(s.capacity), row_stride(s.capacity + 3),
        layer_stride(2 * s.num_kv_heads * (s.capacity + 3) + 5),
        per_head(triattn_test::normal_floats(g, static_cast<std::size_t>(s.num_layers * s.num_kv_heads * s.capacity))),
        per_query(static_cast<std::size_t>(s.num_layers * layer_stride)) {
    for (auto& x : per_query) x = static_cast<std::int64_t>(g());
  }
  std::vector<triattn::slot_state> states() {
    return {triattn::make_slot_state(per_head.data(), heads, 1, capacity),
            {reinterpret_cast<std::byte*>(per_query.data()), sizeof(std::int64_t), 2, layer_stride, row_stride}};
  }
  float& a(int l, int h, std::int64_t s) { return per_head[static_cast<std::size_t>((l * heads + h) * capacity + s)]; }
  std::int64_t& b(int l, int row, std::int64_t s) {
    return per_query[static_cast<std::size_t>(l * layer_stride + row * row_stride + s)];
  }
};

/// A random keep set per (layer, kv_head): all slots (mode 0), none (mode 1) or a random
/// ascending subset of random size.
triattn::keep_plan random_plan(test_cache& c, std::mt19937_64& g, int mode) {
  const auto& s = c.shape();
  triattn::keep_plan plan(s.num_layers, s.num_kv_heads);
  for (int l = 0; l < s.num_layers; ++l) {
    for (int h = 0; h < s.num_kv_heads; ++h) {
      index_list all(static_cast<std::size_t>(c.length(l, h)));
      std::iota(all.begin(), all.end(), 0);
      std::uniform_int_distribution<std::size_t> count(0, all.size());
      std::shuffle(all.begin(), all.end(), g);
      all.resize(mode == 0 ? all.size() : mode == 1 ? 0 : count(g));
      std::sort(all.begin(), all.end());
      plan.push_row(all);
    }
  }
  return plan;
}

/// Everything a slot (l, h, s) carries, read with the test's own addressing.
struct slot_copy {
  triattn_test::slot_contents kv;
  float a;
  std::int64_t b0, b1;
  bool operator==(const slot_copy&) const = default;
};
slot_copy read_slot(test_cache& c, slot_arrays& st, int l, int h, std::int64_t s) {
  return {c.slot(l, h, s), st.a(l, h, s), st.b(l, 2 * h, s), st.b(l, 2 * h + 1, s)};
}

}  // namespace

TEST_CASE("views address rows, lengths and positions where the layout puts them") {
  auto g = triattn_test::rng(401);
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto type : triattn_test::all_dtypes) {
      for (const int page_size : {1, 3, 16}) {
        test_cache c(triattn_test::random_shape(g, layout, type, page_size), g);
        INFO(c.shape().describe());
        c.with_view([&](const auto& v) {
          STATIC_REQUIRE(triattn::KVCacheView<std::decay_t<decltype(v)>>);
          REQUIRE_NOTHROW(v.validate("test"));
          CHECK(v.capacity() == c.shape().capacity);
          for (int l = 0; l < c.shape().num_layers; ++l) {
            for (int h = 0; h < c.shape().num_kv_heads; ++h) {
              CHECK(v.length(l, h) == c.length(l, h));
              for (std::int64_t s = 0; s < c.shape().capacity; ++s) {
                REQUIRE(v.key(l, h, s) == c.key_row(l, h, s));
                REQUIRE(v.value(l, h, s) == c.value_row(l, h, s));
                REQUIRE(&v.position(l, h, s) == &c.position(l, h, s));
              }
            }
          }
          CHECK(triattn::max_length(v) == *std::max_element(c.lengths.begin(), c.lengths.end()));
        });
      }
    }
  }
}

TEST_CASE("compact gathers K, V, positions and slot state like a copy-then-gather") {
  auto g = triattn_test::rng(402);
  for (const auto layout : triattn_test::all_layouts) {
    for (const auto type : triattn_test::all_dtypes) {
      for (const int page_size : {1, 3, 16}) {
        if (!triattn_test::is_paged(layout) && page_size != 1) continue;  // page size means nothing there
        for (int mode = 0; mode < 5; ++mode) {
          test_cache c(triattn_test::random_shape(g, layout, type, page_size), g);
          slot_arrays st(c.shape(), g);
          const auto& s = c.shape();
          INFO(s.describe() << " mode " << mode);
          const auto plan = random_plan(c, g, mode);

          // The oracle: copy every kept slot out first, then expect it at its new index.
          std::vector<std::vector<slot_copy>> expected;
          for (int l = 0; l < s.num_layers; ++l)
            for (int h = 0; h < s.num_kv_heads; ++h) {
              expected.emplace_back();
              for (const auto k : plan.row(l, h)) expected.back().push_back(read_slot(c, st, l, h, k));
            }
          const auto lengths_before = c.lengths;
          const auto spare = c.spare_page_ids();
          std::vector<std::vector<std::byte>> spare_before;
          for (int l = 0; l < s.num_layers; ++l)
            for (const auto p : spare) spare_before.push_back(c.page_bytes(l, p));
          const auto block_table_before = c.block_table;
          const auto per_query_before = st.per_query;

          auto states = st.states();
          const auto result = c.with_view([&](const auto& v) { return triattn::compact(v, plan, states); });

          for (int l = 0; l < s.num_layers; ++l) {
            for (int h = 0; h < s.num_kv_heads; ++h) {
              const auto& want = expected[static_cast<std::size_t>(l * s.num_kv_heads + h)];
              INFO("layer " << l << " kv_head " << h);
              REQUIRE(c.length(l, h) == static_cast<std::int32_t>(want.size()));
              for (std::size_t i = 0; i < want.size(); ++i) {
                INFO("slot " << i);
                REQUIRE(read_slot(c, st, l, h, static_cast<std::int64_t>(i)) == want[i]);
              }
            }
          }
          // Nothing outside this sequence moved: spare pool pages, the block table, the
          // padding between slot-state rows.
          std::size_t at = 0;
          for (int l = 0; l < s.num_layers; ++l)
            for (const auto p : spare) CHECK(c.page_bytes(l, p) == spare_before[at++]);
          CHECK(c.block_table == block_table_before);
          for (std::size_t i = 0; i < st.per_query.size(); ++i) {
            const auto in_row = static_cast<std::int64_t>(i) % st.layer_stride % st.row_stride;
            const bool padding = static_cast<std::int64_t>(i) % st.layer_stride >= 2 * s.num_kv_heads * st.row_stride ||
                                 in_row >= s.capacity;
            if (padding) REQUIRE(st.per_query[i] == per_query_before[i]);
          }

          CHECK(result.freed_pages == triattn_test::expected_freed_pages(c, lengths_before));
        }
      }
    }
  }
}

TEST_CASE("keep_plan::shared gives every (layer, kv_head) the same row") {
  auto g = triattn_test::rng(403);
  std::uniform_int_distribution<int> dim(1, 4);
  const int layers = dim(g), heads = dim(g);
  index_list keep;
  std::bernoulli_distribution take(0.5);
  for (std::int32_t i = 0; i < 30; ++i)
    if (take(g)) keep.push_back(i);
  const auto plan = triattn::keep_plan::shared(layers, heads, keep);
  REQUIRE(plan.rows() == static_cast<std::size_t>(layers * heads));
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < heads; ++h) CHECK(index_list(plan.row(l, h).begin(), plan.row(l, h).end()) == keep);
}

TEST_CASE("a hand-built plan whose offsets do not frame its indices is refused, the cache untouched") {
  // Issue 15: `offsets` was never checked against `indices`; the validator then read past the
  // index array and compact would have written through it.
  auto g = triattn_test::rng(404);
  test_cache c(triattn_test::random_shape(g, triattn_test::cache_layout::dense_nhd, triattn::dtype::f32, 1), g);
  const auto good = random_plan(c, g, 0);
  const auto check_refused = [&](triattn::keep_plan bad, const std::string& want) {
    const auto before = c.snapshot();
    INFO(want);
    CHECK_THROWS_WITH(c.with_view([&](const auto& view) { return triattn::compact(view, bad); }),
                      Catch::Contains("triattn::compact") && Catch::Contains(want));
    CHECK(c.snapshot() == before);
  };
  auto past = good;
  past.offsets.back() += 1000;  // the last row reaches past the indices
  check_refused(past, "offsets must run from 0");
  auto shifted = good;
  shifted.offsets.front() = 1;
  check_refused(shifted, "offsets must run from 0");
  auto none = good;
  none.offsets.clear();  // rows() would underflow
  check_refused(none, "offsets must run from 0");
  if (good.offsets.size() > 3) {  // offsets[2] is not the last, which the frame check reads first
    auto decreasing = good;
    std::swap(decreasing.offsets[1], decreasing.offsets[2]);
    if (decreasing.offsets[1] != decreasing.offsets[2]) check_refused(decreasing, "offsets decrease");
  }
}

namespace {
/// A cell cache in the manner of llama.cpp's: every (layer, kv_head) reads one slot map (slot
/// s is the dense cache's slot `cell[s]`), and a round frees cells instead of moving rows.
struct cell_cache_view {
  triattn::dense_kv_view cells{};  // the rows the cells index
  std::int32_t* cell = nullptr;    // [capacity] the cell of each slot
  std::int32_t* pos = nullptr;     // [capacity]
  std::int32_t* count = nullptr;   // the sequence's cells
  index_list* freed = nullptr;     // the cells `free_evicted` released, in slot order
  bool refuse = false;
  static constexpr bool equal_lengths = true;

  const triattn::kv_geometry& geometry() const { return cells.geometry(); }
  std::int64_t capacity() const { return cells.capacity(); }
  std::byte* key(int l, int h, std::int64_t s) const { return cells.key(l, h, cell[s]); }
  std::byte* value(int l, int h, std::int64_t s) const { return cells.value(l, h, cell[s]); }
  std::int32_t length(int, int) const { return *count; }
  void set_length(int, int, std::int32_t n) const { *count = n; }
  std::int32_t& position(int, int, std::int64_t s) const { return pos[s]; }
  void validate(const char* api) const { cells.validate(api); }
  void free_evicted(const triattn::keep_plan& plan) const {
    TRIATTN_CHECK(!refuse, "cell_cache_view::free_evicted", "the engine refused");
    const auto keep = plan.row(0, 0);
    std::size_t k = 0;
    for (std::int32_t s = 0; s < *count; ++s) {
      if (k < keep.size() && keep[k] == s) {
        cell[k] = cell[s];
        pos[k] = pos[s];
        ++k;
      } else {
        freed->push_back(cell[s]);
      }
    }
    *count = static_cast<std::int32_t>(keep.size());
  }
};
static_assert(triattn::KVCacheView<cell_cache_view>);
}  // namespace

TEST_CASE("a view that frees evicted slots in place: no row moves, the plan reaches its hook, the state still moves") {
  for (std::uint64_t seed = 405; seed < 425; ++seed) {
    auto g = triattn_test::rng(seed);
    test_cache c(triattn_test::random_shape(g, triattn_test::cache_layout::dense_nhd, triattn::dtype::f16, 1), g);
    const auto& s = c.shape();
    INFO(s.describe() << " seed " << seed);
    slot_arrays st(s, g);
    // The sequence's cells: a shuffled subset of the dense cache's slots, positions ascending.
    index_list cell(static_cast<std::size_t>(s.capacity)), pos(cell.size());
    std::iota(cell.begin(), cell.end(), 0);
    std::shuffle(cell.begin(), cell.end(), g);
    std::uniform_int_distribution<std::int32_t> len(0, static_cast<std::int32_t>(s.capacity));
    std::int32_t length = len(g);
    for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int32_t>(3 * i + 1);
    index_list freed;
    cell_cache_view v{c.dense_view(), cell.data(), pos.data(), &length, &freed};

    index_list keep;
    std::bernoulli_distribution take(0.5);
    for (std::int32_t i = 0; i < length; ++i)
      if (take(g)) keep.push_back(i);
    const auto plan = triattn::keep_plan::shared(s.num_layers, s.num_kv_heads, keep);
    const auto rows_before = c.snapshot();
    const index_list cell_before = cell, pos_before = pos;
    const std::int32_t length_before = length;
    const auto states_before = std::make_pair(st.per_head, st.per_query);
    auto states = st.states();

    // A hand-built plan whose rows differ is refused before the hook runs.
    if (s.num_layers * s.num_kv_heads > 1 && !keep.empty()) {
      triattn::keep_plan uneven(s.num_layers, s.num_kv_heads);
      for (int r = 0; r < s.num_layers * s.num_kv_heads; ++r)
        uneven.push_row(r == 0 ? std::span<const std::int32_t>(keep) : std::span<const std::int32_t>(keep).first(keep.size() - 1));
      CHECK_THROWS_WITH(triattn::compact(v, uneven, states), Catch::Contains("triattn::compact") && Catch::Contains("equal_lengths"));
    }
    // An engine that refuses leaves everything as it was, the state included.
    v.refuse = true;
    CHECK_THROWS_WITH(triattn::compact(v, plan, states), Catch::Contains("the engine refused"));
    CHECK((cell == cell_before && pos == pos_before && length == length_before));
    CHECK(std::make_pair(st.per_head, st.per_query) == states_before);
    CHECK(freed.empty());

    v.refuse = false;
    const auto result = triattn::compact(v, plan, states);
    CHECK(result.freed_pages.empty());
    CHECK(c.snapshot() == rows_before);  // no K or V row moved
    REQUIRE(length == static_cast<std::int32_t>(keep.size()));
    index_list want_freed;
    for (std::int32_t i = 0, k = 0; i < length_before; ++i) {
      if (k < static_cast<std::int32_t>(keep.size()) && keep[static_cast<std::size_t>(k)] == i) {
        CHECK(cell[static_cast<std::size_t>(k)] == cell_before[static_cast<std::size_t>(i)]);
        CHECK(pos[static_cast<std::size_t>(k)] == pos_before[static_cast<std::size_t>(i)]);
        ++k;
      } else {
        want_freed.push_back(cell_before[static_cast<std::size_t>(i)]);
      }
    }
    CHECK(freed == want_freed);
    // The state moved as a compaction moves it: slot keep[i] to i, in every row.
    for (int l = 0; l < s.num_layers; ++l)
      for (int h = 0; h < s.num_kv_heads; ++h)
        for (std::size_t i = 0; i < keep.size(); ++i) {
          const auto from = static_cast<std::size_t>((l * s.num_kv_heads + h) * s.capacity + keep[i]);
          REQUIRE(st.a(l, h, static_cast<std::int64_t>(i)) == states_before.first[from]);
          for (int r = 2 * h; r < 2 * h + 2; ++r)
            REQUIRE(st.b(l, r, static_cast<std::int64_t>(i)) ==
                    states_before.second[static_cast<std::size_t>(l * st.layer_stride + r * st.row_stride + keep[i])]);
        }
  }
}
