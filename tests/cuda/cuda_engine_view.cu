// Every GPU policy reads a cache through the view's accessor, as the CPU does: an engine's
// own view (engine_view.hpp: K and V interleaved, int16 fixed point with a step per layer,
// decoded only by the view's `key_accessor` / `value_accessor`; its geometry says f16) scored
// by SnapKV, R-KV, TriAttention and VATP. Each is compared with
// - the same kernels over a dense f32 cache holding the decoded values (the "mirror"): the
//   kernels then see the same floats, so scores and keep sets must be identical;
// - the CPU: the double-precision oracle on the mirror (SnapKV, R-KV, VATP) and the CPU
//   TriAttention policy over the engine view itself, keep sets identical wherever the oracle's
//   cut is not a near-tie.
// A kernel that decoded by the dtype instead would read other numbers, NaNs among them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/engine_view.hpp"
#include "cuda/gpu_plan.cuh"
#include "cuda/reference.hpp"
#include "cuda/reference_accumulated.hpp"
#include "cuda/reference_engine_view.hpp"
#include "cuda/reference_window.hpp"
#include "support/random.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "triattn/cuda/accumulated.cuh"
#include "triattn/cuda/rkv.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/snapkv.cuh"
#include "triattn/cuda/triattention.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn_test::cache_layout;

constexpr float untouched = -12345.0f;  // written to the scores beforehand: slots past a length keep it

/// A batch of engine caches on the device: per sequence its layers, their pointer array,
/// lengths and positions, and a device array of views.
class device_engine_batch {
 public:
  explicit device_engine_batch(std::vector<engine_cache>& hosts) {
    std::vector<engine_view> views;
    for (auto& h : hosts) {
      sequence& q = sequences_.emplace_back();
      std::vector<std::byte*> pointers;
      for (const auto& layer : h.layers) {
        q.layers.emplace_back(layer);
        pointers.push_back(q.layers.back().get());
      }
      q.pointers = device_buffer<std::byte*>(pointers);
      q.lengths = device_buffer<std::int32_t>(h.lengths);
      q.positions = device_buffer<std::int32_t>(h.positions);
      views.push_back({h.geometry, q.pointers.get(), q.lengths.get(), q.positions.get(), h.capacity});
    }
    views_ = device_buffer<engine_view>(views);
    geometry_ = hosts.front().geometry;
    capacity_ = hosts.front().capacity;
  }
  triattn::cuda::view_batch<engine_view> batch() const {
    return {views_.get(), static_cast<int>(sequences_.size()), geometry_, capacity_};
  }

 private:
  struct sequence {
    std::vector<device_buffer<std::byte>> layers;
    device_buffer<std::byte*> pointers;
    device_buffer<std::int32_t> lengths, positions;
  };
  std::vector<sequence> sequences_;
  device_buffer<engine_view> views_;
  triattn::kv_geometry geometry_{};
  std::int64_t capacity_ = 0;
};

/// `batch` random dense f32 caches of `shape` (the mirrors) and the engine caches holding
/// them; the mirrors then hold the decoded values. `same_slots_every_layer`: every layer
/// gets layer 0's lengths and positions (a per_kv_head round needs them).
struct engine_case {
  std::vector<triattn_test::test_cache> mirrors;
  std::vector<engine_cache> engines;

  engine_case(const triattn_test::cache_shape& shape, int batch, bool same_slots_every_layer, std::mt19937_64& g) {
    mirrors.reserve(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      auto& c = mirrors.emplace_back(shape, g);
      for (int l = 1; l < shape.num_layers && same_slots_every_layer; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          c.length(l, h) = c.length(0, h);
          for (std::int64_t s = 0; s < shape.capacity; ++s) c.position(l, h, s) = c.position(0, h, s);
        }
    }
    engines.reserve(mirrors.size());
    for (auto& m : mirrors) engines.emplace_back(m);
    for (std::size_t b = 0; b < mirrors.size(); ++b)
      CHECK(cpu::reads_as_mirror(engines[b], mirrors[b]), "the CPU reads sequence ", b, " other than its mirror");
  }
  std::string describe() const { return mirrors.front().shape().describe() + " batch " + std::to_string(mirrors.size()); }
};

