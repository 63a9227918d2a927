// Rounds on threads: `parallel_for` runs every item once and rethrows the lowest item's error;
// TriAttention, SnapKV, H2O and StreamingLLM rounds leave byte-identical caches (K, V,
// positions, lengths) at 1, 2 and 3 threads, on fresh random caches with a random length per
// kv_head and decisions per (layer, kv_head) or per kv_head, so that rows are scored,
// selected and compacted by different workers.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "triattn/core/parallel.hpp"
#include "triattn/core/round.hpp"
#include "triattn/policies/h2o.hpp"
#include "triattn/policies/snapkv.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"

namespace {

TEST_CASE("parallel_for runs every item once and rethrows the lowest failing item") {
  for (const int n : {1, 2, 3, 8}) {
    std::vector<std::atomic<int>> runs(97);
    triattn::threads(n)(97, [&](std::int64_t i, int worker) {
      REQUIRE((worker >= 0 && worker < n));
      runs[static_cast<std::size_t>(i)].fetch_add(1);
    });
    for (const auto& r : runs) CHECK(r.load() == 1);
    try {
      triattn::threads(n)(40, [&](std::int64_t i, int) {
        if (i == 31 || i == 7) throw std::runtime_error("item " + std::to_string(i));
      });
      FAIL("no exception");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "item 7");
    }
  }
  CHECK_THROWS_WITH(triattn::threads(0), Catch::Contains("triattn::threads") && Catch::Contains("0"));
}

struct cache {
  int layers = 3, kv_heads = 3, group = 2, head_dim = 16;
  std::int64_t capacity = 96;
  std::vector<float> k, v;
  std::vector<std::byte*> k_layers, v_layers;
  std::vector<std::int32_t> lengths, positions;
  std::vector<double> inv_freq;
  triattn::dense_kv_view view;

  explicit cache(std::mt19937_64& g) {
    std::normal_distribution<float> n;
    const std::size_t layer = static_cast<std::size_t>(kv_heads) * capacity * head_dim;
    k.resize(layer * layers);
    v.resize(layer * layers);
    for (float& x : k) x = n(g);
    for (float& x : v) x = n(g);
    for (std::size_t i = 0; i < k.size(); i += 7) k[i] = k[i / 2];  // duplicate rows: ties
    for (int l = 0; l < layers; ++l) {
      k_layers.push_back(reinterpret_cast<std::byte*>(k.data() + l * layer));
      v_layers.push_back(reinterpret_cast<std::byte*>(v.data() + l * layer));
    }
    std::uniform_int_distribution<std::int32_t> len(40, static_cast<std::int32_t>(capacity));
    std::vector<std::int32_t> per_head(static_cast<std::size_t>(kv_heads));
    for (std::int32_t& m : per_head) m = len(g);
    for (int l = 0; l < layers; ++l) lengths.insert(lengths.end(), per_head.begin(), per_head.end());  // per_kv_head shares rows across layers
    positions.resize(static_cast<std::size_t>(layers) * kv_heads * capacity);
    for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % capacity);
    for (int f = 0; f < head_dim / 2; ++f) inv_freq.push_back(std::pow(1e4, -2.0 * f / head_dim));
    view.geo = {layers, kv_heads * group, kv_heads, head_dim, triattn::dtype::f32, triattn::key_state::post_rope, {}};
    view.geo.rope.inv_freq_table = inv_freq.data();
    view.k_layers = k_layers.data();
    view.v_layers = v_layers.data();
    view.k_stride = view.v_stride = triattn::kv_strides::hnd(capacity, head_dim);
    view.slots = {lengths.data(), positions.data(), capacity};
  }
  cache(const cache& o) : cache(o, 0) {}

 private:
  cache(const cache& o, int) : layers(o.layers), kv_heads(o.kv_heads), group(o.group), head_dim(o.head_dim),
                               capacity(o.capacity), k(o.k), v(o.v), lengths(o.lengths), positions(o.positions),
                               inv_freq(o.inv_freq), view(o.view) {
    const std::size_t layer = static_cast<std::size_t>(kv_heads) * capacity * head_dim;
    for (int l = 0; l < layers; ++l) {
      k_layers.push_back(reinterpret_cast<std::byte*>(k.data() + l * layer));
      v_layers.push_back(reinterpret_cast<std::byte*>(v.data() + l * layer));
    }
    view.k_layers = k_layers.data();
    view.v_layers = v_layers.data();
    view.geo.rope.inv_freq_table = inv_freq.data();
    view.slots = {lengths.data(), positions.data(), capacity};
  }
};

