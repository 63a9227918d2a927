// `triattn score triattention` and `triattn select triattention` with the reference
// implementation's real statistics (Qwen3-8B and DeepSeek-R1-Distill-Llama-8B, every layer,
// converted by tools/convert_reference_stats.py) on fresh random post-RoPE keys, against the
// double-precision oracle of tests/support/triattention_reference.hpp (the per-offset formula
// on un-rotated keys, and the paper-path selection), with the RoPE frequencies computed from
// the models' configs (not read from the converted file).
//
// - scores: every (layer, q-head) row within 1e-4 of the row's largest |oracle score|;
// - keep sets: equal to the oracle's, except at ties: the CLI's set may differ only where the
//   oracle's aggregated scores at the cut are within 1e-6 of each other (every kept candidate
//   scores at least every dropped one minus 1e-6). Some keys are exact duplicates across all
//   layers (exact ties for the CLI, near-ties for the oracle), and the budget is chosen so that
//   the cut splits such a pair where one exists: the CLI must keep the lower slot;
// - the same with `--window 8 --protect-first 4`: those slots kept, the rest chosen by the
//   scores z-normalised over the remaining candidates.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "support/data.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "support/triattention_reference.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/npy.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;
namespace ref = triattn_test::ref;
using triattn_test::cli::run_cli;
using triattn_test::cli::scratch_dir;

constexpr int kv_heads = 8, head_dim = 128;
constexpr double tie_tolerance = 1e-6;

struct model_case {
  const char* file;
  const char* flags;
  triattn::rope_desc rope;
};

/// keys[((l * Hkv + h) * N + j) * D + d]
struct key_set {
  int layers = 0;
  std::int64_t n = 0;
  std::vector<float> keys;
  std::vector<std::vector<std::pair<std::int32_t, std::int32_t>>> twins;  ///< [h]: (lower, higher) duplicate slots

  const float* key(int l, int h, std::int64_t j) const {
    return keys.data() + ((static_cast<std::size_t>(l) * kv_heads + static_cast<std::size_t>(h)) * n + j) * head_dim;
  }
  float* key(int l, int h, std::int64_t j) { return const_cast<float*>(std::as_const(*this).key(l, h, j)); }
};

/// Keys around a random centre per (layer, kv-head), as after RoPE at scattered positions;
/// about one slot in eight of every kv-head is a copy of another slot of it, in every layer.
key_set random_keys(std::mt19937_64& g, int layers, std::int64_t n) {
  key_set k;
  k.layers = layers;
  k.n = n;
  k.keys.resize(static_cast<std::size_t>(layers) * kv_heads * n * head_dim);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int l = 0; l < layers; ++l)
    for (int h = 0; h < kv_heads; ++h) {
      std::vector<float> centre(head_dim);
      for (auto& c : centre) c = 1.5f * normal(g);
      for (std::int64_t j = 0; j < n; ++j)
        for (int d = 0; d < head_dim; ++d) k.key(l, h, j)[d] = centre[static_cast<std::size_t>(d)] + normal(g);
    }
  k.twins.resize(kv_heads);
  std::uniform_int_distribution<std::int64_t> slot(0, n - 1);
  for (int h = 0; h < kv_heads; ++h) {
    std::vector<bool> used(static_cast<std::size_t>(n));
    for (std::int64_t t = 0; t < n / 8; ++t) {
      const std::int64_t a = slot(g), b = slot(g);
      if (a == b || used[a] || used[b]) continue;
      used[a] = used[b] = true;
      const auto lo = static_cast<std::int32_t>(std::min(a, b)), hi = static_cast<std::int32_t>(std::max(a, b));
      for (int l = 0; l < layers; ++l) std::copy_n(k.key(l, h, a), head_dim, k.key(l, h, b));
      k.twins[h].emplace_back(lo, hi);
    }
  }
  return k;
}