/// A shape of at least two layers (the two steps of engine_view.hpp), dense f32 (the mirror).
triattn_test::cache_shape engine_shape(std::mt19937_64& g, int group, int head_dim, std::int64_t capacity) {
  triattn_test::shape_bounds bounds;
  bounds.min_layers = 2;
  triattn_test::cache_shape s = triattn_test::random_shape(g, cache_layout::dense_nhd, triattn::dtype::f32, 4, group, bounds);
  if (head_dim > 0) s.head_dim = head_dim;
  if (capacity > 0) s.capacity = capacity;
  return s;
}

/// Scores of a CUB-style call `score(workspace, bytes, scores, status)` into `floats` scores
/// pre-filled with `untouched`, and its status word.
struct gpu_scores {
  std::vector<float> scores;
  std::int32_t status = -1;
};
template <class F>
gpu_scores run_scores(std::size_t floats, F&& score) {
  device_buffer<float> scores(std::vector<float>(floats, untouched));
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  std::size_t bytes = 0;
  CUDA_REQUIRE(score(nullptr, bytes, scores.get(), status.get()));
  device_buffer<std::byte> ws(bytes);
  CUDA_REQUIRE(score(static_cast<void*>(ws.get()), bytes, scores.get(), status.get()));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {scores.download(), status.download()[0]};
}

// --- SnapKV and R-KV ------------------------------------------------------------------------

cudaError_t window_score(void* ws, std::size_t& bytes, const auto& batch, const triattn::cuda::window_query_batch& q,
                         const triattn::snapkv_config& c, float* scores, std::int32_t* status) {
  return triattn::cuda::snapkv_score(ws, bytes, batch, q, c, scores, status, nullptr);
}
cudaError_t window_score(void* ws, std::size_t& bytes, const auto& batch, const triattn::cuda::window_query_batch& q,
                         const triattn::rkv_config& c, float* scores, std::int32_t* status) {
  return triattn::cuda::rkv_score(ws, bytes, batch, q, c, scores, status, nullptr);
}
triattn::cuda::snapkv_scorer window_scorer(const triattn::snapkv_config& c, const triattn::cuda::window_query_batch& q) {
  return {c, q};
}
triattn::cuda::rkv_scorer window_scorer(const triattn::rkv_config& c, const triattn::cuda::window_query_batch& q) {
  return {c, q};
}

/// What the window cases compared.
struct tally {
  int segments = 0, keeps_exact = 0;
};

