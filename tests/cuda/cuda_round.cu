// The GPU round pipeline (`plan_round`, round.cuh) for every policy under every granularity,
// row reduction, budget mode and prompt protection, with per-sequence budgets, on caches of
// every element type (fp8 with a per-tensor scale included). Each policy's device scorer runs
// inside a recorder that keeps the row scores it wrote; the CPU reference (reference_core.cpp's
// `round_plan`: `fold_row_score` in row order, then `triattn::select_keep`) decides from exactly
// those floats, so the keep sets must be identical and the caches after `compact` byte-equal
// to the CPU's compaction. (Each scorer's scores against the CPU are the other cuda_* tests'.)
// Also under segment quotas and head-adaptive budget splits (the CPU's `split_kept` on the same
// floats sets each decision's count; rows then keep different lengths), and value-aware rounds
// (the CPU's `weight_by_values` on the same floats, by a random output projection or the plain
// norms). Plus: rows of a shared decision that hold different slots fail the round on the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_cache.hpp"
#include "cuda/driver.hpp"
#include "cuda/gpu_plan.cuh"
#include "cuda/reference.hpp"
#include "support/random.hpp"
#include "support/triattention_reference.hpp"
#include "support/views.hpp"
#include "triattn/cuda/accumulated.cuh"
#include "triattn/cuda/compact.cuh"
#include "triattn/cuda/expected_attention.cuh"
#include "triattn/cuda/keydiff.cuh"
#include "triattn/cuda/knorm.cuh"
#include "triattn/cuda/rkv.cuh"
#include "triattn/cuda/round.cuh"
#include "triattn/cuda/snapkv.cuh"
#include "triattn/cuda/streaming_llm.cuh"
#include "triattn/cuda/triattention.cuh"

namespace {

using namespace triattn_cuda_test;
using triattn_test::cache_layout;

enum class policy_kind { streaming_llm, triattention, h2o, vatp, snapkv, rkv, knorm, keydiff, expected_attention };
constexpr policy_kind all_policies[] = {policy_kind::streaming_llm, policy_kind::triattention, policy_kind::h2o,
                                        policy_kind::vatp,          policy_kind::snapkv,       policy_kind::rkv,
                                        policy_kind::knorm,         policy_kind::keydiff,      policy_kind::expected_attention};
const char* policy_name(policy_kind p) {
  constexpr const char* names[] = {"streaming_llm", "triattention", "h2o",     "vatp",
                                   "snapkv",        "rkv",          "knorm", "keydiff", "expected_attention"};
  return names[static_cast<int>(p)];
}

constexpr triattn::dtype gpu_dtypes[] = {triattn::dtype::f32, triattn::dtype::f16, triattn::dtype::bf16,
                                         triattn::dtype::fp8_e4m3, triattn::dtype::fp8_e5m2};

/// One batch of caches whose rows all hold row (0, 0)'s slots (what shared decisions need),
/// each sequence with its budget, prompt and round start, mirrored on the device.
struct round_case {
  std::vector<triattn_test::test_cache> caches;
  std::vector<std::int32_t> budgets;
  std::vector<std::int64_t> prompts, round_starts;
  std::int32_t stride = 1;
  std::vector<float> gram;  ///< a value-aware round's output projection (`value_projection::gram`), or empty
  triattn::value_projection projection{};  ///< over `gram`, on the host

