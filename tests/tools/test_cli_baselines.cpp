// `triattn score|select h2o|vatp|snapkv|rkv` (shared/spec/cli.md) run as users run them, on
// fresh random .npy inputs, against the double-precision oracles of
// tests/support/baselines_reference.hpp (H2O, VATP) and tests/support/window_reference.hpp
// (SnapKV, R-KV).
//
// Inputs: keys and values [L, Hkv, N, D] (float32, and one run with float16 keys), attention
// [L, Hq, rows, N] as genuine causal softmax rows (row r sits at position N − rows + r and sees
// the slots up to it), window queries [L, Hq, w, D]; GQA groups 1, 2 and 4.
//
// - score: float32 [L, Hkv, N], every finite slot within 1e-4 of the row's largest finite
//   |oracle score|; SnapKV's and R-KV's last w slots exactly +inf;
// - select: int64 [L, Hkv, min(B, N)], ascending, equal to the oracle's keep set with cli.md's
//   budget semantics (H2O recent B/2 + heavy B − B/2; VATP 4 sinks, recent B/2, heavy the rest;
//   SnapKV and R-KV count the window in B), except at near-ties: a slot may differ from the
//   oracle's set only if the oracle ranks it by score (not a sink, recent or window slot) and
//   its oracle score is within 1e-5 × (the row's largest finite |oracle score|) of the oracle's
//   weakest kept ranked score; and no ranked slot the CLI drops may beat one it keeps by more
//   than that. Budgets 1, B >= N (everything) and values between;
// - `--gqa max|sum` for H2O (and VATP, SnapKV);
// - every command ignores the inputs it does not use: --keys --values --attn --queries
//   --positions --round-start all given leave the outputs byte for byte unchanged;
// - errors: exit 2, one line naming the file or option, nothing written.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "keep_check.hpp"
#include "support/baselines_reference.hpp"
#include "support/window_reference.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "triattn/core/gqa.hpp"
#include "triattn/io/npy.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;
namespace ref = triattn_test::ref;
using triattn_test::cli::check_keep;
using triattn_test::cli::check_one_line_error;
using triattn_test::cli::expected_keep;
using triattn_test::cli::finite_scale;
using triattn_test::cli::run_cli;
using triattn_test::cli::run_cli_npy;
using triattn_test::cli::scratch_dir;

constexpr int layers = 2, kv_heads = 2, head_dim = 16;
constexpr double score_tolerance = 1e-4;  // of the row's largest finite |oracle score|
constexpr double tie_tolerance = 1e-5;    // same
constexpr double rkv_threshold_margin = 1e-6;  // closer cosines to 0.5 may flip in fp32: row skipped
constexpr double inf = std::numeric_limits<double>::infinity();

enum class policy { h2o, vatp, snapkv, rkv };
constexpr policy all_policies[] = {policy::h2o, policy::vatp, policy::snapkv, policy::rkv};

const char* name(policy p) {
  switch (p) {
    case policy::h2o: return "h2o";
    case policy::vatp: return "vatp";
    case policy::snapkv: return "snapkv";
    case policy::rkv: return "rkv";
  }
  return "?";
}
bool windowed(policy p) { return p == policy::snapkv || p == policy::rkv; }

const char* name(triattn::gqa_aggregation a) {
  switch (a) {
    case triattn::gqa_aggregation::mean: return "mean";
    case triattn::gqa_aggregation::max: return "max";
    case triattn::gqa_aggregation::sum: return "sum";
  }
  return "?";
}

/// One set of inputs, as the CLI reads them.
struct inputs {
  int group = 1;
  std::int64_t n = 0;     ///< tokens
  std::int64_t rows = 0;  ///< attention rows
  std::int64_t w = 0;     ///< window queries
  bool f16_keys = false;
  std::vector<float> keys, values;  ///< [L, Hkv, N, D]; keys rounded to float16 with f16_keys
  std::vector<float> attn;          ///< [L, Hq, rows, N]
  std::vector<float> queries;       ///< [L, Hq, w, D]
  std::vector<std::int64_t> positions;  ///< [L, Hkv, N], for the `ignores` check only

  int q_heads() const { return kv_heads * group; }
  std::size_t kv_row(int l, int h, std::int64_t j) const {
    return static_cast<std::size_t>(((l * kv_heads + h) * n + j) * head_dim);
  }
  std::size_t attn_row(int l, int qh, std::int64_t r) const {
    return static_cast<std::size_t>(((l * q_heads() + qh) * rows + r) * n);
  }
  std::size_t query_row(int l, int qh, std::int64_t i) const {
    return static_cast<std::size_t>(((l * q_heads() + qh) * w + i) * head_dim);
  }
};

