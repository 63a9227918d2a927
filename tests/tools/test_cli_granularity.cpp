// `triattn select P --granularity G` for every policy P of the registry (triattn::policy_registry)
// and every G of shared/spec/cli.md, run as users run it, on fresh random inputs:
//
// - shape: per_layer int64 [L, Hkv, k], per_kv_head [Hkv, k], union [k], k = min(B, N); rows
//   ascending; without --granularity the policy's default (triattention per_kv_head, the others
//   per_layer), byte for byte the same as with it;
// - content, against an independent computation from `triattn score P` on the same inputs (not
//   from the per_layer selection): each (layer, kv-head) row's normalised score (TriAttention:
//   z-score of every (layer, q-head) row of the raw scores over the candidate slots, population
//   std floored at 1e-6, max over the GQA group; the others: their score as written), then the
//   mean over the rows that share a keep set (per_kv_head: the layers; union: every layer and
//   head), then cli.md's budget rule on that mean: H2O recent B/2 + heavy B − B/2; VATP the
//   same with 4 sinks first in heavy; SnapKV and R-KV the window (+inf) counted in B;
//   TriAttention the top B (with --window W: the last W, then the top B − W of the rest); ties
//   to the lower index. A slot may differ from that set only at a near-tie (within 1e-5 of the
//   largest |score|) among the slots chosen by score;
// - streaming_llm (select only): the first S slots and the last B − S, exactly, S = --sinks
//   (default 4) capped at B, at every granularity;
// - errors keep cli.md's form (exit 2, one line naming the option or file, nothing written): a
//   bad --granularity, `score streaming_llm`, an unknown policy (the message lists the registry),
//   shared keep sets over rows that hold different positions.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "keep_check.hpp"
#include "support/random.hpp"
#include "support/triattention_reference.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/registry.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;
using triattn_test::cli::check_keep;
using triattn_test::cli::check_one_line_error;
using triattn_test::cli::expected_keep;
using triattn_test::cli::run_cli;
using triattn_test::cli::run_cli_npy;
using triattn_test::cli::scratch_dir;

constexpr int layers = 3, kv_heads = 2, group = 2, q_heads = kv_heads * group, head_dim = 16;
constexpr double tie_tolerance = 1e-5;  // of the largest finite |score| of the decision
constexpr double inf = std::numeric_limits<double>::infinity();

const std::vector<std::string> granularities = {"per_layer", "per_kv_head", "union"};

/// The compressing policies of the registry: what `triattn select` must offer.
std::vector<std::string> registry_policies() {
  std::vector<std::string> out;
  for (const std::string_view n : triattn::policy_name_list(true)) out.emplace_back(n);
  return out;
}

std::string default_granularity(const std::string& policy) {
  return policy == triattn::triattention::name ? "per_kv_head" : "per_layer";
}

/// Every input file of one random set: each command ignores those it does not use.
struct inputs {
  scratch_dir dir{"cli_granularity"};
  std::int64_t n = 0, rows = 0, w = 0, round_start = 0;
  std::string keys = (dir / "keys.npy").string(), values = (dir / "values.npy").string(),
              attn = (dir / "attn.npy").string(), queries = (dir / "queries.npy").string(),
              stats = (dir / "stats.safetensors").string(), out = (dir / "out.npy").string();

