// CPU references over the engine's own view (host C++ only).
#include "cuda/reference_engine_view.hpp"

#include <cstddef>
#include <vector>

#include "triattn/core/kv_cache_view.hpp"
#include "triattn/policies/triattention.hpp"

namespace triattn_cuda_test::cpu {

bool reads_as_mirror(engine_cache& engine, triattn_test::test_cache& mirror) {
  const engine_view v = engine.host_view();
  const triattn::kv_geometry& g = v.geometry();
  std::vector<float> row(static_cast<std::size_t>(g.head_dim));
  bool same = true;
  for (int l = 0; l < g.num_layers; ++l)
    for (int h = 0; h < g.num_kv_heads; ++h)
      for (std::int64_t s = 0; s < v.capacity(); ++s) {
        triattn::load_key(v, l, h, s, row.data());
        const std::vector<double> k = mirror.key(l, h, s);
        for (std::size_t d = 0; d < row.size(); ++d) same = same && static_cast<double>(row[d]) == k[d];
        triattn::load_value(v, l, h, s, row.data());
        const std::vector<double> x = mirror.value(l, h, s);
        for (std::size_t d = 0; d < row.size(); ++d) same = same && static_cast<double>(row[d]) == x[d];
      }
  return same;
}

keep_rows triattention_plan(engine_cache& engine, const triattn::query_stats& stats,
                            const triattn::triattention_config& config, std::int64_t round_start,
                            std::int64_t prompt_length, std::int64_t budget) {
  const triattn::triattention policy(stats, config);
  return rows_of(policy.plan(engine.host_view(), budget, triattn::round_context{round_start, prompt_length}));
}

}  // namespace triattn_cuda_test::cpu
