// CPU references of the attention-free policies (host C++ only): the library's own K-norm,
// KeyDiff and Expected Attention, which the round matrix holds to the double-precision oracles.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "cuda/reference.hpp"
#include "triattn/policies/expected_attention.hpp"
#include "triattn/policies/keydiff.hpp"
#include "triattn/policies/knorm.hpp"

namespace triattn_cuda_test::cpu {

namespace {
/// Calls `f(policy)` with the key-only policy called `name`.
template <class F>
auto with_key_only(const char* name, F&& f) {
  if (std::string_view(name) == "knorm") return f(triattn::knorm{});
  return f(triattn::keydiff{});
}
}  // namespace

std::vector<float> key_only_scores(triattn_test::test_cache& cache, const char* name) {
  const auto& s = cache.shape();
  std::vector<float> out(static_cast<std::size_t>(s.num_layers) * s.num_kv_heads * s.capacity, 0.0f);
  with_key_only(name, [&](const auto& policy) { cache.with_view([&](const auto& view) { policy.score(view, out); }); });
  return out;
}

keep_rows key_only_plan(triattn_test::test_cache& cache, const char* name, std::int64_t budget) {
  return with_key_only(name, [&](const auto& policy) {
    return cache.with_view([&](const auto& view) { return rows_of(policy.plan(view, budget)); });
  });
}

std::vector<float> expected_attention_scores(triattn_test::test_cache& cache, const triattn::expected_attention_config& config,
                                             std::span<const float> queries, std::span<const std::int32_t> positions,
                                             std::int64_t round_start) {
  const auto& s = cache.shape();
  const int q_heads = s.num_kv_heads * s.group, rows = static_cast<int>(positions.size());
  std::vector<float> out(static_cast<std::size_t>(s.num_layers) * s.num_kv_heads * s.capacity, 0.0f);
  cache.with_view([&](const auto& view) {
    triattn::expected_attention policy(config);
    policy.attach(view);
    for (int i = 0; i < rows; ++i)
      for (int l = 0; l < s.num_layers; ++l)
        for (int h = 0; h < q_heads; ++h)
          policy.observe(l, h, positions[static_cast<std::size_t>(i)],
                         queries.subspan(((static_cast<std::size_t>(l) * q_heads + h) * rows + i) * s.head_dim,
                                         static_cast<std::size_t>(s.head_dim)));
    policy.score(view, round_start, out);
  });
  return out;
}

}  // namespace triattn_cuda_test::cpu
