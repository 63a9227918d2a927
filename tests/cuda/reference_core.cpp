// CPU references of the selection, compaction, TriAttention and StreamingLLM kernels: the
// library's own CPU path (host C++ only).
#include "cuda/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "support/triattention_reference.hpp"
#include "triattn/policies/streaming_llm.hpp"

namespace triattn_cuda_test::cpu {

namespace {
keep_rows rows_of(const triattn::keep_plan& p) {
  keep_rows out;
  for (int l = 0; l < p.num_layers; ++l)
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const auto r = p.row(l, h);
      out.emplace_back(r.begin(), r.end());
    }
  return out;
}
}  // namespace

std::vector<std::int32_t> select_keep(const std::vector<float>& scores, const std::vector<std::int32_t>& positions,
                                      const triattn::protection& prot, std::int64_t budget) {
  return triattn::select_keep(scores, positions, prot, budget);
}

void compact(triattn_test::test_cache& cache, const keep_rows& keep, std::span<const triattn::slot_state> states) {
  const triattn::kv_geometry g = cache.geometry();
  triattn::keep_plan plan(g.num_layers, g.num_kv_heads);
  for (const auto& row : keep) plan.push_row(row);
  cache.with_view([&](auto view) { triattn::compact(view, plan, states); });
}

std::vector<float> triattention_scores(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                                       const triattn::triattention_config& config, std::int64_t round_start) {
  const triattn::kv_geometry g = cache.geometry();
  std::vector<float> out(static_cast<std::size_t>(g.num_layers) * g.num_q_heads * cache.shape().capacity, 0.0f);
  const triattn::triattention policy(stats, config);
  cache.with_view([&](auto view) { policy.score(view, round_start, out); });
  return out;
}

keep_rows triattention_plan(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                            const triattn::triattention_config& config, std::int64_t round_start, std::int64_t budget) {
  triattn::triattention policy(stats, config);
  policy.set_position(round_start);
  return cache.with_view([&](auto view) { return rows_of(policy.plan(view, budget)); });
}

double triattention_margin(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                           const triattn::triattention_config& config, std::int64_t round_start, std::int64_t budget) {
  namespace ref = triattn_test::ref;
  ref::tri_score_options so = ref::tri_options_for(cache);
  so.offset_max = config.offset_max;
  so.use_max = config.aggregation == triattn::offset_aggregation::max;
  so.disable_norm = config.disable_norm;
  ref::tri_select_options o;
  o.group_max = config.gqa_reduction == triattn::triattention_gqa_reduction::max;
  o.normalize = config.normalize;
  o.window = config.window;
  o.prompt_length = config.protect_prompt ? config.prompt_length : 0;
  const auto raw = ref::tri_cache_scores(cache, stats, round_start, so);
  double scale = 0.0, margin = std::numeric_limits<double>::infinity();
  for (const auto& layer : raw)
    for (const auto& row : layer)
      for (const double x : row) scale = std::max(scale, std::abs(x));
  const int L = cache.shape().num_layers, H = cache.shape().num_kv_heads, G = cache.shape().group;
  const auto positions = [&](int l, int h) {
    std::vector<std::int32_t> p;
    for (std::int32_t s = 0; s < cache.length(l, h); ++s) p.push_back(cache.position(l, h, s));
    return p;
  };
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const ref::tri_keep k = config.granularity == triattn::triattention_granularity::per_layer_kv_head
                                  ? ref::tri_select_per_layer(raw, l, h, G, positions(l, h), budget, o)
                                  : ref::tri_select_per_kv_head(raw, h, G, positions(0, h), budget, o);
      margin = std::min(margin, k.margin);
    }
  return config.normalize ? margin : margin / std::max(scale, 1e-30);
}

keep_rows streaming_plan(triattn_test::test_cache& cache, std::int64_t sinks, std::int64_t budget) {
  const triattn::streaming_llm policy(triattn::streaming_llm_config{sinks, false});
  return cache.with_view([&](auto view) { return rows_of(policy.plan(view, budget)); });
}

}  // namespace triattn_cuda_test::cpu