triattn::query_stats stats_for(const cache& c, std::mt19937_64& g) {
  std::normal_distribution<float> n;
  triattn::query_stats s;
  s.num_layers = c.layers;
  s.num_q_heads = c.kv_heads * c.group;
  s.num_kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.inv_freq = c.inv_freq;
  for (int i = 0; i < c.layers * s.num_q_heads * c.head_dim / 2; ++i) {
    const float re = n(g), im = n(g);
    s.q_mean_real.push_back(re);
    s.q_mean_imag.push_back(im);
    s.q_abs_mean.push_back(std::hypot(re, im) * 1.3f);
  }
  return s;
}

/// Compresses copies of `base` with a fresh policy from `make` at 1, 2 and 3 threads.
template <class Make>
void check_same_at_every_thread_count(const cache& base, std::int64_t budget, Make make) {
  std::vector<cache> done;
  for (const int n : {1, 2, 3}) {
    cache c(base);
    auto policy = make(c);
    triattn::round_context ctx;
    ctx.parallel = triattn::threads(n);
    triattn::compress(policy, c.view, budget, ctx);
    done.push_back(c);
  }
  for (std::size_t i = 1; i < done.size(); ++i) {
    CHECK(done[i].lengths == done[0].lengths);
    CHECK(done[i].positions == done[0].positions);
    CHECK(done[i].k == done[0].k);
    CHECK(done[i].v == done[0].v);
  }
  CHECK(done[0].lengths != base.lengths);  // the round did evict
}

TEST_CASE("rounds keep the same sets at every thread count") {
  std::mt19937_64 g(Catch::rngSeed());
  for (int trial = 0; trial < 6; ++trial) {
    const cache base(g);
    const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(1, 39)(g);
    const triattn::query_stats stats = stats_for(base, g);
    for (const auto grain : {triattn::granularity::per_layer, triattn::granularity::per_kv_head}) {
      INFO("trial " << trial << " budget " << budget << " granularity " << triattn::granularity_name(grain));
      check_same_at_every_thread_count(base, budget, [&](cache&) {
        triattn::triattention_config cfg = triattn::triattention_config::paper();
        cfg.round.grain = grain;
        cfg.window = 4;
        return triattn::triattention(stats, cfg);
      });
      if (grain != triattn::granularity::per_layer) continue;  // the others need equal rows
      check_same_at_every_thread_count(base, budget, [&](cache& c) {
        triattn::snapkv p(triattn::snapkv_config::decode());
        p.attach(c.view);
        std::mt19937_64 q(7);
        std::normal_distribution<float> n;
        std::vector<float> row(static_cast<std::size_t>(c.head_dim));
        for (int t = 0; t < 8; ++t)
          for (int l = 0; l < c.layers; ++l)
            for (int h = 0; h < c.kv_heads * c.group; ++h) {
              for (float& x : row) x = n(q);
              p.observe(l, h, static_cast<std::int32_t>(c.capacity + t), row);
            }
        return p;
      });
      check_same_at_every_thread_count(base, budget, [&](cache& c) {
        triattn::h2o p;
        p.attach(c.view);
        std::mt19937_64 q(9);
        std::uniform_real_distribution<float> u(0.0f, 1.0f);
        for (int l = 0; l < c.layers; ++l)
          for (int h = 0; h < c.kv_heads * c.group; ++h) {
            std::vector<float> probs(static_cast<std::size_t>(c.lengths[static_cast<std::size_t>(l * c.kv_heads + h / c.group)]));
            float sum = 0.0f;
            for (float& x : probs) sum += x = u(q) * u(q);
            for (float& x : probs) x /= sum;
            p.observe(l, h, static_cast<std::int32_t>(c.capacity), {}, probs);
          }
        return p;
      });
      check_same_at_every_thread_count(base, budget, [&](cache&) { return triattn::streaming_llm{}; });
    }
  }
}

}  // namespace