inputs random_inputs(std::mt19937_64& g, int group, bool f16_keys, std::int64_t n, std::int64_t rows, std::int64_t w) {
  inputs in;
  in.group = group;
  in.n = n;
  in.rows = rows;
  in.w = w;
  in.f16_keys = f16_keys;
  const auto kv_size = static_cast<std::size_t>(layers * kv_heads * n * head_dim);
  in.keys = triattn_test::normal_floats(g, kv_size);
  in.values = triattn_test::normal_floats(g, kv_size);
  // Near-duplicate keys (cosine far above R-KV's 0.5 threshold), so that redundancy matters.
  std::normal_distribution<float> noise(0.0f, 0.1f);
  std::uniform_int_distribution<std::int64_t> slot(1, n - 1);
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h)
      for (std::int64_t k = 0; k < n / 6; ++k) {
        const std::int64_t j = slot(g);
        const std::int64_t i = std::uniform_int_distribution<std::int64_t>(0, j - 1)(g);
        for (int d = 0; d < head_dim; ++d) in.keys[in.kv_row(l, h, j) + d] = in.keys[in.kv_row(l, h, i) + d] + noise(g);
      }
  if (f16_keys)
    for (float& x : in.keys) x = static_cast<float>(ref::decode(ref::f16_format, ref::encode(ref::f16_format, x)));
  // Causal softmax rows: row r at position t = N − rows + r over the slots j <= t.
  in.attn.assign(static_cast<std::size_t>(layers * in.q_heads() * rows * n), 0.0f);
  std::normal_distribution<double> logit(0.0, 1.5);
  for (int l = 0; l < layers; ++l)
    for (int qh = 0; qh < in.q_heads(); ++qh)
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t t = n - rows + r;
        std::vector<double> e(static_cast<std::size_t>(t + 1));
        double sum = 0.0;
        for (double& x : e) sum += x = std::exp(logit(g));
        for (std::int64_t j = 0; j <= t; ++j) in.attn[in.attn_row(l, qh, r) + j] = static_cast<float>(e[j] / sum);
      }
  in.queries = triattn_test::normal_floats(g, static_cast<std::size_t>(layers * in.q_heads() * w * head_dim));
  // Positions that are not the slot indices: a baseline must ignore them.
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h)
      for (std::int64_t j = 0; j < n; ++j) in.positions.push_back(100 + 3 * j + l + h);
  return in;
}

/// The input files of one set, and the output.
struct files {
  std::string keys, values, attn, queries, positions, out;
};

files write_inputs(const scratch_dir& dir, const inputs& in) {
  files f{(dir / "keys.npy").string(),    (dir / "values.npy").string(),    (dir / "attn.npy").string(),
          (dir / "queries.npy").string(), (dir / "positions.npy").string(), (dir / "out.npy").string()};
  const std::vector<std::int64_t> kv_shape = {layers, kv_heads, in.n, head_dim};
  if (in.f16_keys) {
    std::vector<std::uint16_t> bits;
    for (const float x : in.keys) bits.push_back(ref::encode(ref::f16_format, x));
    io::write_npy(f.keys, io::element_kind::f16, kv_shape, bits.data());
  } else {
    io::write_npy(f.keys, io::element_kind::f32, kv_shape, in.keys.data());
  }
  io::write_npy(f.values, io::element_kind::f32, kv_shape, in.values.data());
  const std::vector<std::int64_t> attn_shape = {layers, in.q_heads(), in.rows, in.n};
  io::write_npy(f.attn, io::element_kind::f32, attn_shape, in.attn.data());
  const std::vector<std::int64_t> q_shape = {layers, in.q_heads(), in.w, head_dim};
  io::write_npy(f.queries, io::element_kind::f32, q_shape, in.queries.data());
  const std::vector<std::int64_t> p_shape = {layers, kv_heads, in.n};
  io::write_npy(f.positions, io::element_kind::i64, p_shape, in.positions.data());
  return f;
}

