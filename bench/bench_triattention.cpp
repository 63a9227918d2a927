// TriAttention scoring on the CPU, three ways over the same keys, in one run:
//   plain_read  – every key element read once and summed: the memory-bound floor;
//   folded      – the library's one-pass folded scorer (one complex dot product per key and
//                 q-head, |K_f| shared by the GQA group);
//   per_offset  – the reference's own formulation: per offset, the F cosines and sines of
//                 (r + o)·w are computed once and shared by all keys, and each key costs 2F
//                 multiply-adds per offset (17 offsets), then the mean.
// Shape (issue 3): 32K tokens x 8 kv-heads x 4 q-heads per group x 128 dims, one layer, f32.
// `bench/summarize.py` prints the two ratios README quotes.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "triattn/triattn.hpp"

namespace {

constexpr int layers = 1, kv_heads = 8, group = 4, q_heads = kv_heads * group, head_dim = 128, bands = head_dim / 2;
constexpr std::int64_t tokens = 32768, round_start = 40000;

struct fixture {
  std::vector<float> keys;  // [kv_heads, tokens, head_dim] (HND, one layer)
  std::vector<std::byte*> bases;
  std::vector<std::int32_t> lengths, positions;
  std::vector<double> inv_freq;
  triattn::query_stats stats;
  triattn::dense_kv_view view;

  fixture() {
    std::mt19937_64 g(1234);
    std::normal_distribution<float> n;
    keys.resize(std::size_t{kv_heads} * tokens * head_dim);
    for (float& x : keys) x = n(g);
    bases = {reinterpret_cast<std::byte*>(keys.data())};
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
    view.geo = {layers, q_heads, kv_heads, head_dim, triattn::dtype::f32, triattn::key_state::post_rope, {}};
    view.geo.rope.inv_freq_table = stats.inv_freq.data();
    view.k_layers = view.v_layers = bases.data();
    view.k_stride = view.v_stride = triattn::kv_strides::hnd(tokens, head_dim);
    view.slots = {lengths.data(), positions.data(), tokens};
  }
};

const fixture& data() {
  static const fixture f;
  return f;
}

void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kv_heads * tokens * head_dim *
                          static_cast<std::int64_t>(sizeof(float)));
}

void plain_read(benchmark::State& state) {
  const fixture& f = data();
  for (auto _ : state) {
    // 16 independent sums, so that the loop vectorises and runs at memory speed rather than
    // at the latency of one chain of dependent additions.
    float sum[16] = {};
    for (std::size_t i = 0; i < f.keys.size(); i += 16)
      for (std::size_t j = 0; j < 16; ++j) sum[j] += f.keys[i + j];
    benchmark::DoNotOptimize(sum);
  }
  set_bytes(state);
}

void folded(benchmark::State& state) {
  const fixture& f = data();
  const triattn::triattention policy(f.stats);
  std::vector<float> scores(std::size_t{layers} * q_heads * tokens);  // [layers, q_heads, tokens]
  for (auto _ : state) {
    policy.score(f.view, round_start, scores);
    benchmark::DoNotOptimize(scores.data());
  }
  set_bytes(state);
}

void per_offset(benchmark::State& state) {
  const fixture& f = data();
  const int num_offsets = triattn::triattention_num_offsets(65536);
  // Per offset and q-head: c_f = a q̄_f e^{i (r + o) w_f}, from F cos/sin shared by all keys.
  std::vector<float> c_re(std::size_t{q_heads} * num_offsets * bands), c_im(c_re.size()), e(std::size_t{q_heads} * bands);
  std::vector<float> scores(std::size_t{q_heads} * tokens);
  std::vector<float> k_re(bands), k_im(bands), k_abs(bands);
  for (auto _ : state) {
    for (int h = 0; h < q_heads; ++h) {
      const std::size_t row = f.stats.row(0, h);
      for (int j = 0; j < num_offsets; ++j) {
        const std::int64_t offset = triattn::triattention_offset(j);
        double w_re[bands], w_im[bands];
        triattn::triattention_phasors(f.stats.inv_freq.data(), bands, round_start, &offset, 1, w_re, w_im);
        triattn::triattention_trig_coefficients(&f.stats.q_mean_real[row], &f.stats.q_mean_imag[row], w_re, w_im,
                                                bands, 1.0, &c_re[(std::size_t(h) * num_offsets + j) * bands],
                                                &c_im[(std::size_t(h) * num_offsets + j) * bands]);
      }
      triattn::triattention_norm_coefficients(&f.stats.q_mean_real[row], &f.stats.q_mean_imag[row],
                                              &f.stats.q_abs_mean[row], bands, 1.0, &e[std::size_t(h) * bands]);
    }
    for (int g = 0; g < kv_heads; ++g) {
      for (std::int64_t t = 0; t < tokens; ++t) {
        triattn::triattention_key_bands(&f.keys[(std::size_t(g) * tokens + t) * head_dim], head_dim,
                                        triattn::rope_style::half, k_re.data(), k_im.data(), k_abs.data());
        for (int h = g * group; h < (g + 1) * group; ++h) {
          float trig = 0.0f;
          for (int j = 0; j < num_offsets; ++j) {  // 2F multiply-adds per offset
            const float* cr = &c_re[(std::size_t(h) * num_offsets + j) * bands];
            const float* ci = &c_im[(std::size_t(h) * num_offsets + j) * bands];
            for (int b = 0; b < bands; ++b) trig += cr[b] * k_re[b] + ci[b] * k_im[b];
          }
          float norm = 0.0f;
          for (int b = 0; b < bands; ++b) norm += e[std::size_t(h) * bands + b] * k_abs[b];
          scores[std::size_t(h) * tokens + t] = trig / static_cast<float>(num_offsets) + norm;
        }
      }
    }
    benchmark::DoNotOptimize(scores.data());
  }
  set_bytes(state);
}

BENCHMARK(plain_read)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(folded)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(per_offset)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
