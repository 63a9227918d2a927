// Whole compression rounds on the CPU (issue 14): 36 layers x 8 kv-heads x 4 q-heads per group
// x 128 dims x 8K tokens, bf16, HND, budget 2048, post-RoPE keys, at 1 and 2 threads
// (benchmark argument), beside the reads and copies of the same bytes in the same run.
//   read_kv        – K and V read once (64-bit words, 8 partial sums): the round's floor;
//   memcpy_kept    – a memcpy of as many bytes as the kept rows (2048 rows of each (layer,
//                    kv_head), K and V), from one contiguous block;
//   memcpy_rows    – a memcpy of each row TriAttention's round keeps, from where it lies, to a
//                    separate buffer: the same gather as compaction, with no bookkeeping;
//   plan/<policy>  – `plan_round`: scoring and selection;
//   compact/<p>    – `compact` of that plan (positions and policy state included);
//   round/<p>      – `compress`: plan and compaction, what an engine calls;
//   select         – `select_keep` alone over the 8 decisions of a per-KV-head round.
// Between iterations the lengths and positions are restored (not timed): the rows compaction
// overwrote then hold other keys of the same distribution, which costs the same to score.
// The counter `same_keep_sets` is 1 when the plans at 1 and 2 threads are identical.
// `bench/cpu_ratios.py` turns a JSON run into the ratios docs/performance.md quotes.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "triattn/registry.hpp"
#include "triattn/triattn.hpp"

namespace {

constexpr int layers = 36, kv_heads = 8, group = 4, q_heads = kv_heads * group, head_dim = 128, bands = head_dim / 2;
constexpr std::int64_t tokens = 8192, budget = 2048;
constexpr std::size_t layer_elements = std::size_t{kv_heads} * tokens * head_dim;

struct cache {
  std::vector<std::uint16_t> k, v;  // bf16 bits [layers, kv_heads, tokens, head_dim]
  std::vector<std::byte*> k_layers, v_layers;
  std::vector<std::int32_t> lengths, positions, original_positions;
  std::vector<double> inv_freq;
  triattn::dense_kv_view view;

  cache() {
    // A fast generator: 600M bf16 elements; Box-Muller pairs of a 64-bit LCG's halves.
    std::uint64_t state = 0x9e3779b97f4a7c15ull;
    const auto uniform = [&]() {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return (static_cast<double>(state >> 11) + 0.5) * 0x1p-53;
    };
    const auto fill = [&](std::vector<std::uint16_t>& x) {
      x.resize(layers * layer_elements);
      for (std::size_t i = 0; i + 1 < x.size(); i += 2) {
        const double r = std::sqrt(-2.0 * std::log(uniform())), t = 6.283185307179586 * uniform();
        x[i] = triattn::float_to_bf16_bits(static_cast<float>(r * std::cos(t)));
        x[i + 1] = triattn::float_to_bf16_bits(static_cast<float>(r * std::sin(t)));
      }
    };
    fill(k);
    fill(v);
    for (int l = 0; l < layers; ++l) {
      k_layers.push_back(reinterpret_cast<std::byte*>(k.data() + l * layer_elements));
      v_layers.push_back(reinterpret_cast<std::byte*>(v.data() + l * layer_elements));
    }
    lengths.assign(std::size_t{layers} * kv_heads, static_cast<std::int32_t>(tokens));
    original_positions.resize(std::size_t{layers} * kv_heads * tokens);
    for (std::size_t i = 0; i < original_positions.size(); ++i)
      original_positions[i] = static_cast<std::int32_t>(i % tokens);
    positions = original_positions;
    for (int f = 0; f < bands; ++f) inv_freq.push_back(std::pow(1e6, -2.0 * f / head_dim));
    view.geo = {layers, q_heads, kv_heads, head_dim, triattn::dtype::bf16, triattn::key_state::post_rope, {}};
    view.geo.rope.inv_freq_table = inv_freq.data();
    view.k_layers = k_layers.data();
    view.v_layers = v_layers.data();
    view.k_stride = view.v_stride = triattn::kv_strides::hnd(tokens, head_dim);
    view.slots = {lengths.data(), positions.data(), tokens};
  }