  inputs(std::mt19937_64& g, std::int64_t tokens) : n(tokens) {
    rows = std::uniform_int_distribution<std::int64_t>(1, n)(g);
    w = std::uniform_int_distribution<std::int64_t>(1, 6)(g);
    round_start = n + std::uniform_int_distribution<std::int64_t>(0, 50)(g);
    const std::vector<std::int64_t> kv_shape = {layers, kv_heads, n, head_dim};
    const auto kv = triattn_test::normal_floats(g, static_cast<std::size_t>(layers * kv_heads * n * head_dim));
    io::write_npy(keys, io::element_kind::f32, kv_shape, kv.data());
    const auto v = triattn_test::normal_floats(g, kv.size());
    io::write_npy(values, io::element_kind::f32, kv_shape, v.data());
    // Causal softmax rows: row r sits at position n − rows + r and sees the slots up to it.
    std::vector<float> a(static_cast<std::size_t>(layers * q_heads * rows * n), 0.0f);
    std::normal_distribution<double> logit(0.0, 1.5);
    for (std::int64_t lh = 0; lh < layers * q_heads; ++lh)
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t t = n - rows + r;
        std::vector<double> e(static_cast<std::size_t>(t + 1));
        double sum = 0.0;
        for (double& x : e) sum += x = std::exp(logit(g));
        for (std::int64_t j = 0; j <= t; ++j) a[static_cast<std::size_t>((lh * rows + r) * n + j)] = static_cast<float>(e[j] / sum);
      }
    const std::vector<std::int64_t> attn_shape = {layers, q_heads, rows, n};
    io::write_npy(attn, io::element_kind::f32, attn_shape, a.data());
    const auto q = triattn_test::normal_floats(g, static_cast<std::size_t>(layers * q_heads * w * head_dim));
    const std::vector<std::int64_t> q_shape = {layers, q_heads, w, head_dim};
    io::write_npy(queries, io::element_kind::f32, q_shape, q.data());
    const triattn::kv_geometry geo{layers, q_heads, kv_heads, head_dim, triattn::dtype::f32,
                                   triattn::key_state::post_rope, {}};
    triattn::save_stats(stats, triattn_test::ref::tri_random_stats(g, geo));
  }

  /// Every input (without `--queries` when not `with_queries`: Expected Attention then takes
  /// the stats' query means).
  std::vector<std::string> command(const std::string& verb, const std::string& policy,
                                   const std::vector<std::string>& extra, bool with_queries = true) const {
    std::vector<std::string> a = {verb,    policy, "--keys",  keys,  "--values",      values,
                                  "--attn", attn,  "--stats", stats, "--round-start", std::to_string(round_start)};
    if (with_queries) a.insert(a.end(), {"--queries", queries});
    a.insert(a.end(), extra.begin(), extra.end());
    a.insert(a.end(), {"--out", out});
    return a;
  }

  /// Runs `args`, which must succeed silently; returns the output (and removes it).
  io::npy_array run(const std::vector<std::string>& args) const { return run_cli_npy(dir, args, out); }

  /// `args` must fail as cli.md says and leave the folder as it was.
  void refused(const std::vector<std::string>& args, const std::vector<std::string>& needles) const {
    const auto before = dir.listing();
    const auto r = run_cli(dir, args);
    check_one_line_error(r, needles);
    CHECK(!fs::exists(out));
    CHECK(dir.listing() == before);
  }
};

/// Each (layer, kv-head) row's normalised score [L][Hkv][N], from `triattn score P`.
std::vector<std::vector<std::vector<double>>> row_scores(const inputs& in, const std::string& policy,
                                                         std::int64_t window, bool with_queries = true) {
  const io::npy_array a = in.run(in.command("score", policy, {"--window", std::to_string(window)}, with_queries));
  const std::vector<float> s = a.to_float();
  std::vector<std::vector<std::vector<double>>> out(layers, std::vector<std::vector<double>>(kv_heads));
  if (policy != triattn::triattention::name) {
    REQUIRE(a.shape == std::vector<std::int64_t>{layers, kv_heads, in.n});
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h)
        out[l][h].assign(s.begin() + (l * kv_heads + h) * in.n, s.begin() + (l * kv_heads + h + 1) * in.n);
    return out;
  }
  // TriAttention: raw [L, Hq, N]; z-score each row over the candidates (all but the last
  // `window`), population std floored at 1e-6; max over the group.
  REQUIRE(a.shape == std::vector<std::int64_t>{layers, q_heads, in.n});
  const std::int64_t cand = in.n - std::min(window, in.n);
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h) {
      out[l][h].assign(static_cast<std::size_t>(in.n), -inf);
      for (int gi = 0; gi < group; ++gi) {
        const std::size_t row = static_cast<std::size_t>((l * q_heads + h * group + gi) * in.n);
        double mean = 0.0, var = 0.0;
        for (std::int64_t j = 0; j < cand; ++j) mean += s[row + j];
        mean /= static_cast<double>(std::max<std::int64_t>(cand, 1));
        for (std::int64_t j = 0; j < cand; ++j) var += (s[row + j] - mean) * (s[row + j] - mean);
        const double sd = std::max(std::sqrt(var / static_cast<double>(std::max<std::int64_t>(cand, 1))), 1e-6);
        for (std::int64_t j = 0; j < in.n; ++j)
          out[l][h][j] = j < cand ? std::max(out[l][h][j], (s[row + j] - mean) / sd) : inf;
      }
    }
  return out;
}

