// The H2O and VATP oracles of reference_accumulated.hpp: loops over the test cache, no Eigen.
#include "cuda/reference_accumulated.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <numeric>

#include "support/reference.hpp"

namespace triattn_cuda_test::cpu {

namespace {
std::size_t row_at(int l, int heads, int h, std::int64_t capacity) {
  return (static_cast<std::size_t>(l) * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)) *
         static_cast<std::size_t>(capacity);
}
}  // namespace

accumulated_sums::accumulated_sums(const triattn_test::test_cache& cache) {
  const triattn_test::cache_shape& s = cache.shape();
  const auto cells = static_cast<std::size_t>(s.num_layers) * static_cast<std::size_t>(s.capacity);
  sums.assign(cells * static_cast<std::size_t>(s.num_kv_heads * s.group), 0.0f);
  counts.assign(cells * static_cast<std::size_t>(s.num_kv_heads), 0);
}

void accumulate(triattn_test::test_cache& cache, const float* probs, float weight, accumulated_sums& state) {
  if (weight == 0.0f) return;
  const triattn_test::cache_shape& s = cache.shape();
  const int Hq = s.num_kv_heads * s.group;
  for (int l = 0; l < s.num_layers; ++l)
    for (int qh = 0; qh < Hq; ++qh) {
      const int h = qh / s.group;
      const std::size_t row = row_at(l, Hq, qh, s.capacity), count_row = row_at(l, s.num_kv_heads, h, s.capacity);
      for (std::int32_t j = 0; j < cache.length(l, h); ++j) {
        // one fused multiply-add, as the device's `accumulate_probability` (fmaf); libm's fma
        // is exact on a host built without an FMA instruction
        float& sum = state.sums[row + static_cast<std::size_t>(j)];
        sum = std::fma(weight, probs[row + static_cast<std::size_t>(j)], sum);
        if (qh % s.group == 0) ++state.counts[count_row + static_cast<std::size_t>(j)];
      }
    }
}

void clear_past_length(triattn_test::test_cache& cache, accumulated_sums& state) {
  const triattn_test::cache_shape& s = cache.shape();
  const int Hq = s.num_kv_heads * s.group;
  for (int l = 0; l < s.num_layers; ++l)
    for (int qh = 0; qh < Hq; ++qh) {
      const int h = qh / s.group;
      const std::size_t row = row_at(l, Hq, qh, s.capacity), count_row = row_at(l, s.num_kv_heads, h, s.capacity);
      for (std::int64_t j = cache.length(l, h); j < s.capacity; ++j) {
        state.sums[row + static_cast<std::size_t>(j)] = 0.0f;
        state.counts[count_row + static_cast<std::size_t>(j)] = 0;
      }
    }
}

std::vector<double> accumulated_scores(triattn_test::test_cache& cache, const accumulated_sums& state,
                                       triattn::gqa_aggregation agg, bool normalize, bool value_weighted) {
  const triattn_test::cache_shape& s = cache.shape();
  const int G = s.group, Hq = s.num_kv_heads * G;
  std::vector<double> out(state.counts.size(), 0.0);
  for (int l = 0; l < s.num_layers; ++l)
    for (int h = 0; h < s.num_kv_heads; ++h) {
      const std::size_t row = row_at(l, s.num_kv_heads, h, s.capacity);
      for (std::int32_t j = 0; j < cache.length(l, h); ++j) {
        double x = agg == triattn::gqa_aggregation::max ? -INFINITY : 0.0;
        for (int qh = h * G; qh < (h + 1) * G; ++qh) {
          const double v = state.sums[row_at(l, Hq, qh, s.capacity) + static_cast<std::size_t>(j)];
          x = agg == triattn::gqa_aggregation::max ? std::max(x, v) : x + v;
        }
        if (agg == triattn::gqa_aggregation::mean) x /= G;
        const std::int32_t rows = state.counts[row + static_cast<std::size_t>(j)];
        if (normalize) x = rows > 0 ? x / rows : 0.0;
        if (value_weighted) {
          double norm = 0.0;
          for (int d = 0; d < s.head_dim; ++d)
            norm += std::fabs(triattn_test::ref::load(cache.value_row(l, h, j), s.type, static_cast<std::size_t>(d)));
          x *= norm;
        }
        out[row + static_cast<std::size_t>(j)] = x;
      }
    }
  return out;
}

oracle_keep accumulated_keep(const double* scores, std::int32_t n, const triattn::h2o_split& split,
                             double relative_tolerance) {
  oracle_keep out;
  const std::int64_t total = split.total();
  if (n <= total) {
    out.keep.resize(static_cast<std::size_t>(n));
    std::iota(out.keep.begin(), out.keep.end(), 0);
    return out;
  }
  std::vector<std::int32_t> candidates;
  for (std::int32_t j = 0; j < n; ++j) {
    if (j < split.sinks || j >= n - split.recent)
      out.keep.push_back(j);
    else
      candidates.push_back(j);
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](std::int32_t a, std::int32_t b) { return scores[a] > scores[b]; });  // ties: lower slot first
  const auto take = static_cast<std::size_t>(total) - out.keep.size();
  if (take > 0 && take < candidates.size()) {
    const double last = scores[candidates[take - 1]], next = scores[candidates[take]];
    // Equal scores are equal in float too (no rows, or exact ties), and go to the lower slot there as well.
    out.near_tie = last != next && last - next <= relative_tolerance * std::max(std::fabs(last), std::fabs(next));
  }
  out.keep.insert(out.keep.end(), candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(take));
  std::sort(out.keep.begin(), out.keep.end());
  return out;
}

}  // namespace triattn_cuda_test::cpu
