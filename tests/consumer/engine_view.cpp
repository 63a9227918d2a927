// An engine's own cache type, built twice as a downstream program: against the installed
// package (find_package/, CONSUMER_ENGINE_VIEW) and as a vendored copy with only `-I<a copy of
// include/>`, `-I<Eigen's include dir>` and C++20 (vendored/). It includes every host header of
// include/triattn by name, defines its own KVCacheView (K and V rows interleaved in one allocation, no
// freed_pages hook, its own key_accessor) and compresses it with every policy at every
// granularity. Exits non-zero on a wrong round.
#include <triattn/calibration/accumulator.hpp>
#include <triattn/calibration/query_stats.hpp>
#include <triattn/calibration/stats_file.hpp>
#include <triattn/core/compaction.hpp>
#include <triattn/core/config.hpp>
#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/gqa.hpp>
#include <triattn/core/granularity.hpp>
#include <triattn/core/kv_cache_view.hpp>
#include <triattn/core/rope.hpp>
#include <triattn/core/round.hpp>
#include <triattn/core/schedule.hpp>
#include <triattn/core/selection.hpp>
#include <triattn/io/json.hpp>
#include <triattn/io/npy.hpp>
#include <triattn/io/safetensors.hpp>
#include <triattn/policies/accumulated_math.hpp>
#include <triattn/policies/attention_accumulator.hpp>
#include <triattn/policies/h2o.hpp>
#include <triattn/policies/policy.hpp>
#include <triattn/policies/query_window.hpp>
#include <triattn/policies/rkv.hpp>
#include <triattn/policies/snapkv.hpp>
#include <triattn/policies/streaming_llm.hpp>
#include <triattn/policies/triattention.hpp>
#include <triattn/policies/triattention_math.hpp>
#include <triattn/policies/vatp.hpp>
#include <triattn/policies/window_config.hpp>
#include <triattn/policies/window_math.hpp>
#include <triattn/triattn.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int layers = 2, kv_heads = 2, q_heads = 4, head_dim = 8, capacity = 16, budget = 6;

/// The engine's accessor: plain f32 rows.
struct engine_accessor {
  void load(const std::byte* row, int n, float* out) const { std::memcpy(out, row, sizeof(float) * n); }
  void store(std::byte* row, int n, const float* in) const { std::memcpy(row, in, sizeof(float) * n); }
};

/// The engine's cache: [layers, capacity, kv_heads, {K, V}, head_dim] f32 in one allocation.
struct engine_view {
  triattn::kv_geometry geo{};
  std::byte* data = nullptr;
  std::int32_t* lengths = nullptr;    // [layers, kv_heads]
  std::int32_t* positions = nullptr;  // [layers, kv_heads, capacity]

  const triattn::kv_geometry& geometry() const { return geo; }
  std::int64_t capacity() const { return ::capacity; }
  std::byte* at(int l, int h, std::int64_t s, int kv) const {
    return data + ((((l * ::capacity + s) * kv_heads + h) * 2 + kv) * head_dim) * sizeof(float);
  }
  std::byte* key(int l, int h, std::int64_t s) const { return at(l, h, s, 0); }
  std::byte* value(int l, int h, std::int64_t s) const { return at(l, h, s, 1); }
  engine_accessor key_accessor(int) const { return {}; }
  std::int32_t length(int l, int h) const { return lengths[l * kv_heads + h]; }
  void set_length(int l, int h, std::int32_t n) const { lengths[l * kv_heads + h] = n; }
  std::int32_t& position(int l, int h, std::int64_t s) const { return positions[(l * kv_heads + h) * ::capacity + s]; }
  void validate(const char* api) const {
    TRIATTN_CHECK(data != nullptr && lengths != nullptr && positions != nullptr, api, "engine_view: null");
    for (int i = 0; i < layers * kv_heads; ++i)
      TRIATTN_CHECK(lengths[i] >= 0 && lengths[i] <= ::capacity, api, "engine_view: length ", lengths[i]);
  }
};
static_assert(triattn::KVCacheView<engine_view>);

/// A full cache: key element d of (l, h, token t) = sin(1 + 7l + 3h + t + 0.1 d), value = its
/// negation; positions = token index.
struct engine_cache {
  std::vector<float> data = std::vector<float>(static_cast<std::size_t>(layers) * capacity * kv_heads * 2 * head_dim);
  std::vector<std::int32_t> lengths = std::vector<std::int32_t>(layers * kv_heads, capacity);
  std::vector<std::int32_t> positions = std::vector<std::int32_t>(layers * kv_heads * capacity);
  engine_cache() {
    const engine_view v = view();
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h)
        for (int t = 0; t < capacity; ++t) {
          v.position(l, h, t) = t;
          float* k = reinterpret_cast<float*>(v.key(l, h, t));
          float* val = reinterpret_cast<float*>(v.value(l, h, t));
          for (int d = 0; d < head_dim; ++d) val[d] = -(k[d] = std::sin(1.0f + 7.0f * l + 3.0f * h + t + 0.1f * d));
        }
  }
  engine_view view() {
    triattn::kv_geometry geo{layers, q_heads, kv_heads, head_dim, triattn::dtype::f32, triattn::key_state::post_rope, {}};
    return {geo, reinterpret_cast<std::byte*>(data.data()), lengths.data(), positions.data()};
  }
};