/// The best `k` of `candidates` by `s`, ties to the lower index.
std::vector<std::int64_t> top(const std::vector<double>& s, std::vector<std::int64_t> candidates, std::int64_t k) {
  std::stable_sort(candidates.begin(), candidates.end(), [&](std::int64_t a, std::int64_t b) { return s[a] > s[b]; });
  candidates.resize(static_cast<std::size_t>(std::max<std::int64_t>(0, std::min<std::int64_t>(k, candidates.size()))));
  return candidates;
}

/// The keep set cli.md's budget rule makes from one decision's (folded) score, and which
/// slots it chose by score (the others are protected: sinks, recent, window).
expected_keep expect(const std::string& policy, const std::vector<double>& s, std::int64_t budget, std::int64_t window) {
  const auto n = static_cast<std::int64_t>(s.size());
  expected_keep e;
  e.ranked.assign(s.size(), false);
  if (n <= budget) {
    e.keep.resize(static_cast<std::size_t>(n));
    std::iota(e.keep.begin(), e.keep.end(), 0);
    return e;
  }
  std::vector<std::int64_t> protect, candidates;
  std::int64_t by_score = 0;
  if (policy == triattn::h2o::name || policy == triattn::vatp::name) {
    const std::int64_t recent = budget / 2, heavy = budget - recent;
    const std::int64_t sinks = policy == triattn::vatp::name ? std::min<std::int64_t>(4, heavy) : 0;
    for (std::int64_t j = 0; j < n; ++j) (j < sinks || j >= n - recent ? protect : candidates).push_back(j);
    by_score = heavy - sinks;
  } else if (policy == triattn::triattention::name) {
    for (std::int64_t j = 0; j < n; ++j) (j >= n - window ? protect : candidates).push_back(j);
    by_score = budget - window;
  } else {  // snapkv, rkv: the window's +inf wins, ties to the lower index
    for (std::int64_t j = 0; j < n; ++j) (std::isinf(s[j]) ? protect : candidates).push_back(j);
    if (static_cast<std::int64_t>(protect.size()) > budget) protect.resize(static_cast<std::size_t>(budget));
    by_score = budget - static_cast<std::int64_t>(protect.size());
  }
  for (const std::int64_t j : candidates) e.ranked[j] = true;
  e.keep = top(s, candidates, by_score);
  e.keep.insert(e.keep.end(), protect.begin(), protect.end());
  std::sort(e.keep.begin(), e.keep.end());
  return e;
}

std::vector<std::int64_t> expected_shape(const std::string& grain, std::int64_t k) {
  if (grain == "per_layer") return {layers, kv_heads, k};
  if (grain == "per_kv_head") return {kv_heads, k};
  return {k};
}