/// The oracle's raw scores [layers][q_heads][n]; slot j holds position j (what the CLI assumes
/// without --positions). Layers are spread over a few threads: the oracle is slow.
ref::tri_scores oracle_scores(const triattn::query_stats& st, const key_set& k, std::int64_t round_start,
                              const ref::tri_score_options& o) {
  ref::tri_scores raw(static_cast<std::size_t>(st.num_layers));
  const int group = st.num_q_heads / st.num_kv_heads;
  const auto layer = [&](int l) {
    raw[l].assign(static_cast<std::size_t>(st.num_q_heads), std::vector<double>(static_cast<std::size_t>(k.n)));
    std::vector<double> key(head_dim);
    for (int qh = 0; qh < st.num_q_heads; ++qh)
      for (std::int64_t j = 0; j < k.n; ++j) {
        std::copy_n(k.key(l, qh / group, j), head_dim, key.begin());
        raw[l][qh][j] = ref::tri_key_score(st, l, qh, key, static_cast<double>(j), round_start, o);
      }
  };
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 4u);
  std::vector<std::future<void>> jobs;
  for (unsigned t = 0; t < threads; ++t)
    jobs.push_back(std::async(std::launch::async, [&, t] {
      for (int l = static_cast<int>(t); l < st.num_layers; l += static_cast<int>(threads)) layer(l);
    }));
  for (auto& j : jobs) j.get();
  return raw;
}

struct selection_oracle {
  std::vector<double> agg;  ///< mean over layers of the group max of the z-scored rows
  std::vector<bool> prot, cand;
  ref::tri_keep keep;
};

/// The oracle's decision for kv-head h, and the aggregated scores it is made from (the steps
/// of ref::tri_select_per_kv_head, which returns only the decision).
selection_oracle oracle_select(const ref::tri_scores& raw, int h, int group, std::int64_t n, std::int64_t budget,
                               const ref::tri_select_options& o) {
  std::vector<std::int32_t> positions(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) positions[j] = static_cast<std::int32_t>(j);
  selection_oracle s;
  s.prot = ref::tri_protected(positions, o);
  s.cand.resize(s.prot.size());
  for (std::size_t j = 0; j < s.prot.size(); ++j) s.cand[j] = !s.prot[j];
  s.agg.assign(static_cast<std::size_t>(n), 0.0);
  const auto layers = static_cast<int>(raw.size());
  for (int l = 0; l < layers; ++l) {
    const auto r = ref::tri_group_score(raw, l, h, group, s.cand, o);
    for (std::size_t j = 0; j < r.size(); ++j) s.agg[j] += r[j] / layers;
  }
  s.keep = ref::tri_select_per_kv_head(raw, h, group, positions, budget, o);
  return s;
}

/// A budget whose cut splits a duplicate pair of kv-head `h` (candidates only), when one
/// exists; else `fallback`.
std::int64_t budget_splitting_twins(const selection_oracle& s, const key_set& k, int h, std::int64_t fallback) {
  std::vector<std::int32_t> order;
  for (std::size_t j = 0; j < s.cand.size(); ++j)
    if (s.cand[j]) order.push_back(static_cast<std::int32_t>(j));
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return s.agg[a] > s.agg[b]; });
  std::int64_t protected_count = 0;
  for (const bool p : s.prot) protected_count += p ? 1 : 0;
  for (const auto& [lo, hi] : k.twins[h]) {
    if (!s.cand[lo] || !s.cand[hi]) continue;
    const auto at = [&](std::int32_t x) { return std::find(order.begin(), order.end(), x) - order.begin(); };
    const auto first = std::min(at(lo), at(hi));
    if (std::abs(at(lo) - at(hi)) != 1 || first + 1 >= static_cast<std::ptrdiff_t>(order.size())) continue;
    return protected_count + first + 1;  // keeps the first of the two
  }
  return fallback;
}