/// The oracles, fed from the plain arrays.
class oracle {
 public:
  explicit oracle(const inputs& in) : in_(in), history_(layers, in.q_heads()) {
    for (std::int32_t j = 0; j < in.n; ++j) slots_.push_back(j);
    for (int l = 0; l < layers; ++l)
      for (int qh = 0; qh < in.q_heads(); ++qh)
        for (std::int64_t r = 0; r < in.rows; ++r) {
          const auto row = std::span<const float>(in.attn).subspan(in.attn_row(l, qh, r), slots_.size());
          history_.observe(l, qh, slots_, row, 1.0);
        }
  }

  /// cli.md's score of (layer l, kv-head h) [N]. For R-KV, `threshold_margin` receives the
  /// smallest |cosine − 0.5| of the row.
  std::vector<double> scores(policy p, int l, int h, triattn::gqa_aggregation agg, double& threshold_margin) const {
    threshold_margin = inf;
    if (!windowed(p)) {
      auto s = ref::h2o_scores(history_, l, h, in_.group, slots_, agg, false);
      if (p == policy::vatp)
        for (std::int64_t j = 0; j < in_.n; ++j) {
          double norm = 0.0;
          for (int d = 0; d < head_dim; ++d) norm += std::fabs(double{in_.values[in_.kv_row(l, h, j) + d]});
          s[static_cast<std::size_t>(j)] *= norm;
        }
      return s;
    }
    const ref::window_row row = window_row(l, h);
    if (p == policy::snapkv) {
      const ref::group_rule rule = agg == triattn::gqa_aggregation::mean  ? ref::group_rule::mean
                                   : agg == triattn::gqa_aggregation::max ? ref::group_rule::max
                                                                          : ref::group_rule::sum;
      return ref::snapkv_scores(ref::snapkv_votes(row, static_cast<int>(in_.w), 7, true),
                                static_cast<std::size_t>(in_.n), rule);
    }
    return ref::rkv_scores(row, static_cast<int>(in_.w), 7, 0.1, 0.5, threshold_margin);
  }

 private:
  const inputs& in_;
  ref::attention_history history_;
  std::vector<std::int32_t> slots_;  // slot j holds position j

  ref::window_row window_row(int l, int h) const {
    ref::window_row r;
    for (std::int64_t i = 0; i < in_.w; ++i) r.q_pos.push_back(static_cast<std::int32_t>(in_.n - in_.w + i));
    for (int qh = h * in_.group; qh < (h + 1) * in_.group; ++qh) {
      r.q.emplace_back();
      for (std::int64_t i = 0; i < in_.w; ++i) {
        const float* q = &in_.queries[in_.query_row(l, qh, i)];
        r.q.back().emplace_back(q, q + head_dim);
      }
    }
    for (std::int64_t j = 0; j < in_.n; ++j) {
      const float* k = &in_.keys[in_.kv_row(l, h, j)];
      r.k.emplace_back(k, k + head_dim);
      r.k_pos.push_back(static_cast<std::int32_t>(j));
    }
    return r;
  }
};

/// The oracle's keep set under cli.md's budget semantics, and which slots it ranks by score.
expected_keep oracle_keep(policy p, const std::vector<double>& s, std::int64_t budget) {
  const auto n = static_cast<std::int64_t>(s.size());
  expected_keep e;
  e.ranked.assign(s.size(), false);
  if (windowed(p)) {
    const std::vector<std::int32_t> keep = ref::keep_best(s, budget).keep;
    e.keep.assign(keep.begin(), keep.end());
    if (budget < n)
      for (std::int64_t j = 0; j < n; ++j) e.ranked[j] = std::isfinite(s[j]);
    return e;
  }
  const ref::split_parts parts = ref::split_budget(budget, std::nullopt, std::nullopt, p == policy::vatp ? 4 : 0);
  const std::vector<std::int32_t> keep = ref::heavy_recent_keep(s, parts).keep;
  e.keep.assign(keep.begin(), keep.end());
  if (n > parts.recent + parts.heavy)
    for (std::int64_t j = 0; j < n; ++j) e.ranked[j] = !(j < parts.sinks || j >= n - parts.recent);
  return e;
}

/// Runs commands in one scratch folder and reads their outputs back.
class session {
 public:
  explicit session(const inputs& in) : in_(in), files_(write_inputs(dir_, in)), oracle_(in) {}

  const files& paths() const { return files_; }
  const scratch_dir& dir() const { return dir_; }
  int differing_slots() const { return differ_; }
  int skipped_rows() const { return skipped_; }