  void restore() {
    std::fill(lengths.begin(), lengths.end(), static_cast<std::int32_t>(tokens));
    positions = original_positions;
  }
};

cache& kv() {
  static cache c;
  return c;
}

/// Calibration-like statistics (random, E|q| >= |E q|).
triattn::query_stats make_stats() {
  std::mt19937_64 g(7);
  std::normal_distribution<float> n;
  triattn::query_stats s;
  s.num_layers = layers;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.inv_freq = kv().inv_freq;
  for (int i = 0; i < layers * q_heads * bands; ++i) {
    const float re = n(g), im = n(g);
    s.q_mean_real.push_back(re);
    s.q_mean_imag.push_back(im);
    s.q_abs_mean.push_back(std::hypot(re, im) * 1.5f);
  }
  return s;
}

/// Policy `name` of the registry (its default configuration), fed as an engine would have fed
/// it at this point of a generation: 4 rows of attention per q-head for a policy that reads
/// attention, its window of 8 queries for one that reads queries.
template <class F>
void with_policy(std::string_view name, F&& f) {
  cache& c = kv();
  std::mt19937_64 g(11);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::normal_distribution<float> n;
  const triattn::policy_entry& entry = *triattn::find_policy(name);
  const triattn::query_stats stats = make_stats();
  triattn::policy_inputs in;
  in.stats = &stats;
  triattn::any_policy p = *entry.create(in);
  p.attach(c.view);
  if (entry.needs.attention) {
    std::vector<float> probs(tokens);
    for (int row = 0; row < 4; ++row)
      for (int l = 0; l < layers; ++l)
        for (int q = 0; q < q_heads; ++q) {
          float sum = 0.0f;
          for (float& x : probs) sum += x = u(g) * u(g) * u(g);
          for (float& x : probs) x /= sum;
          p.observe(l, q, static_cast<std::int32_t>(tokens) + row, {}, probs);
        }
  }
  if (entry.needs.queries) {
    std::vector<float> q(head_dim);
    for (int row = 0; row < 8; ++row)
      for (int l = 0; l < layers; ++l)
        for (int h = 0; h < q_heads; ++h) {
          for (float& x : q) x = n(g);
          p.observe(l, h, static_cast<std::int32_t>(tokens - 8 + row), q, {});
        }
  }
  f(p);
}

triattn::round_context context(int threads) {
  triattn::round_context ctx;
  ctx.position = tokens;
  ctx.parallel = triattn::threads(threads);
  return ctx;
}

void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * 2 * layers * layer_elements * 2));
}

void read_kv(benchmark::State& state) {
  cache& c = kv();
  const auto threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    std::vector<std::uint64_t> sums(static_cast<std::size_t>(threads) * 8);
    triattn::threads(threads)(2 * layers, [&](std::int64_t i, int worker) {
      const std::uint16_t* base = (i < layers ? c.k.data() : c.v.data()) + (i % layers) * layer_elements;
      std::uint64_t sum[8] = {};
      for (std::size_t e = 0; e + 32 <= layer_elements; e += 32)
        for (std::size_t j = 0; j < 8; ++j) {
          std::uint64_t w;
          std::memcpy(&w, base + e + 4 * j, 8);
          sum[j] += w;
        }
      for (int j = 0; j < 8; ++j) sums[static_cast<std::size_t>(worker) * 8 + j] += sum[j];
    });
    benchmark::DoNotOptimize(sums.data());
  }
  set_bytes(state);
}

