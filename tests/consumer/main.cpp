// A downstream program: an engine-owned cache of 2 layers x 2 kv-heads x 10 tokens,
// compressed to 6 tokens with StreamingLLM (2 sinks). Exits non-zero if the kept positions
// or the moved keys are wrong.
#include <triattn/triattn.hpp>

#include <cstdio>
#include <vector>

int main() {
  constexpr int layers = 2, kv_heads = 2, head_dim = 4, capacity = 10;
  // [layers][capacity, kv_heads, head_dim] (NHD), keys hold 1000*layer + 100*head + token
  std::vector<float> k(layers * capacity * kv_heads * head_dim), v(k.size());
  for (int l = 0; l < layers; ++l)
    for (int t = 0; t < capacity; ++t)
      for (int h = 0; h < kv_heads; ++h)
        for (int d = 0; d < head_dim; ++d) {
          const int i = ((l * capacity + t) * kv_heads + h) * head_dim + d;
          k[i] = static_cast<float>(1000 * l + 100 * h + t);
          v[i] = -k[i];
        }
  std::byte* k_layers[layers];
  std::byte* v_layers[layers];
  for (int l = 0; l < layers; ++l) {
    k_layers[l] = reinterpret_cast<std::byte*>(k.data() + l * capacity * kv_heads * head_dim);
    v_layers[l] = reinterpret_cast<std::byte*>(v.data() + l * capacity * kv_heads * head_dim);
  }
  std::vector<std::int32_t> lengths(layers * kv_heads, capacity), positions(layers * kv_heads * capacity);
  for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % capacity);

  triattn::dense_kv_view view;
  view.geo = {layers, 4, kv_heads, head_dim, triattn::dtype::f32, triattn::key_state::post_rope, {}};
  view.k_layers = k_layers;
  view.v_layers = v_layers;
  view.k_stride = view.v_stride = triattn::kv_strides::nhd(kv_heads, head_dim);
  view.slots = {lengths.data(), positions.data(), capacity};

  triattn::streaming_llm policy({.sinks = 2});
  policy.compress(view, 6);

  const int expected[] = {0, 1, 6, 7, 8, 9};
  int errors = 0;
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h) {
      errors += view.length(l, h) != 6;
      for (int s = 0; s < 6; ++s) {
        errors += view.position(l, h, s) != expected[s];
        errors += *reinterpret_cast<const float*>(view.key(l, h, s)) != static_cast<float>(1000 * l + 100 * h + expected[s]);
      }
    }
  std::printf("consumer: StreamingLLM kept positions 0 1 6 7 8 9 in every head: %s\n", errors == 0 ? "yes" : "NO");
  return errors == 0 ? 0 : 1;
}