  /// `triattn <verb> <p>` with the inputs the policy uses, or with every input (--keys
  /// --values --attn --queries --positions --round-start), then `extra`.
  std::vector<std::string> command(const char* verb, policy p, bool every_input,
                                   const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> a = {verb, name(p), "--keys", files_.keys};
    if (every_input) {
      a.insert(a.end(), {"--values", files_.values, "--attn", files_.attn, "--queries", files_.queries, "--positions",
                         files_.positions, "--round-start", "1000"});
    } else if (windowed(p)) {
      a.insert(a.end(), {"--queries", files_.queries});
    } else {
      if (p == policy::vatp) a.insert(a.end(), {"--values", files_.values});
      a.insert(a.end(), {"--attn", files_.attn});
    }
    a.insert(a.end(), extra.begin(), extra.end());
    a.insert(a.end(), {"--out", files_.out});
    return a;
  }

  /// Runs `args`, which must succeed silently; returns the output (and removes it).
  io::npy_array run(const std::vector<std::string>& args) const { return run_cli_npy(dir_, args, files_.out); }

  /// `score <p>` against the oracle; returns the output.
  io::npy_array check_score(policy p, triattn::gqa_aggregation agg, bool every_input = false) {
    std::vector<std::string> extra;
    if (agg != triattn::gqa_aggregation::mean || every_input) extra = {"--gqa", name(agg)};
    const auto args = command("score", p, every_input, extra);
    const io::npy_array a = run(args);
    INFO("score " << name(p) << " --gqa " << name(agg) << ", group " << in_.group << ", N " << in_.n << ", rows "
                  << in_.rows << ", w " << in_.w << (in_.f16_keys ? ", float16 keys" : ""));
    REQUIRE(a.kind == io::element_kind::f32);
    REQUIRE(a.shape == std::vector<std::int64_t>{layers, kv_heads, in_.n});
    const std::vector<float> got = a.to_float();
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        double margin = inf;
        const std::vector<double> want = oracle_.scores(p, l, h, agg, margin);
        if (margin < rkv_threshold_margin) {
          ++skipped_;
          continue;
        }
        const double tol = score_tolerance * finite_scale(want);
        const std::size_t row = static_cast<std::size_t>((l * kv_heads + h) * in_.n);
        for (std::int64_t j = 0; j < in_.n; ++j) {
          const float x = got[row + static_cast<std::size_t>(j)];
          INFO("layer " << l << " kv-head " << h << " slot " << j << ": got " << x << ", oracle " << want[j]);
          if (std::isinf(want[j])) {
            REQUIRE(static_cast<double>(x) == want[j]);
          } else {
            REQUIRE(std::isfinite(x));
            REQUIRE(std::fabs(x - want[j]) <= tol);
          }
        }
      }
    return a;
  }

  /// `select <p> --budget B` against the oracle; returns the output.
  io::npy_array check_select(policy p, std::int64_t budget, triattn::gqa_aggregation agg, bool every_input = false) {
    std::vector<std::string> extra = {"--budget", std::to_string(budget)};
    if (agg != triattn::gqa_aggregation::mean || every_input) extra.insert(extra.end(), {"--gqa", name(agg)});
    const io::npy_array a = run(command("select", p, every_input, extra));
    INFO("select " << name(p) << " --budget " << budget << " --gqa " << name(agg) << ", group " << in_.group << ", N "
                   << in_.n << ", rows " << in_.rows << ", w " << in_.w << (in_.f16_keys ? ", float16 keys" : ""));
    const std::int64_t k = std::min(budget, in_.n);
    REQUIRE(a.kind == io::element_kind::i64);
    REQUIRE(a.shape == std::vector<std::int64_t>{layers, kv_heads, k});
    const std::vector<std::int64_t> all = a.to_int64();
    for (int l = 0; l < layers; ++l)
      for (int h = 0; h < kv_heads; ++h) {
        INFO("layer " << l << " kv-head " << h);
        const auto first = all.begin() + (l * kv_heads + h) * k;
        const std::vector<std::int64_t> got(first, first + k);
        double margin = inf;
        const std::vector<double> s = oracle_.scores(p, l, h, agg, margin);
        if (budget >= in_.n) {  // everything, whatever the scores
          std::vector<std::int64_t> every(static_cast<std::size_t>(in_.n));
          for (std::int64_t j = 0; j < in_.n; ++j) every[j] = j;
          CHECK(got == every);
          continue;
        }
        if (margin < rkv_threshold_margin) {
          ++skipped_;
          continue;
        }
        differ_ += check_keep(got, s, oracle_keep(p, s, budget), tie_tolerance);
      }
    return a;
  }

 private:
  const inputs& in_;
  scratch_dir dir_{"cli_baselines"};
  files files_;
  oracle oracle_;
  int differ_ = 0, skipped_ = 0;
};