void memcpy_kept(benchmark::State& state) {
  cache& c = kv();
  const auto threads = static_cast<int>(state.range(0));
  std::vector<std::uint16_t> to(std::size_t{layers} * kv_heads * budget * head_dim * 2);
  const std::size_t row_block = std::size_t{budget} * head_dim;  // the kept rows of one (layer, kv_head)
  for (auto _ : state) {
    triattn::threads(threads)(2 * layers * kv_heads, [&](std::int64_t i, int) {
      const bool is_v = i >= layers * kv_heads;
      const std::int64_t r = i % (layers * kv_heads);
      const std::uint16_t* from = (is_v ? c.v.data() : c.k.data()) + r * tokens * head_dim + (tokens - budget) * head_dim;
      std::memcpy(to.data() + i * row_block, from, row_block * sizeof(std::uint16_t));
    });
    benchmark::DoNotOptimize(to.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state);
}

void memcpy_rows(benchmark::State& state) {
  cache& c = kv();
  const auto threads = static_cast<int>(state.range(0));
  std::vector<std::uint16_t> to(std::size_t{layers} * kv_heads * budget * head_dim * 2);
  with_policy(triattn::triattention::name, [&](triattn::any_policy& p) {
    c.restore();
    const triattn::keep_plan kept = p.plan(c.view, budget, context(1));
    const std::size_t row_block = std::size_t{budget} * head_dim;
    for (auto _ : state) {
      triattn::threads(threads)(2 * layers * kv_heads, [&](std::int64_t i, int) {
        const bool is_v = i >= layers * kv_heads;
        const int r = static_cast<int>(i % (layers * kv_heads)), l = r / kv_heads, h = r % kv_heads;
        std::uint16_t* out = to.data() + i * row_block;
        const auto keep = kept.row(l, h);
        for (std::size_t k = 0; k < keep.size(); ++k)
          std::memcpy(out + k * head_dim, is_v ? c.view.value(l, h, keep[k]) : c.view.key(l, h, keep[k]),
                      head_dim * sizeof(std::uint16_t));
      });
      benchmark::DoNotOptimize(to.data());
      benchmark::ClobberMemory();
    }
  });
  set_bytes(state);
}

void plan(benchmark::State& state, std::string_view name) {
  cache& c = kv();
  const auto threads = static_cast<int>(state.range(0));
  with_policy(name, [&](triattn::any_policy& p) {
    c.restore();
    const auto serial = p.plan(c.view, budget, context(1));
    const auto parallel = p.plan(c.view, budget, context(2));
    state.counters["same_keep_sets"] = serial.indices == parallel.indices && serial.offsets == parallel.offsets;
    for (auto _ : state) benchmark::DoNotOptimize(p.plan(c.view, budget, context(threads)));
  });
  set_bytes(state);
}

void compact(benchmark::State& state, std::string_view name) {
  cache& c = kv();
  const auto threads = static_cast<int>(state.range(0));
  with_policy(name, [&](triattn::any_policy& p) {
    c.restore();
    const auto kept = p.plan(c.view, budget, context(1));
    for (auto _ : state) {
      state.PauseTiming();
      c.restore();
      std::vector<triattn::slot_state> states;
      if constexpr (requires { p.state(); }) states = p.state();
      state.ResumeTiming();
      triattn::compact(c.view, kept, states, triattn::threads(threads));
    }
    c.restore();
  });
  set_bytes(state);
}

void round(benchmark::State& state, std::string_view name) {
  cache& c = kv();
  const auto threads = static_cast<int>(state.range(0));
  with_policy(name, [&](triattn::any_policy& p) {
    for (auto _ : state) {
      state.PauseTiming();
      c.restore();
      state.ResumeTiming();
      triattn::compress(p, c.view, budget, context(threads));
    }
    c.restore();
  });
  set_bytes(state);
}

void select(benchmark::State& state) {
  std::mt19937_64 g(3);
  std::normal_distribution<float> n;
  std::vector<float> scores(tokens);
  for (float& x : scores) x = n(g);
  std::vector<std::int32_t> positions(tokens);
  for (std::int64_t s = 0; s < tokens; ++s) positions[s] = static_cast<std::int32_t>(s);
  for (auto _ : state)
    for (int d = 0; d < kv_heads; ++d)
      benchmark::DoNotOptimize(triattn::select_keep(scores, positions, triattn::protection{0, 128, 0}, budget));
}

void threads_arg(benchmark::internal::Benchmark* b) {
  b->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
}

int register_all() {
  BENCHMARK(read_kv)->Apply(threads_arg);
  BENCHMARK(memcpy_kept)->Apply(threads_arg);
  BENCHMARK(memcpy_rows)->Apply(threads_arg);
  // Every compressing policy of the registry but R-KV, whose pairwise key similarities over an
  // 8K-token cache take minutes a round.
  for (const triattn::policy_entry& e : triattn::policy_registry) {
    if (!e.compresses() || e.name == triattn::rkv::name) continue;
    const std::string name(e.name);
    benchmark::RegisterBenchmark(("plan/" + name).c_str(), plan, e.name)->Apply(threads_arg);
    benchmark::RegisterBenchmark(("compact/" + name).c_str(), compact, e.name)->Apply(threads_arg);
    benchmark::RegisterBenchmark(("round/" + name).c_str(), round, e.name)->Apply(threads_arg);
  }
  BENCHMARK(select)->Unit(benchmark::kMillisecond)->UseRealTime();
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