/// SnapKV or R-KV over `ec`'s engine view and over its mirrors, both against the oracle.
template <class Config>
void window_case(engine_case& ec, const Config& config, int rows, std::int32_t budget, double abs_tol,
                 double rel_tol, std::mt19937_64& g, tally& t) {
  INFO_SCOPE(ec.describe(), " rows ", rows, " window ", config.window, " kernel ", config.kernel, " budget ", budget);
  const triattn_test::cache_shape& shape = ec.mirrors.front().shape();
  // Queries at increasing positions from [0, 150]: some keys come after some queries (masked).
  std::vector<cpu::sequence_queries> queries;
  std::vector<float> all_q;
  std::vector<std::int32_t> all_positions;
  std::uniform_int_distribution<std::int32_t> start(0, 150), gap(1, 3);
  const std::size_t q_floats = static_cast<std::size_t>(shape.num_layers) * shape.num_kv_heads * shape.group *
                               static_cast<std::size_t>(rows) * static_cast<std::size_t>(shape.head_dim);
  for (std::size_t b = 0; b < ec.mirrors.size(); ++b) {
    cpu::sequence_queries s;
    s.rows = rows;
    s.q = triattn_test::normal_floats(g, q_floats);
    for (std::int32_t i = 0, p = start(g); i < rows; ++i, p += gap(g)) s.positions.push_back(p);
    all_q.insert(all_q.end(), s.q.begin(), s.q.end());
    all_positions.insert(all_positions.end(), s.positions.begin(), s.positions.end());
    queries.push_back(std::move(s));
  }
  const device_buffer<float> d_q(all_q);
  const device_buffer<std::int32_t> d_positions(all_positions);
  const triattn::cuda::window_query_batch q{d_q.get(), d_positions.get(), rows};

  const device_engine_batch engine(ec.engines);
  const device_batch<triattn::dense_kv_view> mirror(ec.mirrors);
  const std::size_t segments = ec.mirrors.size() * static_cast<std::size_t>(shape.num_layers * shape.num_kv_heads);
  const std::size_t floats = segments * static_cast<std::size_t>(shape.capacity);
  const auto scores_over = [&](const auto& batch) {
    return run_scores(floats, [&](void* ws, std::size_t& bytes, float* scores, std::int32_t* status) {
      return window_score(ws, bytes, batch, q, config, scores, status);
    });
  };
  const gpu_scores got = scores_over(engine.batch()), mirrored = scores_over(mirror.batch());
  const gpu_plan plan = run_plan(engine.batch(), window_scorer(config, q), triattn::round_options{}, nullptr, 0, budget);
  const gpu_plan mirror_plan =
      run_plan(mirror.batch(), window_scorer(config, q), triattn::round_options{}, nullptr, 0, budget);
  CHECK(got.status == 0, "score status ", got.status);
  CHECK(plan.status == 0, "plan status ", plan.status);
  CHECK(got.scores == mirrored.scores, "the scores over the engine view differ from those over the f32 mirror");
  CHECK(plan == mirror_plan, "the keep plan over the engine view differs from the one over the f32 mirror");

  std::size_t seg = 0;
  for (std::size_t b = 0; b < ec.mirrors.size(); ++b)
    for (int l = 0; l < shape.num_layers; ++l)
      for (int h = 0; h < shape.num_kv_heads; ++h, ++seg) {
        auto& c = ec.mirrors[b];
        const std::int32_t n = c.length(l, h);
        INFO_SCOPE("sequence ", b, " layer ", l, " kv_head ", h, " length ", n);
        const cpu::window_expectation e = cpu::expect(c, queries[b], l, h, config, budget);
        if (e.threshold_margin <= 1e-5) continue;  // a cosine at R-KV's threshold may fall either way in fp32
        ++t.segments;
        const float* row = got.scores.data() + seg * static_cast<std::size_t>(shape.capacity);
        for (std::int32_t j = 0; j < n; ++j) {
          const double want = e.scores[static_cast<std::size_t>(j)];
          if (std::isinf(want))
            CHECK(row[j] == want, "slot ", j, " got ", row[j], " want ", want);
          else
            CHECK(std::fabs(row[j] - want) <= abs_tol + rel_tol * std::fabs(want), "slot ", j, " got ", row[j], " want ", want);
        }
        if (e.keep_margin > 1e-4 && !e.tied_cut) {
          ++t.keeps_exact;
          CHECK(plan.row(seg) == e.keep, "keep set differs from the oracle's (margin ", e.keep_margin, ")");
        }
      }
}

/// head_dim and capacity of trial t: small random ones, and every third a large one (several
/// slot blocks and similarity tiles, a partial last tile).
void trial_size(int t, int& head_dim, std::int64_t& capacity) {
  head_dim = t % 3 == 2 ? (t % 2 == 0 ? 72 : 128) : 0;
  capacity = t % 3 == 2 ? 100 : 0;
}

