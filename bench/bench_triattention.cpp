// TriAttention scoring on the CPU against the fastest reads of the same keys, in one run
// (issue 14). Shape: 1 layer x 8 kv-heads x 4 q-heads per group x 128 dims x 32K tokens,
// HND, one thread; keys in f32, f16 and bf16 (benchmark argument: the dtype).
//   stream_read  – the key bytes summed as 64-bit words: memory speed, no decoding;
//   stream_copy  – a memcpy of the key bytes;
//   plain_read   – every key element decoded to f32 and summed, vectorised (16 partial sums;
//                  f16 through the hardware's conversion where the compiler has one);
//   score_post   – `triattention::score` over post-RoPE keys;
//   score_pre    – the same keys declared pre-RoPE (rotated to their positions per key).
// `bench/cpu_ratios.py` turns a JSON run into the ratios docs/performance.md and bench/RESULTS.md quote.
#include <benchmark/benchmark.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "triattn/triattn.hpp"

namespace {

constexpr int layers = 1, kv_heads = 8, group = 4, q_heads = kv_heads * group, head_dim = 128, bands = head_dim / 2;
constexpr std::int64_t tokens = 32768, round_start = 40000;
constexpr std::size_t elements = std::size_t{kv_heads} * tokens * head_dim;

const triattn::dtype types[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16};

struct fixture {
  std::vector<float> keys;                        // [kv_heads, tokens, head_dim] (HND, one layer)
  std::vector<std::byte> stored[3];               // the keys in f32, f16, bf16
  std::vector<std::byte> copy_to;                 // stream_copy's destination
  std::vector<std::byte*> bases[3];
  std::vector<std::int32_t> lengths, positions;
  triattn::query_stats stats;

  fixture() {
    std::mt19937_64 g(1234);
    std::normal_distribution<float> n;
    keys.resize(elements);
    for (float& x : keys) x = n(g);
    for (int t = 0; t < 3; ++t) {
      stored[t].resize(elements * triattn::dtype_bytes(types[t]));
      for (std::size_t i = 0; i < elements; ++i) triattn::store_element(stored[t].data(), types[t], i, keys[i]);
      bases[t] = {stored[t].data()};
    }
    copy_to.resize(stored[0].size());
    lengths.assign(kv_heads, static_cast<std::int32_t>(tokens));
    positions.resize(std::size_t{kv_heads} * tokens);
    for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % tokens);

    stats.num_layers = layers;
    stats.num_q_heads = q_heads;
    stats.num_kv_heads = kv_heads;
    stats.head_dim = head_dim;
    for (int f = 0; f < bands; ++f) stats.inv_freq.push_back(std::pow(1e6, -2.0 * f / head_dim));
    for (int i = 0; i < layers * q_heads * bands; ++i) {
      const float re = n(g), im = n(g);
      stats.q_mean_real.push_back(re);
      stats.q_mean_imag.push_back(im);
      stats.q_abs_mean.push_back(std::hypot(re, im) * 1.5f);  // E|q| >= |E q|
    }
  }

  triattn::dense_kv_view view(int t, triattn::key_state keys_state) {
    triattn::dense_kv_view v;
    v.geo = {layers, q_heads, kv_heads, head_dim, types[t], keys_state, {}};
    v.geo.rope.inv_freq_table = stats.inv_freq.data();
    v.k_layers = v.v_layers = bases[t].data();
    v.k_stride = v.v_stride = triattn::kv_strides::hnd(tokens, head_dim);
    v.slots = {lengths.data(), positions.data(), tokens};
    return v;
  }
};

fixture& data() {
  static fixture f;
  return f;
}

void label(benchmark::State& state, int t) {
  state.SetLabel(triattn::dtype_name(types[t]));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * data().stored[t].size()));
}