/// `select policy --granularity grain --budget budget` on `in`: shape and content.
void check_select(const inputs& in, const std::string& policy, const std::string& grain, std::int64_t budget,
                  std::int64_t window = 0, bool with_queries = true) {
  INFO("select " << policy << " --granularity " << grain << " --budget " << budget << " (N " << in.n << ", w "
                 << in.w << ", rows " << in.rows << ", triattention window " << window << ")");
  std::vector<std::string> extra = {"--budget", std::to_string(budget), "--granularity", grain};
  if (window > 0) extra.insert(extra.end(), {"--window", std::to_string(window)});
  const io::npy_array a = in.run(in.command("select", policy, extra, with_queries));
  const std::int64_t k = std::min(budget, in.n);
  REQUIRE(a.kind == io::element_kind::i64);
  REQUIRE(a.shape == expected_shape(grain, k));
  const std::vector<std::int64_t> got = a.to_int64();
  const auto row_of = [&](std::size_t d) {
    return std::vector<std::int64_t>(got.begin() + static_cast<std::ptrdiff_t>(d * k),
                                     got.begin() + static_cast<std::ptrdiff_t>((d + 1) * k));
  };
  const std::size_t decisions = grain == "per_layer" ? layers * kv_heads : grain == "per_kv_head" ? kv_heads : 1;

  if (policy == triattn::streaming_llm::name) {  // sinks 4 by default, then the most recent
    const std::int64_t sinks = std::min<std::int64_t>(4, k);
    std::vector<std::int64_t> want;
    for (std::int64_t j = 0; j < in.n; ++j)
      if (in.n <= budget || j < sinks || j >= in.n - (budget - sinks)) want.push_back(j);
    for (std::size_t d = 0; d < decisions; ++d) CHECK(row_of(d) == want);
    return;
  }

  const auto rows = row_scores(in, policy, window, with_queries);
  for (std::size_t d = 0; d < decisions; ++d) {
    // The rows that share keep set d, folded by their mean.
    std::vector<double> folded(static_cast<std::size_t>(in.n), 0.0);
    int count = 0;
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        const bool member = grain == "per_layer"     ? d == static_cast<std::size_t>(l * kv_heads + h)
                            : grain == "per_kv_head" ? d == static_cast<std::size_t>(h)
                                                     : true;
        if (!member) continue;
        ++count;
        for (std::int64_t j = 0; j < in.n; ++j) folded[j] += rows[l][h][j];
      }
    REQUIRE(count == (grain == "per_layer" ? 1 : grain == "per_kv_head" ? layers : layers * kv_heads));
    for (double& x : folded) x /= count;
    INFO("keep set " << d);
    check_keep(row_of(d), folded, expect(policy, folded, budget, window), tie_tolerance);
  }
}

}  // namespace

TEST_CASE("select: every registry policy at every granularity, shape and content", "[cli][granularity]") {
  auto g = triattn_test::rng(31);
  for (int trial = 0; trial < 2; ++trial) {
    const inputs in(g, std::uniform_int_distribution<std::int64_t>(20, 40)(g));
    const std::vector<std::int64_t> budgets = {1, 5, std::uniform_int_distribution<std::int64_t>(7, in.n - 2)(g),
                                               in.n - 1, in.n, in.n + 3};
    for (const std::string& policy : registry_policies())
      for (const std::string& grain : granularities)
        for (const std::int64_t b : budgets) check_select(in, policy, grain, b);
  }
}

TEST_CASE("select expected_attention takes --stats in place of --queries", "[cli][granularity]") {
  auto g = triattn_test::rng(35);
  const inputs in(g, 32);
  const std::string p(triattn::expected_attention::name);
  int differ = 0;
  for (const std::string& grain : granularities)
    for (const std::int64_t b : {3, 11, 20}) {
      check_select(in, p, grain, b, 0, false);
      const std::vector<std::string> extra = {"--budget", std::to_string(b), "--granularity", grain};
      differ += in.run(in.command("select", p, extra, false)).data != in.run(in.command("select", p, extra)).data;
    }
  CHECK(differ > 0);  // the stats' means, not the queries: other keep sets
}

TEST_CASE("select triattention with protected recent slots at every granularity", "[cli][granularity]") {
  auto g = triattn_test::rng(32);
  const inputs in(g, 30);
  for (const std::string& grain : granularities)
    for (const std::int64_t b : {4, 12, 29}) check_select(in, std::string(triattn::triattention::name), grain, b, 3);
}

TEST_CASE("select without --granularity: the policy's default, unchanged", "[cli][granularity]") {
  auto g = triattn_test::rng(33);
  const inputs in(g, 25);
  const std::int64_t b = 9;
  for (const std::string& policy : registry_policies()) {
    INFO(policy);
    const std::vector<std::string> budget = {"--budget", std::to_string(b)};
    std::vector<std::string> explicit_default = budget;
    explicit_default.insert(explicit_default.end(), {"--granularity", default_granularity(policy)});
    const io::npy_array plain = in.run(in.command("select", policy, budget));
    const io::npy_array given = in.run(in.command("select", policy, explicit_default));
    CHECK(plain.shape == expected_shape(default_granularity(policy), b));
    CHECK(plain.shape == given.shape);
    CHECK(plain.data == given.data);
  }
}

