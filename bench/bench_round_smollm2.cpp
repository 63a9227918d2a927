// What a TriAttention round costs beside the decoding it serves, on SmolLM2-135M-Instruct's
// own cache (30 layers x 3 kv-heads x 3 q-heads per group x 64 dims, f32, NHD, post-RoPE) in
// the runner (runner/), one thread (issue 14).
//
// The runner decodes greedily from BOS; whenever the cache reaches budget + slack tokens, one
// round (`compress`, per-KV-head decisions, the paper's defaults; statistics drawn at random
// in the model's shape: the cost does not depend on their values) cuts it back to the budget.
// Printed: the median time of a round, of a decode step, and a round over the `slack` decode
// steps between two rounds.
//
// Usage: triattn_bench_round_smollm2 [model.gguf ("": the configured one)] [budget=512] [slack=64] [rounds=8]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "runner/ggml_bridge.hpp"
#include "runner/gguf_model.hpp"
#include "runner/runner.hpp"
#include "triattn/triattn.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

triattn::query_stats random_stats(const triattn_runner::config& c, const triattn::kv_geometry& g) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n;
  triattn::query_stats s;
  s.num_layers = c.n_layers;
  s.num_q_heads = c.n_heads;
  s.num_kv_heads = c.n_kv_heads;
  s.head_dim = c.head_dim;
  s.style = g.rope.style;
  for (int f = 0; f < c.head_dim / 2; ++f) s.inv_freq.push_back(triattn::inv_freq(g.rope, g.head_dim, f));
  for (int i = 0; i < c.n_layers * c.n_heads * c.head_dim / 2; ++i) {
    const float re = n(rng), im = n(rng);
    s.q_mean_real.push_back(re);
    s.q_mean_imag.push_back(im);
    s.q_abs_mean.push_back(std::hypot(re, im) * 1.5f);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 && argv[1][0] != '\0' ? argv[1] : TRIATTN_SMOLLM2_GGUF;
  const int budget = argc > 2 ? std::atoi(argv[2]) : 512;
  const int slack = argc > 3 ? std::atoi(argv[3]) : 64;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 8;
  if (budget < 1 || slack < 1 || rounds < 1) {
    std::fprintf(stderr, "usage: %s [model.gguf] [budget>=1] [slack>=1] [rounds>=1]\n", argv[0]);
    return 2;
  }
  ggml_bridge::init_backend();
  const triattn_runner::model model = gguf_model::load(path);
  const triattn_runner::config& c = model.config();
  triattn_runner::session s(model, budget + slack, triattn::dtype::f32);
  triattn::triattention policy(random_stats(c, s.view().geometry()));

  std::vector<double> steps, round_times;
  int token = 1;  // BOS
  while (static_cast<int>(round_times.size()) < rounds) {
    const auto t0 = clock_type::now();
    token = triattn_runner::argmax(s.forward(token));
    if (s.position() > budget + slack) steps.push_back(seconds_since(t0));  // after the first round: a full cache
    if (triattn::max_length(s.view()) == budget + slack) {
      triattn::round_context ctx;
      ctx.position = s.position();
      const auto t1 = clock_type::now();
      triattn::compress(policy, s.view(), budget, ctx);
      round_times.push_back(seconds_since(t1));
    }
  }
  const double step = median(steps), round = median(round_times);
  std::printf("SmolLM2-135M-Instruct in the runner (%d layers, %d kv heads, %d q heads, head_dim %d, f32 cache), 1 thread\n",
              c.n_layers, c.n_kv_heads, c.n_heads, c.head_dim);
  std::printf("budget %d, slack %d: %d rounds, %zu decode steps\n", budget, slack, rounds, steps.size());
  std::printf("  TriAttention round (score, select, compact): %.3f ms (median)\n", round * 1e3);
  std::printf("  decode step at %d-%d cached tokens: %.2f ms (median)\n", budget, budget + slack, step * 1e3);
  std::printf("  round / the %d decode steps it serves: %.2f%%\n", slack, 100.0 * round / (slack * step));
  return 0;
}