TRIATTN_CUDA_TEST("SnapKV on the GPU reads keys through the engine view's accessor") {
  auto g = triattn_test::rng(71);
  tally t;
  for (int trial = 0; trial < 18; ++trial) {
    int head_dim;
    std::int64_t capacity;
    trial_size(trial, head_dim, capacity);
    engine_case ec(engine_shape(g, 1 << (trial % 3), head_dim, capacity), 1 + trial % 2, false, g);
    triattn::snapkv_config c;
    c.window = std::uniform_int_distribution<int>(1, 6)(g);
    c.kernel = 2 * std::uniform_int_distribution<int>(0, 3)(g) + 1;
    c.pool = trial % 2 == 0 ? triattn::pooling::max : triattn::pooling::avg;
    const int rows = std::uniform_int_distribution<int>(1, c.window)(g);
    const auto budget = static_cast<std::int32_t>(
        std::uniform_int_distribution<std::int64_t>(1, ec.mirrors.front().shape().capacity)(g));
    window_case(ec, c, rows, budget, 2e-5, 2e-5, g, t);
  }
  INFO_SCOPE("segments ", t.segments, ", exact keeps ", t.keeps_exact);
  CHECK(t.segments > 40);
  CHECK(t.keeps_exact > 20);
}

TRIATTN_CUDA_TEST("R-KV on the GPU reads keys through the engine view's accessor") {
  auto g = triattn_test::rng(72);
  tally t;
  for (int trial = 0; trial < 18; ++trial) {
    int head_dim;
    std::int64_t capacity;
    trial_size(trial, head_dim, capacity);
    engine_case ec(engine_shape(g, 1 << (trial % 3), head_dim, capacity), 1 + trial % 2, false, g);
    triattn::rkv_config c;
    c.window = std::uniform_int_distribution<int>(1, 6)(g);
    c.kernel = 2 * std::uniform_int_distribution<int>(0, 3)(g) + 1;
    c.lambda = std::uniform_real_distribution<float>(0.0f, 1.0f)(g);
    // Long random keys crowd their cosines near 0: thresholds away from it there.
    c.threshold = capacity > 0 ? (trial % 2 == 0 ? 0.5f : -0.5f) : std::uniform_real_distribution<float>(-0.3f, 0.9f)(g);
    const int rows = std::uniform_int_distribution<int>(1, c.window)(g);
    const auto budget = static_cast<std::int32_t>(
        std::uniform_int_distribution<std::int64_t>(1, ec.mirrors.front().shape().capacity)(g));
    window_case(ec, c, rows, budget, 1e-5, 1e-4, g, t);
  }
  INFO_SCOPE("segments ", t.segments, ", exact keeps ", t.keeps_exact);
  CHECK(t.segments > 40);
  CHECK(t.keeps_exact > 20);
}

// --- TriAttention ---------------------------------------------------------------------------

