// CPU references of the selection, compaction, TriAttention and StreamingLLM kernels: the
// library's own CPU path (host C++ only).
#include "cuda/reference.hpp"

#include <span>

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

keep_rows streaming_plan(triattn_test::test_cache& cache, std::int64_t sinks, std::int64_t budget) {
  const triattn::streaming_llm policy(triattn::streaming_llm_config{sinks, false});
  return cache.with_view([&](auto view) { return rows_of(policy.plan(view, budget)); });
}

}  // namespace triattn_cuda_test::cpu