/// The CLI's keep row for kv-head h against the oracle. Returns how many slots differ.
int check_keep(const std::vector<std::int64_t>& got, const selection_oracle& s, const key_set& k, int h,
               std::int64_t budget) {
  const std::int64_t n = k.n;
  INFO("kv-head " << h << ", budget " << budget);
  REQUIRE(static_cast<std::int64_t>(got.size()) == std::min(budget, n));
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(got[i] >= 0);
    REQUIRE(got[i] < n);
    if (i > 0) REQUIRE(got[i] > got[i - 1]);  // ascending, no repeats
  }
  std::vector<bool> kept(static_cast<std::size_t>(n));
  for (const auto j : got) kept[j] = true;
  // Protected slots are kept (the budget always covers them here).
  for (std::int64_t j = 0; j < n; ++j)
    if (s.prot[j]) CHECK(kept[j]);
  // No dropped candidate beats a kept one by more than the tie tolerance.
  double worst_kept = std::numeric_limits<double>::infinity(), best_dropped = -worst_kept;
  for (std::int64_t j = 0; j < n; ++j) {
    if (!s.cand[j]) continue;
    if (kept[j]) {
      worst_kept = std::min(worst_kept, s.agg[j]);
    } else {
      best_dropped = std::max(best_dropped, s.agg[j]);
    }
  }
  CHECK(best_dropped - worst_kept <= tie_tolerance);
  // So a difference from the oracle's set can only sit at a (near-)tie at its cut.
  std::vector<bool> oracle_kept(static_cast<std::size_t>(n));
  for (const auto j : s.keep.keep) oracle_kept[j] = true;
  double oracle_cut = std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j < n; ++j)
    if (s.cand[j] && oracle_kept[j]) oracle_cut = std::min(oracle_cut, s.agg[j]);
  int differ = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    if (kept[j] == oracle_kept[j]) continue;
    ++differ;
    INFO("slot " << j << ": CLI " << (kept[j] ? "keeps" : "drops") << " it; oracle score " << s.agg[j]
                 << ", oracle cut " << oracle_cut << ", oracle margin " << s.keep.margin);
    CHECK(s.cand[j]);
    CHECK(std::abs(s.agg[j] - oracle_cut) <= tie_tolerance);
  }
  // Exact duplicates tie exactly for the CLI: a split pair keeps its lower slot.
  for (const auto& [lo, hi] : k.twins[h]) {
    if (!s.cand[lo] || !s.cand[hi] || kept[lo] == kept[hi]) continue;
    INFO("duplicate slots " << lo << " and " << hi << " split by the cut");
    CHECK(kept[lo]);
  }
  return differ;
}

std::vector<std::int64_t> keep_row(const std::vector<std::int64_t>& all, int h, std::int64_t k) {
  return std::vector<std::int64_t>(all.begin() + h * k, all.begin() + (h + 1) * k);
}