TRIATTN_CUDA_TEST("TriAttention on the GPU reads keys through the engine view's accessor, as the CPU policy does") {
  auto g = triattn_test::rng(73);
  int decisive = 0;
  for (int trial = 0; trial < 12; ++trial) {
    const auto grain = trial % 2 == 0 ? triattn::granularity::per_layer : triattn::granularity::per_kv_head;
    triattn_test::cache_shape shape =
        engine_shape(g, 1 << (trial % 3), trial % 3 == 0 ? 8 : (trial % 3 == 1 ? 64 : 128),
                     std::uniform_int_distribution<std::int64_t>(1, 200)(g));
    shape.keys = trial % 4 < 2 ? triattn::key_state::post_rope : triattn::key_state::pre_rope;
    shape.rope.theta = shape.keys == triattn::key_state::pre_rope ? 1e6 : 1e4;
    const int batch = 1 + trial % 3;
    engine_case ec(shape, batch, grain != triattn::granularity::per_layer, g);
    triattn::triattention_config cfg;
    cfg.round.grain = grain;
    cfg.normalize = trial % 4 != 3;
    cfg.gqa_reduction = trial % 2 ? triattn::triattention_gqa_reduction::max : triattn::triattention_gqa_reduction::mean;
    cfg.window = static_cast<std::int64_t>(g() % 8);
    const std::int64_t prompt_length = trial % 3 == 1 ? static_cast<std::int64_t>(g() % 60) : 0;
    const std::int32_t budget = std::vector<std::int32_t>{1, 7, 64}[static_cast<std::size_t>(trial % 3)];
    INFO_SCOPE(ec.describe(), " ", triattn::granularity_name(grain), " budget ", budget, " prompt ", prompt_length);

    std::vector<std::int64_t> round_starts;
    for (const auto& c : ec.mirrors)
      round_starts.push_back(*std::max_element(c.positions.begin(), c.positions.end()) + 1 +
                             std::uniform_int_distribution<std::int64_t>(0, 1000)(g));
    const triattn::query_stats stats = triattn_test::ref::tri_random_stats(g, ec.mirrors.front().geometry());
    device_buffer<float> stats_buffer(triattn::cuda::stats_floats(stats));
    triattn::cuda::triattention_device_stats device_stats{};
    CUDA_REQUIRE(triattn::cuda::upload_stats(stats, stats_buffer.get(), nullptr, device_stats));
    const device_buffer<std::int64_t> d_round_starts(round_starts);

    const device_engine_batch engine(ec.engines);
    const device_batch<triattn::dense_kv_view> mirror(ec.mirrors);
    const std::size_t floats =
        static_cast<std::size_t>(batch) * shape.num_layers * shape.num_kv_heads * shape.group * shape.capacity;
    const auto raw_over = [&](const auto& b) {
      return run_scores(floats, [&](void* ws, std::size_t& bytes, float* scores, std::int32_t* status) {
        return triattn::cuda::triattention_score(ws, bytes, b, device_stats, cfg, d_round_starts.get(), scores, status,
                                                 nullptr);
      });
    };
    const gpu_scores raw = raw_over(engine.batch()), mirrored = raw_over(mirror.batch());
    CHECK(raw.status == 0, "score status ", raw.status);
    CHECK(raw.scores == mirrored.scores, "raw scores over the engine view differ from those over the f32 mirror");
    const triattn::cuda::triattention_scorer scorer{device_stats, cfg};
    const gpu_plan plan = run_plan(engine.batch(), scorer, cfg.round, d_round_starts.get(), prompt_length, budget);
    CHECK(plan.status == 0, "plan status ", plan.status);
    CHECK(plan == run_plan(mirror.batch(), scorer, cfg.round, d_round_starts.get(), prompt_length, budget),
          "the keep plan over the engine view differs from the one over the f32 mirror");

    for (int b = 0; b < batch; ++b) {
      const auto ub = static_cast<std::size_t>(b);
      const cpu::keep_rows expected =
          cpu::triattention_plan(ec.engines[ub], stats, cfg, round_starts[ub], prompt_length, budget);
      CHECK(expected == cpu::triattention_plan(ec.mirrors[ub], stats, cfg, round_starts[ub], prompt_length, budget),
            "the CPU plans sequence ", b, " over the engine view other than over its f32 mirror");
      const double margin = cpu::triattention_margin(ec.mirrors[ub], stats, cfg, round_starts[ub], prompt_length, budget);
      if (margin <= (cfg.normalize ? 2e-4 : 2e-5)) continue;  // a near-tie two fp32 scorers may cut differently
      ++decisive;
      for (std::size_t r = 0; r < expected.size(); ++r)
        CHECK(plan.row(ub * expected.size() + r) == expected[r], "sequence ", b, " row (layer x kv_head) ", r);
    }
  }
  CHECK(decisive > 8, "decisive sequences ", decisive);
}

// --- VATP (values through the value accessor) -----------------------------------------------