  round_case(const triattn_test::cache_shape& shape, int batch, std::mt19937_64& g, bool projected = false) {
    caches.reserve(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) {
      caches.emplace_back(shape, g);
      auto& c = caches.back();
      for (int l = 0; l < shape.num_layers; ++l)
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          c.length(l, h) = c.length(0, 0);
          for (std::int64_t s = 0; s < shape.capacity; ++s) c.position(l, h, s) = c.position(0, 0, s);
        }
      std::int32_t last = 0;
      for (const std::int32_t p : c.positions) last = std::max(last, p);
      budgets.push_back(static_cast<std::int32_t>(1 + g() % static_cast<std::uint64_t>(shape.capacity + 2)));
      prompts.push_back(static_cast<std::int64_t>(g() % 40));
      round_starts.push_back(last + 1);
      stride = std::max(stride, budgets.back() + static_cast<std::int32_t>(shape.capacity));  // room for beyond_prompt
    }
    if (!projected) return;
    const triattn::kv_geometry geo = caches.front().geometry();
    const int hidden = 1 + static_cast<int>(g() % static_cast<std::uint64_t>(2 * geo.head_dim));
    for (int l = 0; l < geo.num_layers; ++l)
      triattn::append_output_gram(
          triattn_test::normal_floats(g, static_cast<std::size_t>(hidden) * geo.num_q_heads * geo.head_dim), hidden,
          geo.num_q_heads, geo.head_dim, gram);
    projection = {geo.num_layers, geo.num_q_heads, geo.head_dim, gram.data()};
  }
};

/// The GPU's plan and row scores for one round of `scorer`, then compact.
struct recorded_round {
  std::vector<std::int32_t> keep, kept;
  std::vector<float> scores;
  std::int32_t status = -1;
};