void run_model(const model_case& m) {
  auto g = triattn_test::rng(std::hash<std::string>{}(m.file));
  const scratch_dir dir("cli_reference_stats");
  const std::string stats = (dir / "stats.safetensors").string();
  triattn_test::cli::convert(triattn_test::data_dir() / "reference-stats" / m.file, m.flags, stats);
  const triattn::query_stats st = triattn::load_stats(stats);
  REQUIRE(st.num_kv_heads == kv_heads);
  REQUIRE(st.head_dim == head_dim);
  const int layers = st.num_layers, q_heads = st.num_q_heads, group = q_heads / kv_heads;

  const std::int64_t n = std::uniform_int_distribution<std::int64_t>(60, 68)(g);
  const std::int64_t round_start = std::uniform_int_distribution<std::int64_t>(n, 300000)(g);
  const key_set k = random_keys(g, layers, n);
  const std::string keys = (dir / "keys.npy").string();
  const std::int64_t shape[] = {layers, kv_heads, n, head_dim};
  io::write_npy(keys, io::element_kind::f32, shape, k.keys.data());
  INFO(m.file << ": " << layers << " layers, N = " << n << ", round start " << round_start);

  ref::tri_score_options so;
  so.omega = ref::inv_freq(m.rope, head_dim);
  so.a = m.rope.attention_scale;
  so.style = triattn::rope_style::half;
  const ref::tri_scores raw = oracle_scores(st, k, round_start, so);

  const std::vector<std::string> common = {
      "triattention", "--stats", stats, "--keys", keys, "--round-start", std::to_string(round_start)};
  const auto cli = [&](const std::string& command, std::vector<std::string> extra, const std::string& out) {
    std::vector<std::string> args = {command};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), {"--out", out});
    const auto r = run_cli(dir, args);
    INFO("command: " << r.command << "\nstderr: " << r.err);
    REQUIRE(r.code == 0);
    return io::read_npy(out);
  };

  {  // scores
    const io::npy_array a = cli("score", {}, (dir / "scores.npy").string());
    REQUIRE(a.kind == io::element_kind::f32);
    REQUIRE(a.shape == std::vector<std::int64_t>{layers, q_heads, n});
    const std::vector<float> s = a.to_float();
    double worst = 0.0;
    for (int l = 0; l < layers; ++l)
      for (int qh = 0; qh < q_heads; ++qh) {
        double scale = 0.0, err = 0.0;
        for (std::int64_t j = 0; j < n; ++j) scale = std::max(scale, std::abs(raw[l][qh][j]));
        for (std::int64_t j = 0; j < n; ++j) {
          const double got = s[(static_cast<std::size_t>(l) * q_heads + static_cast<std::size_t>(qh)) * n + j];
          err = std::max(err, std::abs(got - raw[l][qh][j]));
        }
        INFO("layer " << l << " q-head " << qh << ": max error " << err << ", row scale " << scale);
        CHECK(err <= 1e-4 * scale);
        worst = std::max(worst, err / scale);
      }
    std::printf("%s: N %lld, round start %lld: worst score error %.3g of the row's largest |score|\n", m.file,
                static_cast<long long>(n), static_cast<long long>(round_start), worst);
  }

  // Plain selection (every slot a candidate), then with a window and a protected prefix.
  for (const bool protect : {false, true}) {
    ref::tri_select_options so_sel;
    if (protect) {
      so_sel.window = 8;
      so_sel.prompt_length = 4;
    }
    const int h0 = std::uniform_int_distribution<int>(0, kv_heads - 1)(g);
    const std::int64_t fallback = std::uniform_int_distribution<std::int64_t>(protect ? 13 : 2, n - 2)(g);
    const std::int64_t budget =
        budget_splitting_twins(oracle_select(raw, h0, group, n, fallback, so_sel), k, h0, fallback);
    std::vector<std::string> extra = {"--budget", std::to_string(budget)};
    if (protect) extra.insert(extra.end(), {"--window", "8", "--protect-first", "4"});
    const std::string out = (dir / (protect ? "keep_protected.npy" : "keep.npy")).string();
    const io::npy_array a = cli("select", extra, out);
    REQUIRE(a.kind == io::element_kind::i64);
    REQUIRE(a.shape == std::vector<std::int64_t>{kv_heads, std::min(budget, n)});
    const std::vector<std::int64_t> all = a.to_int64();
    int differ = 0;
    for (int h = 0; h < kv_heads; ++h)
      differ += check_keep(keep_row(all, h, std::min(budget, n)), oracle_select(raw, h, group, n, budget, so_sel), k, h,
                           budget);
    std::printf("%s: select%s --budget %lld: %d slot(s) differ from the oracle, all at ties\n", m.file,
                protect ? " --window 8 --protect-first 4" : "", static_cast<long long>(budget), differ);
  }
}

}  // namespace

TEST_CASE("Qwen3-8B reference stats, every layer: CLI scores and keep sets match the oracle",
          "[cli][reference_stats]") {
  triattn::rope_desc rope;
  rope.theta = 1e6;
  run_model({"qwen3_8b.pt", "--num-kv-heads 8 --rope-theta 1000000", rope});
}

TEST_CASE("DeepSeek-R1-Distill-Llama-8B reference stats, every layer: CLI scores and keep sets match the oracle",
          "[cli][reference_stats]") {
  triattn::rope_desc rope;
  rope.theta = 500000.0;
  rope.scaling = {triattn::rope_scaling_type::llama3, 8.0, 1.0, 4.0, 8192.0};
  run_model({"ds_llama8b.pt",
             "--num-kv-heads 8 --rope-theta 500000 --rope-scaling llama3 --rope-factor 8 --low-freq-factor 1 "
             "--high-freq-factor 4 --original-max-position 8192",
             rope});
}