bool same(const io::npy_array& a, const io::npy_array& b) {
  return a.kind == b.kind && a.shape == b.shape && a.data == b.data;
}

/// Budgets: 1, small ones (VATP's sinks take all of heavy), one just past the window, one in
/// the middle, N − 1, N and past N.
std::vector<std::int64_t> budgets(std::mt19937_64& g, const inputs& in) {
  std::vector<std::int64_t> b = {1, 2, 5, in.w + 1, std::uniform_int_distribution<std::int64_t>(6, in.n - 2)(g),
                                 in.n - 1, in.n, in.n + 7};
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}

void run_all(std::mt19937_64& g, int group, bool f16_keys) {
  const std::int64_t n = std::uniform_int_distribution<std::int64_t>(24, 48)(g);
  const std::int64_t rows = std::uniform_int_distribution<std::int64_t>(1, n)(g);
  const std::int64_t w = std::uniform_int_distribution<std::int64_t>(1, 8)(g);
  const inputs in = random_inputs(g, group, f16_keys, n, rows, w);
  session s(in);
  const auto mean = triattn::gqa_aggregation::mean;
  for (const policy p : all_policies) {
    const io::npy_array scores = s.check_score(p, mean);
    // The inputs a policy does not use change nothing.
    CHECK(same(s.check_score(p, mean, true), scores));
    for (const std::int64_t b : budgets(g, in)) s.check_select(p, b, mean);
    const std::int64_t b = std::uniform_int_distribution<std::int64_t>(2, n - 1)(g);
    CHECK(same(s.check_select(p, b, mean, true), s.check_select(p, b, mean)));
  }
  // Other GQA aggregations: H2O (and VATP, SnapKV; R-KV takes the max of the logits).
  for (const auto agg : {triattn::gqa_aggregation::max, triattn::gqa_aggregation::sum})
    for (const policy p : {policy::h2o, policy::vatp, policy::snapkv}) {
      s.check_score(p, agg);
      s.check_select(p, std::uniform_int_distribution<std::int64_t>(2, n - 1)(g), agg);
    }
  std::printf("group %d, N %lld, rows %lld, w %lld%s: %d slot(s) differ from the oracle at near-ties, %d R-KV row(s) "
              "skipped at the 0.5 threshold\n",
              group, static_cast<long long>(n), static_cast<long long>(rows), static_cast<long long>(w),
              f16_keys ? ", float16 keys" : "", s.differing_slots(), s.skipped_rows());
}

}  // namespace

TEST_CASE("baseline scores and keep sets match the oracles, GQA groups 1, 2 and 4", "[cli][baselines]") {
  auto g = triattn_test::rng(11);
  for (const int group : {1, 2, 4}) {
    INFO("group " << group);
    run_all(g, group, false);
  }
}

TEST_CASE("baseline scores and keep sets match the oracles with float16 keys", "[cli][baselines]") {
  auto g = triattn_test::rng(12);
  run_all(g, std::uniform_int_distribution<int>(0, 2)(g) == 0 ? 1 : 2, true);
}

TEST_CASE("a window as long as the keys: every slot is the window's", "[cli][baselines]") {
  auto g = triattn_test::rng(13);
  const std::int64_t n = 6;
  const inputs in = random_inputs(g, 2, false, n, 3, n);
  session s(in);
  for (const policy p : {policy::snapkv, policy::rkv}) {
    s.check_score(p, triattn::gqa_aggregation::mean);
    for (const std::int64_t b : {1, 4, 6, 9}) s.check_select(p, b, triattn::gqa_aggregation::mean);
  }
}