TEST_CASE("select streaming_llm: the first S slots and the last B - S", "[cli][granularity]") {
  auto g = triattn_test::rng(34);
  const inputs in(g, 20);
  const std::string p(triattn::streaming_llm::name);
  for (const std::string& grain : granularities)
    for (const std::int64_t sinks : {0, 1, 4, 7})
      for (const std::int64_t b : {1, 3, 6, 19, 20, 25}) {
        INFO(grain << " --sinks " << sinks << " --budget " << b);
        // Only --keys: the keys give the shape.
        const io::npy_array a = in.run({"select", p, "--keys", in.keys, "--budget", std::to_string(b), "--sinks",
                                        std::to_string(sinks), "--granularity", grain, "--out", in.out});
        const std::int64_t k = std::min(b, in.n), s = std::min(sinks, b);
        REQUIRE(a.shape == expected_shape(grain, k));
        std::vector<std::int64_t> want;
        for (std::int64_t j = 0; j < in.n; ++j)
          if (in.n <= b || j < s || j >= in.n - (b - s)) want.push_back(j);
        const std::vector<std::int64_t> got = a.to_int64();
        for (std::size_t d = 0; d * static_cast<std::size_t>(k) < got.size(); ++d)
          CHECK(std::vector<std::int64_t>(got.begin() + static_cast<std::ptrdiff_t>(d * k),
                                          got.begin() + static_cast<std::ptrdiff_t>((d + 1) * k)) == want);
      }
}

TEST_CASE("granularity and registry errors keep cli.md's form", "[cli][granularity][errors]") {
  auto g = triattn_test::rng(35);
  const inputs in(g, 16);
  const std::vector<std::string> budget = {"--budget", "5"};
  for (const std::string& policy : registry_policies()) {
    INFO(policy);
    std::vector<std::string> bad = budget;
    bad.insert(bad.end(), {"--granularity", "per_token"});
    in.refused(in.command("select", policy, bad), {"--granularity", "per_token"});
  }
  in.refused(in.command("score", std::string(triattn::streaming_llm::name), {}), {"streaming_llm"});
  // Unknown names, `full` among them (it compresses nothing): the message lists the registry.
  for (const std::string name : {"h3o", "full"}) {
    std::vector<std::string> needles = {name};
    for (const std::string& p : registry_policies()) needles.push_back(p);
    in.refused(in.command("select", name, budget), needles);
  }
  in.refused({"select", std::string(triattn::streaming_llm::name), "--keys", in.keys, "--budget", "5", "--sinks", "-1",
              "--out", in.out},
             {"--sinks"});
  // Shared keep sets need every row to hold the same positions: per-(layer, head) positions
  // that differ are refused for per_kv_head and union, accepted for per_layer.
  const std::string positions = (in.dir / "positions.npy").string();
  std::vector<std::int64_t> p;
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h)
      for (std::int64_t j = 0; j < in.n; ++j) p.push_back(2 * j + (l == 1 ? 1 : 0));
  const std::vector<std::int64_t> p_shape = {layers, kv_heads, in.n};
  io::write_npy(positions, io::element_kind::i64, p_shape, p.data());
  const std::string tri(triattn::triattention::name);
  std::vector<std::string> args = budget;
  args.insert(args.end(), {"--positions", positions, "--round-start", "1000", "--granularity", "per_layer"});
  in.run(in.command("select", tri, args));
  for (const std::string grain : {"per_kv_head", "union"}) {
    args[args.size() - 1] = grain;
    in.refused(in.command("select", tri, args), {grain == "union" ? "union" : "per_kv_head"});
  }
}

TEST_CASE("the usage text lists the registry", "[cli][granularity]") {
  const scratch_dir dir("cli_usage");
  const auto r = run_cli(dir, {"--help"});
  REQUIRE(r.code == 0);
  CHECK(r.out.find("policies: " + triattn::policy_names(true)) != std::string::npos);
  CHECK(r.out.find("--granularity") != std::string::npos);
}