int errors = 0;

/// Every row holds `budget` slots, ascending positions, each K/V row the one of its position;
/// rows of a shared decision hold the same positions.
void check(const char* what, engine_cache& c, triattn::granularity grain) {
  const engine_view v = c.view();
  int bad = 0;
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h) {
      bad += v.length(l, h) != budget;
      for (int s = 0; s < v.length(l, h); ++s) {
        const std::int32_t p = v.position(l, h, s);
        bad += s > 0 && p <= v.position(l, h, s - 1);
        bad += *reinterpret_cast<const float*>(v.key(l, h, s)) != std::sin(1.0f + 7.0f * l + 3.0f * h + p);
        bad += *reinterpret_cast<const float*>(v.value(l, h, s)) != -std::sin(1.0f + 7.0f * l + 3.0f * h + p);
        const int l0 = 0, h0 = grain == triattn::granularity::whole_sequence ? 0 : h;
        if (grain != triattn::granularity::per_layer) bad += p != v.position(l0, h0, s);
      }
    }
  std::printf("vendored consumer: %s (%s): %s\n", what, std::string(triattn::granularity_name(grain)).c_str(),
              bad == 0 ? "ok" : "WRONG");
  errors += bad;
}

std::vector<float> query(int l, int qh, int t) {
  std::vector<float> q(head_dim);
  for (int d = 0; d < head_dim; ++d) q[d] = std::cos(0.3f * l + 0.7f * qh + 0.2f * t + d);
  return q;
}

template <class Policy>
void run(const char* what, Policy&& policy, triattn::granularity grain) {
  engine_cache c;
  const engine_view v = c.view();
  policy.config.round.grain = grain;
  if constexpr (requires { policy.observe(0, 0, 0, std::span<const float>{}, std::span<const float>{}); }) {
    policy.attach(v);
    for (int t = capacity - 4; t < capacity; ++t)  // the last tokens' queries and attention
      for (int l = 0; l < layers; ++l)
        for (int qh = 0; qh < q_heads; ++qh) {
          std::vector<float> probs(capacity);
          for (int s = 0; s < capacity; ++s) probs[s] = 1.0f / (1.0f + static_cast<float>((s * 7 + qh + l + t) % 5));
          policy.observe(l, qh, t, query(l, qh, t), probs);
        }
  }
  triattn::compress(policy, v, budget, {.position = capacity, .prompt_length = 2});
  check(what, c, grain);
}

triattn::query_stats stats() {
  triattn::query_stats st;
  st.num_layers = layers;
  st.num_q_heads = q_heads;
  st.num_kv_heads = kv_heads;
  st.head_dim = head_dim;
  for (int f = 0; f < head_dim / 2; ++f) st.inv_freq.push_back(triattn::inv_freq(triattn::rope_desc{}, head_dim, f));
  for (int i = 0; i < layers * q_heads * head_dim / 2; ++i) {
    st.q_mean_real.push_back(std::cos(0.37f * i));
    st.q_mean_imag.push_back(std::sin(0.37f * i));
    st.q_abs_mean.push_back(1.5f);
  }
  return st;
}

}  // namespace

int main() {
  for (const auto grain :
       {triattn::granularity::per_layer, triattn::granularity::per_kv_head, triattn::granularity::whole_sequence}) {
    run("streaming_llm", triattn::streaming_llm({.sinks = 2}), grain);
    run("h2o", triattn::h2o(), grain);
    run("vatp", triattn::vatp(), grain);
    triattn::snapkv_config sc;
    sc.window = 2;
    run("snapkv", triattn::snapkv(sc), grain);
    triattn::rkv_config rc;
    rc.window = 2;
    run("rkv", triattn::rkv(rc), grain);
    run("triattention", triattn::triattention(stats()), grain);
  }
  // StreamingLLM's keep set is known exactly: positions 0 1 12 13 14 15
  engine_cache c;
  triattn::streaming_llm sl({.sinks = 2});
  sl.compress(c.view(), budget);
  const int expected[] = {0, 1, 12, 13, 14, 15};
  for (int s = 0; s < budget; ++s) errors += c.view().position(1, 1, s) != expected[s];
  std::printf("engine view consumer: every policy through the engine's own view: %s\n", errors == 0 ? "yes" : "NO");
  return errors == 0 ? 0 : 1;
}