template <class S, class V>
recorded_round run_recorded(const device_batch<V>& dev, const round_case& rc, const S& scorer,
                            const triattn::round_options& options) {
  const triattn::cuda::view_batch<V> batch = dev.batch();
  const triattn::kv_geometry& g = batch.geometry;
  const std::size_t rows = static_cast<std::size_t>(batch.size) * g.num_layers * g.num_kv_heads;
  device_buffer<float> copy(std::vector<float>(rows * static_cast<std::size_t>(batch.capacity), 0.0f));
  device_buffer<std::int32_t> keep(rows * static_cast<std::size_t>(rc.stride)), kept(rows);
  device_buffer<std::int32_t> status(std::vector<std::int32_t>{0});
  const device_buffer<std::int32_t> budgets(rc.budgets);
  const device_buffer<std::int64_t> prompts(rc.prompts), starts(rc.round_starts);
  const device_buffer<float> gram(rc.gram);
  triattn::value_projection projection = rc.projection;
  projection.gram = rc.gram.empty() ? nullptr : gram.get();
  const triattn::cuda::round_inputs inputs{budgets.get(), starts.get(), prompts.get(), projection};
  const triattn::cuda::device_keep_plan plan{keep.get(), kept.get(), rc.stride};
  const recording_scorer<S> recorder{scorer, copy.get()};
  std::size_t bytes = 0;
  CUDA_REQUIRE(triattn::cuda::plan_round(nullptr, bytes, batch, recorder, options, inputs, plan, status.get(), nullptr));
  device_buffer<std::byte> ws(bytes);
  CUDA_REQUIRE(triattn::cuda::plan_round(ws.get(), bytes, batch, recorder, options, inputs, plan, status.get(), nullptr));
  CUDA_REQUIRE(triattn::cuda::compact(batch, plan, {}, status.get(), nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {keep.download(), kept.download(), copy.download(), status.download()[0]};
}

/// The GPU round of `scorer` against the CPU pipeline on the recorded scores, sequence by sequence.
template <class S, class V>
void check_round(round_case& rc, const device_batch<V>& dev, const S& scorer, const triattn::round_options& options) {
  const recorded_round gpu = run_recorded(dev, rc, scorer, options);
  CHECK(gpu.status == 0, "status ", gpu.status);
  const triattn::kv_geometry geo = rc.caches.front().geometry();
  const std::size_t rows = static_cast<std::size_t>(geo.num_layers) * geo.num_kv_heads;
  const auto cap = static_cast<std::size_t>(rc.caches.front().shape().capacity);
  for (std::size_t b = 0; b < rc.caches.size(); ++b) {
    auto& c = rc.caches[b];
    const triattn::row_rule rule = scorer.rule({rc.round_starts[b], rc.prompts[b], rc.budgets[b]});
    const cpu::keep_rows expected =
        cpu::round_plan(c, gpu.scores.data() + b * rows * cap, options, rule, rc.prompts[b], triattn::score_domain_of<S>(),
                        rc.gram.empty() ? nullptr : &rc.projection);
    for (std::size_t r = 0; r < rows; ++r) {
      const auto at = static_cast<std::ptrdiff_t>((b * rows + r) * static_cast<std::size_t>(rc.stride));
      const std::vector<std::int32_t> got(gpu.keep.begin() + at, gpu.keep.begin() + at + gpu.kept[b * rows + r]);
      CHECK(got == expected[r], "sequence ", b, " row (layer x kv_head) ", r, " budget ", rc.budgets[b], " prompt ",
            rc.prompts[b]);
    }
    cpu::compact(c, expected);
    CHECK(dev.mirror(b).download() == c.snapshot(), "cache of sequence ", b, " after the round");
  }
}

/// Random non-negative accumulated state (sums [batch, layers, q_heads, capacity], counts
/// [batch, layers, kv_heads, capacity] >= 1) for H2O and VATP.
struct random_state {
  device_buffer<float> sums;
  device_buffer<std::int32_t> counts;
  random_state(const triattn::kv_geometry& g, int batch, std::int64_t capacity, std::mt19937_64& gen) {
    const auto per = static_cast<std::size_t>(batch) * g.num_layers * static_cast<std::size_t>(capacity);
    std::vector<float> s(per * static_cast<std::size_t>(g.num_q_heads));
    std::vector<std::int32_t> n(per * static_cast<std::size_t>(g.num_kv_heads));
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (float& x : s) x = gen() % 5 == 0 ? 0.5f : unit(gen);  // some exact ties
    for (std::int32_t& x : n) x = 1 + static_cast<std::int32_t>(gen() % 4);
    sums = device_buffer<float>(s);
    counts = device_buffer<std::int32_t>(n);
  }
  triattn::cuda::accumulated_state state() const { return {sums.get(), counts.get()}; }
};

/// One policy's round under `options` on a fresh random batch.
template <class V>
void policy_case(policy_kind policy, const triattn_test::cache_shape& shape, int batch,
                 const triattn::round_options& options, bool projected, std::mt19937_64& g) {
  INFO_SCOPE(policy_name(policy), " ", shape.describe(), " batch ", batch, " ", triattn::granularity_name(options.grain),
             options.reduction == triattn::row_reduction::max ? " max" : " mean",
             options.budget == triattn::budget_mode::beyond_prompt ? " beyond_prompt" : " with_prompt",
             options.protect_prompt ? " protect_prompt" : "", " sinks ", options.sinks, " recent ", options.recent,
             " segments ", options.segments, " split ", triattn::budget_split_name(options.split), " floor ",
             options.split_floor, options.value_aware ? " value_aware" : "", projected ? " projected" : "");
  round_case rc(shape, batch, g, projected);
  const device_batch<V> dev(rc.caches);
  const triattn::kv_geometry geo = rc.caches.front().geometry();
  switch (policy) {
    case policy_kind::streaming_llm:
      check_round(rc, dev, triattn::cuda::streaming_llm_scorer{static_cast<std::int64_t>(g() % 5)}, options);
      break;
    case policy_kind::triattention: {
      const triattn::query_stats stats = triattn_test::ref::tri_random_stats(g, geo);
      device_buffer<float> buffer(triattn::cuda::stats_floats(stats));
      triattn::cuda::triattention_device_stats device_stats{};
      CUDA_REQUIRE(triattn::cuda::upload_stats(stats, buffer.get(), nullptr, device_stats));
      triattn::triattention_config config;
      config.window = static_cast<std::int64_t>(g() % 6);
      config.normalize = g() % 2 == 0;
      check_round(rc, dev, triattn::cuda::triattention_scorer{device_stats, config}, options);
      break;
    }
    case policy_kind::h2o:
    case policy_kind::vatp: {
      const random_state state(geo, batch, shape.capacity, g);
      triattn::h2o_config config;
      config.sinks = static_cast<std::int64_t>(g() % 3);
      if (g() % 2) config.recent_ratio = 0.25;  // a fraction of each sequence's prompt
      const auto scorer = policy == policy_kind::h2o ? triattn::cuda::accumulated_scorer::h2o(state.state(), config)
                                                     : triattn::cuda::accumulated_scorer::vatp(state.state(), config);
      check_round(rc, dev, scorer, options);
      break;
    }
    case policy_kind::snapkv:
    case policy_kind::rkv:
    case policy_kind::expected_attention: {
      const int window = 1 + static_cast<int>(g() % 6), rows = 1 + static_cast<int>(g() % static_cast<unsigned>(window));
      const auto per_sequence = static_cast<std::size_t>(geo.num_layers) * geo.num_q_heads * rows * geo.head_dim;
      const device_buffer<float> queries(triattn_test::normal_floats(g, per_sequence * static_cast<std::size_t>(batch)));
      std::vector<std::int32_t> positions;
      for (int b = 0; b < batch; ++b)
        for (int i = 0; i < rows; ++i)
          positions.push_back(static_cast<std::int32_t>(rc.round_starts[static_cast<std::size_t>(b)]) + i);
      const device_buffer<std::int32_t> query_positions(positions);
      const triattn::cuda::window_query_batch q{queries.get(), query_positions.get(), rows};
      if (policy == policy_kind::snapkv)
        check_round(rc, dev, triattn::cuda::snapkv_scorer{triattn::snapkv_config{.window = window}, q}, options);
      else if (policy == policy_kind::expected_attention)
        check_round(rc, dev, triattn::cuda::expected_attention_scorer{{.window = window, .sinks = 0}, q}, options);
      else
        check_round(rc, dev, triattn::cuda::rkv_scorer{triattn::rkv_config{.window = window}, q}, options);
      break;
    }
    case policy_kind::knorm: check_round(rc, dev, triattn::cuda::knorm_scorer{}, options); break;
    case policy_kind::keydiff: check_round(rc, dev, triattn::cuda::keydiff_scorer{}, options); break;
  }
}

/// One policy's round under `options` on a random element type, layout, shape and batch; a
/// value-aware round by a random output projection when `projected`.
void random_policy_case(policy_kind policy, const triattn::round_options& options, std::mt19937_64& g,
                        bool projected = false) {
  const triattn::dtype type = gpu_dtypes[g() % std::size(gpu_dtypes)];
  const cache_layout layout = triattn_test::all_layouts[g() % std::size(triattn_test::all_layouts)];
  triattn_test::cache_shape shape =
      triattn_test::random_shape(g, layout, type, 1 + static_cast<int>(g() % 8), 1 << (g() % 3));
  if (type == triattn::dtype::fp8_e4m3 || type == triattn::dtype::fp8_e5m2) shape.k_scale = 0.5f, shape.v_scale = 4.0f;
  const int batch = 1 + static_cast<int>(g() % 3);
  if (triattn_test::is_paged(layout))
    policy_case<triattn::paged_kv_view>(policy, shape, batch, options, projected, g);
  else
    policy_case<triattn::dense_kv_view>(policy, shape, batch, options, projected, g);
}

TRIATTN_CUDA_TEST("plan_round equals the CPU pipeline for every policy, granularity, reduction and budget mode") {
  auto g = triattn_test::rng(21);
  int cases = 0;
  for (const policy_kind policy : all_policies)
    for (const triattn::granularity grain :
         {triattn::granularity::per_layer, triattn::granularity::per_kv_head, triattn::granularity::whole_sequence})
      for (const triattn::row_reduction reduction : {triattn::row_reduction::mean, triattn::row_reduction::max}) {
        triattn::round_options options;
        options.grain = grain;
        options.reduction = reduction;
        options.budget = g() % 2 ? triattn::budget_mode::beyond_prompt : triattn::budget_mode::with_prompt;
        options.protect_prompt = g() % 2 == 0;
        if (g() % 3 == 0) options.sinks = static_cast<std::int64_t>(g() % 6), options.recent = static_cast<std::int64_t>(g() % 6);
        random_policy_case(policy, options, g);
        ++cases;
      }
  CHECK(cases == static_cast<int>(std::size(all_policies)) * 3 * 2, cases, " cases ran");
}

TRIATTN_CUDA_TEST("plan_round equals the CPU pipeline under segment quotas and head-adaptive budget splits") {
  auto g = triattn_test::rng(23);
  int cases = 0;
  for (const policy_kind policy : all_policies)
    for (const triattn::budget_split split :
         {triattn::budget_split::equal, triattn::budget_split::per_layer, triattn::budget_split::per_sequence}) {
      triattn::round_options options;
      options.grain = split == triattn::budget_split::per_layer || g() % 2 ? triattn::granularity::per_layer
                                                                            : triattn::granularity::per_kv_head;
      options.split = split;
      options.split_floor = static_cast<float>(g() % 5) / 4.0f;
      options.segments = 1 + static_cast<std::int64_t>(g() % 6);
      options.budget = g() % 2 ? triattn::budget_mode::beyond_prompt : triattn::budget_mode::with_prompt;
      if (g() % 3 == 0) options.sinks = static_cast<std::int64_t>(g() % 4), options.recent = static_cast<std::int64_t>(g() % 4);
      random_policy_case(policy, options, g);
      ++cases;
    }
  CHECK(cases == static_cast<int>(std::size(all_policies)) * 3, cases, " cases ran");
}

TRIATTN_CUDA_TEST("rows of a shared decision that hold different slots fail the round and compact moves nothing") {
  auto g = triattn_test::rng(22);
  auto shape = triattn_test::random_shape(g, cache_layout::dense_hnd, triattn::dtype::fp8_e4m3, 1, 1);
  shape.num_layers = 2;
  shape.capacity = 24;
  shape.k_scale = 0.5f;
  round_case rc(shape, 1, g);
  auto& c = rc.caches.front();
  c.length(1, 0) = c.length(0, 0) > 0 ? c.length(0, 0) - 1 : 1;
  const triattn_test::cache_bytes before = c.snapshot();
  const device_batch<triattn::dense_kv_view> dev(rc.caches);
  triattn::round_options options;
  options.grain = triattn::granularity::whole_sequence;
  const recorded_round gpu = run_recorded(dev, rc, triattn::cuda::streaming_llm_scorer{2}, options);
  CHECK(gpu.status == static_cast<std::int32_t>(triattn::cuda::round_status::unequal_rows), "status ", gpu.status);
  CHECK(dev.mirror(0).download() == before, "the cache changed");
}

}  // namespace

TRIATTN_CUDA_TEST("plan_round equals the CPU pipeline under value-aware correction, projected and plain") {
  auto g = triattn_test::rng(25);
  int cases = 0;
  for (const policy_kind policy : all_policies)
    for (const bool projected : {false, true}) {
      triattn::round_options options;
      options.value_aware = true;
      const triattn::granularity grains[] = {triattn::granularity::per_layer, triattn::granularity::per_kv_head,
                                             triattn::granularity::whole_sequence};
      options.grain = grains[g() % 3];
      options.reduction = g() % 2 ? triattn::row_reduction::max : triattn::row_reduction::mean;
      options.protect_prompt = g() % 2 == 0;
      if (options.grain != triattn::granularity::whole_sequence && g() % 2 == 0)
        options.split = triattn::budget_split::per_sequence;
      random_policy_case(policy, options, g, projected);
      ++cases;
    }
  CHECK(cases == static_cast<int>(std::size(all_policies)) * 2, cases, " cases ran");
}