TRIATTN_CUDA_TEST("VATP on the GPU reads values through the engine view's accessor") {
  auto g = triattn_test::rng(74);
  int compared = 0;
  for (int trial = 0; trial < 12; ++trial) {
    const triattn_test::cache_shape shape = engine_shape(g, 1 << (trial % 3), trial % 2 == 0 ? 0 : 128, 0);
    const int batch = 1 + trial % 3;
    engine_case ec(shape, batch, false, g);
    constexpr triattn::gqa_aggregation aggregations[] = {triattn::gqa_aggregation::mean, triattn::gqa_aggregation::max,
                                                         triattn::gqa_aggregation::sum};
    const triattn::gqa_aggregation agg = aggregations[trial % 3];
    const bool normalize = trial % 2 == 1;
    INFO_SCOPE(ec.describe(), " ", triattn::gqa_aggregation_name(agg), normalize ? " normalized" : "");

    // Two rows of random attention per (layer, q_head), summed on the host, uploaded.
    std::vector<cpu::accumulated_sums> states;
    std::vector<float> sums;
    std::vector<std::int32_t> counts;
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    const int Hq = shape.num_kv_heads * shape.group;
    for (auto& c : ec.mirrors) {
      cpu::accumulated_sums& st = states.emplace_back(c);
      for (int step = 0; step < 2; ++step) {
        std::vector<float> probs(static_cast<std::size_t>(shape.num_layers) * Hq * shape.capacity, 0.0f);
        for (int l = 0; l < shape.num_layers; ++l)
          for (int qh = 0; qh < Hq; ++qh)
            for (std::int32_t s = 0; s < c.length(l, qh / shape.group); ++s)
              probs[(static_cast<std::size_t>(l) * Hq + qh) * shape.capacity + s] = u(g);
        cpu::accumulate(c, probs.data(), 1.0f, st);
      }
      sums.insert(sums.end(), st.sums.begin(), st.sums.end());
      counts.insert(counts.end(), st.counts.begin(), st.counts.end());
    }
    device_buffer<float> d_sums(sums);
    device_buffer<std::int32_t> d_counts(counts);
    const triattn::cuda::accumulated_state state{d_sums.get(), d_counts.get()};
    const triattn::cuda::accumulated_scoring scoring{agg, normalize, true};

    const device_engine_batch engine(ec.engines);
    const device_batch<triattn::dense_kv_view> mirror(ec.mirrors);
    const std::size_t floats = static_cast<std::size_t>(batch) * shape.num_layers * shape.num_kv_heads * shape.capacity;
    const auto scores_over = [&](const auto& b) {
      return run_scores(floats, [&](void*, std::size_t&, float* scores, std::int32_t* status) {
        return triattn::cuda::score_accumulated(b, state, scoring, scores, status, nullptr);
      });
    };
    const gpu_scores got = scores_over(engine.batch()), mirrored = scores_over(mirror.batch());
    CHECK(got.status == 0, "score status ", got.status);
    CHECK(got.scores == mirrored.scores, "the scores over the engine view differ from those over the f32 mirror");
    triattn::h2o_config h2o;
    h2o.gqa = agg;
    h2o.normalize = normalize;
    const auto scorer = triattn::cuda::accumulated_scorer::vatp(state, h2o);
    const std::int32_t budget = 1 + static_cast<std::int32_t>(g() % static_cast<std::uint64_t>(shape.capacity));
    const gpu_plan plan = run_plan(engine.batch(), scorer, h2o.round, nullptr, 0, budget);
    CHECK(plan.status == 0, "plan status ", plan.status);
    CHECK(plan == run_plan(mirror.batch(), scorer, h2o.round, nullptr, 0, budget),
          "the keep plan over the engine view differs from the one over the f32 mirror");

    for (int b = 0; b < batch; ++b) {
      auto& c = ec.mirrors[static_cast<std::size_t>(b)];
      const std::vector<double> want =
          cpu::accumulated_scores(c, states[static_cast<std::size_t>(b)], agg, normalize, true);
      for (int l = 0; l < shape.num_layers; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          const std::size_t row = (static_cast<std::size_t>(l) * shape.num_kv_heads + h) * shape.capacity;
          const std::size_t at = static_cast<std::size_t>(b) * shape.num_layers * shape.num_kv_heads * shape.capacity + row;
          for (std::int32_t s = 0; s < c.length(l, h); ++s, ++compared)
            CHECK(std::fabs(got.scores[at + s] - want[row + s]) <= 5e-5 * std::fabs(want[row + s]) + 1e-30,
                  "sequence ", b, " layer ", l, " kv_head ", h, " slot ", s, " got ", got.scores[at + s], " want ",
                  want[row + s]);
        }
    }
  }
  CHECK(compared > 500, "slots compared ", compared);
}

}  // namespace