TEST_CASE("bad baseline inputs are refused with one line naming the file or option", "[cli][baselines][errors]") {
  auto g = triattn_test::rng(14);
  const std::int64_t n = 20, rows = 5, w = 4;
  const int group = 2, q_heads = kv_heads * group;
  const inputs in = random_inputs(g, group, false, n, rows, w);
  session s(in);
  const files& f = s.paths();

  const auto expect_refused = [&](const std::vector<std::string>& args, const std::vector<std::string>& needles) {
    const auto before = s.dir().listing();
    const auto r = run_cli(s.dir(), args);
    check_one_line_error(r, needles);
    INFO("command: " << r.command);
    CHECK(!fs::exists(f.out));
    CHECK(s.dir().listing() == before);
  };
  /// `args` with the value of `option` replaced.
  const auto with = [](std::vector<std::string> args, const std::string& option, const std::string& value) {
    const auto it = std::find(args.begin(), args.end(), option);
    REQUIRE(it != args.end());
    *(it + 1) = value;
    return args;
  };
  const auto without = [](std::vector<std::string> args, const std::string& option) {
    const auto it = std::find(args.begin(), args.end(), option);
    REQUIRE(it != args.end());
    args.erase(it, it + 2);
    return args;
  };
  const auto write_f32 = [&](const std::string& file, const std::vector<std::int64_t>& shape) {
    const std::string path = (s.dir() / file).string();
    std::int64_t count = 1;
    for (const auto d : shape) count *= d;
    const auto v = triattn_test::normal_floats(g, static_cast<std::size_t>(count));
    io::write_npy(path, io::element_kind::f32, shape, v.data());
    return path;
  };

  const std::string attn_n = write_f32("attn_n.npy", {layers, q_heads, rows, n + 1});
  const std::string attn_layers = write_f32("attn_layers.npy", {layers + 1, q_heads, rows, n});
  const std::string attn_heads = write_f32("attn_heads.npy", {layers, 3, rows, n});
  const std::string attn_rank = write_f32("attn_rank.npy", {layers, q_heads, rows * n});
  const std::string values_n = write_f32("values_n.npy", {layers, kv_heads, n - 1, head_dim});
  const std::string queries_dim = write_f32("queries_dim.npy", {layers, q_heads, w, head_dim + 2});
  const std::string queries_heads = write_f32("queries_heads.npy", {layers, 3, w, head_dim});
  const std::string queries_layers = write_f32("queries_layers.npy", {layers - 1, q_heads, w, head_dim});
  const std::string queries_long = write_f32("queries_long.npy", {layers, q_heads, n + 1, head_dim});
  // Zero-size axes (issue 15): 0 kv-heads reached a `% kv_heads` (SIGFPE), head_dim 0 sized a
  // position table by axes that no byte of the file bounds.
  const std::vector<std::string> keys_empty = {write_f32("keys_no_heads.npy", {layers, 0, n, head_dim}),
                                               write_f32("keys_no_dim.npy", {layers, kv_heads, n, 0}),
                                               write_f32("keys_no_layers.npy", {0, kv_heads, n, head_dim})};

  for (const char* verb : {"score", "select"}) {
    const bool select = std::string(verb) == "select";
    const std::vector<std::string> budget = {"--budget", "7"};
    for (const policy p : all_policies) {
      INFO(verb << " " << name(p));
      // The good command each bad one is one change away from.
      const auto good = s.command(verb, p, false, select ? budget : std::vector<std::string>{});
      s.run(good);
      if (select) {
        expect_refused(with(good, "--budget", "0"), {"--budget"});
        expect_refused(without(good, "--budget"), {"--budget"});
      }
      if (!windowed(p)) {
        expect_refused(with(good, "--attn", attn_n), {attn_n});
        expect_refused(with(good, "--attn", attn_layers), {attn_layers});
        expect_refused(with(good, "--attn", attn_heads), {attn_heads});
        expect_refused(with(good, "--attn", attn_rank), {attn_rank});
        expect_refused(without(good, "--attn"), {"--attn"});
      } else {
        expect_refused(with(good, "--queries", queries_dim), {queries_dim});
        expect_refused(with(good, "--queries", queries_heads), {queries_heads});
        expect_refused(with(good, "--queries", queries_layers), {queries_layers});
        expect_refused(with(good, "--queries", queries_long), {queries_long});
        expect_refused(without(good, "--queries"), {"--queries"});
      }
      if (p == policy::vatp) {
        expect_refused(without(good, "--values"), {"--values"});
        expect_refused(with(good, "--values", values_n), {values_n});
      }
      expect_refused(without(good, "--keys"), {"--keys"});
      for (const std::string& k : keys_empty) expect_refused(with(good, "--keys", k), {k});
    }
  }
  // Refused even when the inputs the policy does not use are fine.
  expect_refused(with(s.command("score", policy::vatp, true), "--attn", attn_n), {attn_n});
  expect_refused(with(s.command("score", policy::rkv, true), "--queries", queries_long), {queries_long});
}