void stream_read(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const std::vector<std::byte>& bytes = data().stored[t];
  for (auto _ : state) {
    std::uint64_t sum[8] = {};
    for (std::size_t i = 0; i + 64 <= bytes.size(); i += 64)
      for (std::size_t j = 0; j < 8; ++j) {
        std::uint64_t w;
        std::memcpy(&w, bytes.data() + i + 8 * j, 8);
        sum[j] += w;
      }
    benchmark::DoNotOptimize(sum);
  }
  label(state, t);
}

void stream_copy(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  fixture& f = data();
  for (auto _ : state) {
    std::memcpy(f.copy_to.data(), f.stored[t].data(), f.stored[t].size());
    benchmark::DoNotOptimize(f.copy_to.data());
    benchmark::ClobberMemory();
  }
  label(state, t);
}

template <class T, class Decode>
float sum_decoded(const std::vector<std::byte>& bytes, Decode decode) {
  float sum[16] = {};
  const std::size_t n = bytes.size() / sizeof(T);
  for (std::size_t i = 0; i + 16 <= n; i += 16)
    for (std::size_t j = 0; j < 16; ++j) {
      T x;
      std::memcpy(&x, bytes.data() + (i + j) * sizeof(T), sizeof(T));
      sum[j] += decode(x);
    }
  float total = 0.0f;
  for (const float s : sum) total += s;
  return total;
}

#if defined(__F16C__)
float sum_f16c(const std::vector<std::byte>& bytes) {
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const auto* p = reinterpret_cast<const __m128i*>(bytes.data());
  for (std::size_t i = 0; i + 2 <= bytes.size() / 16; i += 2)
    for (std::size_t j = 0; j < 2; ++j) sum[j] = _mm256_add_ps(sum[j], _mm256_cvtph_ps(_mm_loadu_si128(p + i + j)));
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(sum[0], sum[1]));
  float total = 0.0f;
  for (const float x : lanes) total += x;
  return total;
}
#endif

void plain_read(benchmark::State& state) {
  const int t = static_cast<int>(state.range(0));
  const std::vector<std::byte>& bytes = data().stored[t];
  for (auto _ : state) {
    float s = 0.0f;
    if (types[t] == triattn::dtype::f32) {
      s = sum_decoded<float>(bytes, [](float x) { return x; });
    } else if (types[t] == triattn::dtype::bf16) {
      s = sum_decoded<std::uint16_t>(bytes, [](std::uint16_t b) { return triattn::bf16_bits_to_float(b); });
    } else {
#if defined(__F16C__)
      s = sum_f16c(bytes);  // vcvtph2ps
#else
      s = sum_decoded<std::uint16_t>(bytes, [](std::uint16_t h) { return triattn::half_bits_to_float(h); });
#endif
    }
    benchmark::DoNotOptimize(s);
  }
  label(state, t);
}

void score(benchmark::State& state, triattn::key_state keys) {
  const int t = static_cast<int>(state.range(0));
  const triattn::dense_kv_view view = data().view(t, keys);
  const triattn::triattention policy(data().stats);
  std::vector<float> scores(std::size_t{layers} * q_heads * tokens);  // [layers, q_heads, tokens]
  for (auto _ : state) {
    policy.score(view, round_start, scores);
    benchmark::DoNotOptimize(scores.data());
  }
  label(state, t);
  state.counters["ns_per_key"] = benchmark::Counter(static_cast<double>(state.iterations()) * kv_heads * tokens,
                                                    benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
void score_post(benchmark::State& state) { score(state, triattn::key_state::post_rope); }
void score_pre(benchmark::State& state) { score(state, triattn::key_state::pre_rope); }

void dtypes(benchmark::internal::Benchmark* b) {
  b->ArgName("dtype")->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(stream_read)->Apply(dtypes);
BENCHMARK(stream_copy)->Apply(dtypes);
BENCHMARK(plain_read)->Apply(dtypes);
BENCHMARK(score_post)->Apply(dtypes);
BENCHMARK(score_pre)->Apply(dtypes);

}  // namespace

BENCHMARK_MAIN();
