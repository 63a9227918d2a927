// The smallest complete use of triattn: an engine-owned cache, a decode loop, and a policy
// that keeps it within a budget. README's usage example is the region between the markers;
// a test checks that README shows exactly this code and runs the program.
#include <cstdio>
#include <random>
#include <vector>

// example-begin minimal
#include <triattn/triattn.hpp>

int main() {
  // The engine's cache, one sequence: per layer K and V in HND [kv_heads, capacity, head_dim],
  // f16, keys stored after RoPE (llama.cpp / vLLM / HF do this).
  constexpr int layers = 4, q_heads = 8, kv_heads = 2, head_dim = 64, capacity = 160;
  constexpr std::int64_t budget = 128;
  constexpr std::size_t layer_elems = std::size_t{kv_heads} * capacity * head_dim;
  std::vector<triattn::half_t> k(layers * layer_elems), v(layers * layer_elems);
  std::vector<std::byte*> k_layers, v_layers;  // per-layer base pointers
  for (std::size_t l = 0; l < layers; ++l) {
    k_layers.push_back(reinterpret_cast<std::byte*>(&k[l * layer_elems]));
    v_layers.push_back(reinterpret_cast<std::byte*>(&v[l * layer_elems]));
  }
  std::vector<std::int32_t> lengths(layers * kv_heads, 0);            // [layers, kv_heads]
  std::vector<std::int32_t> positions(lengths.size() * capacity, 0);  // [layers, kv_heads, capacity]

  // A non-owning view of it: geometry, layout (strides), token bookkeeping.
  triattn::dense_kv_view view;
  view.geo = {.num_layers = layers, .num_q_heads = q_heads, .num_kv_heads = kv_heads, .head_dim = head_dim,
              .type = triattn::dtype::f16, .keys = triattn::key_state::post_rope,
              .rope = {.style = triattn::rope_style::half, .theta = 10000.0}};
  view.k_layers = k_layers.data();
  view.v_layers = v_layers.data();
  view.k_stride = view.v_stride = triattn::kv_strides::hnd(capacity, head_dim);
  view.slots = {lengths.data(), positions.data(), capacity};

  // 4 attention sinks + the most recent tokens; a round cuts the cache to `budget` when it
  // reaches budget + 32 (the schedule is the policy's: config.round.sched).
  triattn::streaming_llm policy({.sinks = 4, .round = {.sched = triattn::schedule::with_slack(32)}});
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  int rounds = 0;
  for (std::int32_t pos = 0; pos < 1000; ++pos) {
    // ... the engine's attention for token `pos` runs here, then it appends K and V:
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        const std::int32_t slot = view.length(l, h);
        float key[head_dim], value[head_dim];
        for (int d = 0; d < head_dim; ++d) key[d] = normal(rng), value[d] = normal(rng);
        triattn::store_key(view, l, h, slot, key);
        triattn::store_value(view, l, h, slot, value);
        view.position(l, h, slot) = pos;
        view.set_length(l, h, slot + 1);
      }
    rounds += triattn::maybe_compress(policy, view, budget, {.position = pos + 1});  // the next token's position
  }
  std::printf("1000 tokens decoded, %d compression rounds, %d tokens cached per head (capacity %d)\n", rounds,
              view.length(0, 0), capacity);
  return view.length(0, 0) <= capacity && rounds > 0 ? 0 : 1;
}
// example-end minimal
