// CPU references of the selection, compaction, round pipeline, TriAttention and StreamingLLM
// kernels: the library's own CPU path (host C++ only).
#include "cuda/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "support/triattention_reference.hpp"
#include "triattn/policies/streaming_llm.hpp"
#include "triattn/policies/triattention.hpp"

namespace triattn_cuda_test::cpu {

keep_rows rows_of(const triattn::keep_plan& p) {
  keep_rows out;
  for (int l = 0; l < p.num_layers; ++l)
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const auto r = p.row(l, h);
      out.emplace_back(r.begin(), r.end());
    }
  return out;
}

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
                            const triattn::triattention_config& config, std::int64_t round_start,
                            std::int64_t prompt_length, std::int64_t budget) {
  const triattn::triattention policy(stats, config);
  const triattn::round_context ctx{round_start, prompt_length};
  return cache.with_view([&](auto view) { return rows_of(policy.plan(view, budget, ctx)); });
}

double triattention_margin(triattn_test::test_cache& cache, const triattn::query_stats& stats,
                           const triattn::triattention_config& config, std::int64_t round_start,
                           std::int64_t prompt_length, std::int64_t budget) {
  namespace ref = triattn_test::ref;
  ref::tri_score_options so = ref::tri_options_for(cache);
  so.offset_max = config.offset_max;
  so.use_max = config.aggregation == triattn::offset_aggregation::max;
  so.disable_norm = config.disable_norm;
  ref::tri_select_options o;
  o.group_max = config.gqa_reduction == triattn::triattention_gqa_reduction::max;
  o.normalize = config.normalize;
  o.window = config.window;
  o.prompt_length = config.round.protect_prompt ? prompt_length : 0;
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
      const ref::tri_keep k = config.round.grain == triattn::granularity::per_layer
                                  ? ref::tri_select_per_layer(raw, l, h, G, positions(l, h), budget, o)
                                  : ref::tri_select_per_kv_head(raw, h, G, positions(0, h), budget, o);
      margin = std::min(margin, k.margin);
    }
  return config.normalize ? margin : margin / std::max(scale, 1e-30);
}

keep_rows round_plan(triattn_test::test_cache& cache, const float* scores, const triattn::round_options& options,
                     const triattn::row_rule& rule, std::int64_t prompt_length, triattn::score_domain domain,
                     const triattn::value_projection* projection) {
  const triattn::kv_geometry g = cache.geometry();
  const std::int64_t cap = cache.shape().capacity;
  const triattn::decision_map map{options.grain, g.num_layers, g.num_kv_heads};
  const bool beyond = options.budget == triattn::budget_mode::beyond_prompt;
  triattn::protection prot = rule.prot;
  prot.first = std::max(prot.first, options.sinks);
  prot.last = std::max(prot.last, options.recent);
  prot.prompt_length = options.protect_prompt || beyond ? prompt_length : 0;
  // The CPU pipeline's decisions (core/round.hpp) on the GPU's recorded scores.
  std::vector<triattn::detail::round_decision> decisions(static_cast<std::size_t>(map.decisions()));
  std::vector<float> value;
  for (int d = 0; d < map.decisions(); ++d) {
    int l0, h0;
    map.row(d, 0, l0, h0);
    const std::int32_t n = cache.length(l0, h0);
    auto& dec = decisions[static_cast<std::size_t>(d)];
    std::int64_t prompt_slots = 0;
    for (std::int32_t s = 0; s < n; ++s) {
      dec.positions.push_back(cache.position(l0, h0, s));
      prompt_slots += dec.positions.back() < prompt_length ? 1 : 0;
      const bool p = triattn::is_protected(prot, s, n, dec.positions.back());
      dec.candidate.push_back(p ? 0 : 1);
      dec.protected_slots += p ? 1 : 0;
    }
    dec.score.assign(static_cast<std::size_t>(n), triattn::row_fold_start(options.reduction));
    for (int r = 0; r < map.rows(); ++r) {
      int l, h;
      map.row(d, r, l, h);
      std::vector<float> row(scores + (static_cast<std::int64_t>(l) * g.num_kv_heads + h) * cap,
                             scores + (static_cast<std::int64_t>(l) * g.num_kv_heads + h) * cap + n);
      if (options.value_aware)
        triattn::detail::weight_by_values("round_plan", cache.dense_view(), l, h, projection, domain, dec.candidate, row,
                                          value);
      for (std::int32_t s = 0; s < n; ++s) {
        float& a = dec.score[static_cast<std::size_t>(s)];
        a = triattn::fold_row_score(a, row[s], options.reduction);
      }
    }
    dec.kept = rule.kept + (beyond ? prompt_slots : 0);
  }
  if (options.split != triattn::budget_split::equal) {
    const int per_pool = triattn::pool_decisions(options.split, map);
    for (int first = 0; first < map.decisions(); first += per_pool) {
      std::vector<triattn::detail::round_decision*> pool;
      for (int d = first; d < first + per_pool; ++d) pool.push_back(&decisions[static_cast<std::size_t>(d)]);
      triattn::detail::split_kept(pool, options.split_floor);
    }
  }
  std::vector<std::vector<std::int32_t>> decided;
  for (const auto& dec : decisions)
    decided.push_back(dec.kept <= 0 ? std::vector<std::int32_t>{}
                                    : triattn::select_keep(dec.score, dec.positions, prot, dec.kept, options.segments));
  keep_rows out;
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h) out.push_back(decided[static_cast<std::size_t>(map.decision_of(l, h))]);
  return out;
}

keep_rows streaming_plan(triattn_test::test_cache& cache, std::int64_t sinks, std::int64_t budget) {
  const triattn::streaming_llm policy(triattn::streaming_llm_config{sinks, false});
  return cache.with_view([&](auto view) { return rows_of(policy.plan(view, budget)); });
}

}  // namespace triattn_cuda_test::cpu
