// CPU references of the key-only policies (host C++ only): the library's own K-norm and
// KeyDiff, which the round matrix holds to the double-precision oracles.
#include <cstddef>
#include <string_view>
#include <vector>

#include "cuda/reference.hpp"
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

}  // namespace triattn_cuda_test::cpu
