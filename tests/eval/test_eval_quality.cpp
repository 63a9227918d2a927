// triattn_eval (eval/triattn_eval.cpp) on the real model, run through the shell as users run it:
// - its full-cache NLL equals an independent double-precision forward pass written here from
//   the model README's formulas (models/stories260K/README.md), on the same windows and
//   positions, within 1e-4;
// - two runs (on 1 and on 2 threads) give byte-identical quality.csv files;
// - the `--quick` smoke run writes a finite row for every policy x budget, the policies being
//   those `triattn_eval --list-policies` names (the registry's, triattn::policy_registry, in its
//   order, after `full` and the references).
// The TriAttention stats come from triattn_runner::calibrate on 4 train windows (never the eval text).
#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "runner/calibration.hpp"
#include "runner/runner.hpp"
#include "support/data.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/registry.hpp"

namespace {

namespace fs = std::filesystem;

std::string quote(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// A scratch folder removed at the end of the scope.
struct scratch {
  fs::path path;
  scratch() {
    path = fs::temp_directory_path() /
           ("triattn_eval_test_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~scratch() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

fs::path model_path() { return triattn_test::data_dir() / "models/stories260K/stories260K.bin"; }
fs::path tokenizer_path() { return triattn_test::data_dir() / "models/stories260K/tok512.bin"; }
fs::path valid_text() { return triattn_test::data_dir() / "data/tinystories_valid_head.txt"; }

/// Stats from 4 train windows, written once per test run.
const fs::path& stats_file() {
  static const scratch dir;  // lives until the end of the test program
  static const fs::path path = [] {
    const auto m = triattn_runner::model::load(model_path());
    const auto tok = triattn_runner::tokenizer::load(tokenizer_path(), m.config().vocab_size);
    const auto stats = triattn_runner::calibrate(
        m, tok, triattn_runner::read_file(triattn_test::data_dir() / "data/tinystories_train_head.txt"), 4);
    const fs::path p = dir.path / "stats.safetensors";
    triattn::save_stats(p, stats);
    return p;
  }();
  return path;
}

/// Runs triattn_eval with `args` (after the data paths), writing to `out`; returns the exit code.
int run_eval(const scratch& dir, const fs::path& out, const std::string& args) {
  const std::string cmd = quote(TRIATTN_TEST_EVAL) + " --model " + quote(model_path().string()) + " --tokenizer " +
                          quote(tokenizer_path().string()) + " --text " + quote(valid_text().string()) + " --stats " +
                          quote(stats_file().string()) + " --out " + quote(out.string()) + " " + args + " 2> " +
                          quote((dir.path / "stderr.txt").string());
  INFO(cmd);
  const int status = std::system(cmd.c_str());
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  INFO(read_text(dir.path / "stderr.txt"));
  CHECK(code == 0);
  return code;
}

/// `triattn_eval --list-policies`: the names, one a line.
std::vector<std::string> listed_policies(const scratch& dir) {
  const fs::path out = dir.path / "policies.txt";
  const std::string cmd = quote(TRIATTN_TEST_EVAL) + " --list-policies > " + quote(out.string());
  const int status = std::system(cmd.c_str());
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  std::istringstream in(read_text(out));
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) names.push_back(line);
  return names;
}

/// quality.csv as rows of named fields.
std::vector<std::map<std::string, std::string>> read_csv(const fs::path& p) {
  std::istringstream in(read_text(p));
  std::string line;
  std::vector<std::string> header;
  std::vector<std::map<std::string, std::string>> rows;
  const auto fields = [](const std::string& l) {
    std::vector<std::string> f;
    std::stringstream ss(l);
    std::string x;
    while (std::getline(ss, x, ',')) f.push_back(x);
    return f;
  };
  std::getline(in, line);
  header = fields(line);
  while (std::getline(in, line)) {
    const auto f = fields(line);
    REQUIRE(f.size() == header.size());
    std::map<std::string, std::string> r;
    for (std::size_t i = 0; i < f.size(); ++i) r[header[i]] = f[i];
    rows.push_back(r);
  }
  return rows;
}

// ---- an independent forward pass, in double, from the model README ------------------------

struct naive_model {
  int dim = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, vocab = 0, seq_len = 0;
  std::vector<double> w;  // every float of the file after the header, in file order
  std::size_t emb = 0, rms_att = 0, wq = 0, wk = 0, wv = 0, wo = 0, rms_ffn = 0, w1 = 0, w2 = 0, w3 = 0, rms_final = 0;

  explicit naive_model(const fs::path& path) {
    const std::string bytes = read_text(path);
    std::int32_t h[7];
    std::memcpy(h, bytes.data(), sizeof h);
    dim = h[0], hidden = h[1], layers = h[2], heads = h[3], kv_heads = h[4], vocab = std::abs(h[5]), seq_len = h[6];
    REQUIRE(h[5] > 0);  // shared classifier (stories260K)
    std::vector<float> f((bytes.size() - sizeof h) / 4);
    std::memcpy(f.data(), bytes.data() + sizeof h, f.size() * 4);
    w.assign(f.begin(), f.end());
    const std::size_t d = static_cast<std::size_t>(dim), kv = static_cast<std::size_t>(dim / heads * kv_heads),
                      hd = static_cast<std::size_t>(hidden), L = static_cast<std::size_t>(layers);
    std::size_t at = 0;
    const auto take = [&](std::size_t n) { const std::size_t o = at; at += n; return o; };
    emb = take(static_cast<std::size_t>(vocab) * d);
    rms_att = take(L * d);
    wq = take(L * d * d);
    wk = take(L * kv * d);
    wv = take(L * kv * d);
    wo = take(L * d * d);
    rms_ffn = take(L * d);
    w1 = take(L * hd * d);
    w2 = take(L * d * hd);
    w3 = take(L * hd * d);
    rms_final = take(d);
  }

  // y = W x, W [rows][cols] at offset o
  void matvec(std::vector<double>& y, std::size_t o, const std::vector<double>& x, int rows, int cols) const {
    y.assign(static_cast<std::size_t>(rows), 0.0);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) y[static_cast<std::size_t>(i)] += w[o + static_cast<std::size_t>(i * cols + j)] * x[static_cast<std::size_t>(j)];
  }
  std::vector<double> rmsnorm(const std::vector<double>& x, std::size_t g) const {
    double ss = 0;
    for (const double v : x) ss += v * v;
    const double s = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + 1e-5);
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = w[g + i] * x[i] * s;
    return y;
  }

  /// Log-probabilities of every step of `tokens` from an empty cache: [T][vocab].
  std::vector<std::vector<double>> log_probs(const std::vector<int>& tokens) const {
    const int hs = dim / heads, kvd = hs * kv_heads, group = heads / kv_heads;
    const auto d = static_cast<std::size_t>(dim);
    std::vector<std::vector<std::vector<double>>> kc(static_cast<std::size_t>(layers)), vc(static_cast<std::size_t>(layers));
    std::vector<std::vector<double>> out;
    std::vector<double> q, k, v, o(d), t1, t2, t3;
    const auto rope = [&](std::vector<double>& x, int n_heads, int pos) {
      for (int h = 0; h < n_heads; ++h)
        for (int j = 0; j < hs / 2; ++j) {
          const double theta = pos * std::pow(10000.0, -2.0 * j / hs);
          double& a = x[static_cast<std::size_t>(h * hs + 2 * j)];
          double& b = x[static_cast<std::size_t>(h * hs + 2 * j + 1)];
          const double na = a * std::cos(theta) - b * std::sin(theta), nb = a * std::sin(theta) + b * std::cos(theta);
          a = na, b = nb;
        }
    };
    for (std::size_t pos = 0; pos < tokens.size(); ++pos) {
      std::vector<double> x(w.begin() + static_cast<std::ptrdiff_t>(emb + static_cast<std::size_t>(tokens[pos]) * d),
                            w.begin() + static_cast<std::ptrdiff_t>(emb + static_cast<std::size_t>(tokens[pos] + 1) * d));
      for (int l = 0; l < layers; ++l) {
        const auto L = static_cast<std::size_t>(l);
        const auto xb = rmsnorm(x, rms_att + L * d);
        matvec(q, wq + L * d * d, xb, dim, dim);
        matvec(k, wk + L * static_cast<std::size_t>(kvd) * d, xb, kvd, dim);
        matvec(v, wv + L * static_cast<std::size_t>(kvd) * d, xb, kvd, dim);
        rope(q, heads, static_cast<int>(pos));
        rope(k, kv_heads, static_cast<int>(pos));
        kc[L].push_back(k);
        vc[L].push_back(v);
        for (int h = 0; h < heads; ++h) {
          const int g = h / group;
          std::vector<double> s(pos + 1);
          double mx = -1e300;
          for (std::size_t t = 0; t <= pos; ++t) {
            double dot = 0;
            for (int e = 0; e < hs; ++e)
              dot += q[static_cast<std::size_t>(h * hs + e)] * kc[L][t][static_cast<std::size_t>(g * hs + e)];
            s[t] = dot / std::sqrt(static_cast<double>(hs));
            mx = std::max(mx, s[t]);
          }
          double z = 0;
          for (double& e : s) z += (e = std::exp(e - mx));
          for (int e = 0; e < hs; ++e) {
            double acc = 0;
            for (std::size_t t = 0; t <= pos; ++t) acc += s[t] / z * vc[L][t][static_cast<std::size_t>(g * hs + e)];
            o[static_cast<std::size_t>(h * hs + e)] = acc;
          }
        }
        matvec(t1, wo + L * d * d, o, dim, dim);
        for (std::size_t i = 0; i < d; ++i) x[i] += t1[i];
        const auto xf = rmsnorm(x, rms_ffn + L * d);
        const auto hd = static_cast<std::size_t>(hidden);
        matvec(t1, w1 + L * hd * d, xf, hidden, dim);
        matvec(t3, w3 + L * hd * d, xf, hidden, dim);
        for (std::size_t i = 0; i < hd; ++i) t1[i] = t1[i] / (1.0 + std::exp(-t1[i])) * t3[i];
        matvec(t2, w2 + L * d * hd, t1, dim, hidden);
        for (std::size_t i = 0; i < d; ++i) x[i] += t2[i];
      }
      const auto xn = rmsnorm(x, rms_final);
      std::vector<double> logits;
      matvec(logits, emb, xn, vocab, dim);
      double mx = -1e300, z = 0;
      for (const double e : logits) mx = std::max(mx, e);
      for (const double e : logits) z += std::exp(e - mx);
      for (double& e : logits) e -= mx + std::log(z);
      out.push_back(std::move(logits));
    }
    return out;
  }
};

}  // namespace

TEST_CASE("triattn_eval: full-cache NLL equals an independent double forward pass") {
  scratch dir;
  const fs::path out = dir.path / "nll";
  constexpr int windows = 2, D = 16;
  REQUIRE(run_eval(dir, out, "--policies full --budgets 32,128 --windows 2 --prompts 0 --divide-length 16") == 0);
  const auto rows = read_csv(out / "quality.csv");
  REQUIRE(rows.size() == 2);

  const auto m = triattn_runner::model::load(model_path());
  const auto tok = triattn_runner::tokenizer::load(tokenizer_path(), m.config().vocab_size);
  const auto ws = triattn_runner::text_windows(tok, triattn_runner::read_file(valid_text()), m.config().seq_len, windows);
  REQUIRE(ws.size() == static_cast<std::size_t>(windows));
  const naive_model naive(model_path());
  std::vector<std::vector<std::vector<double>>> lp;
  for (const auto& w : ws) lp.push_back(naive.log_probs(w));

  for (const auto& r : rows) {
    const long budget = std::stol(r.at("budget"));
    // Slack trigger: the first round runs after step B + D - 1 (the cache then holds B + D);
    // scored: the predictions of steps B + D .. T - 2 (each has a true next token).
    double nll = 0;
    long n = 0;
    for (std::size_t w = 0; w < ws.size(); ++w)
      for (std::size_t t = static_cast<std::size_t>(budget + D); t + 1 < ws[w].size(); ++t) {
        nll -= lp[w][t][static_cast<std::size_t>(ws[w][t + 1])];
        ++n;
      }
    nll /= static_cast<double>(n);
    INFO("budget " << budget << ": harness " << r.at("nll") << ", naive " << nll);
    CHECK(std::stol(r.at("positions")) == n);
    CHECK(std::stol(r.at("windows")) == windows);
    CHECK(std::abs(std::stod(r.at("nll")) - nll) < 1e-4);
    CHECK(std::stod(r.at("kl")) == 0.0);
    CHECK(std::stod(r.at("top1")) == 1.0);
  }
}

TEST_CASE("triattn_eval: two runs give byte-identical CSV files (1 and 2 threads)") {
  scratch dir;
  const std::string args = "--budgets 32,64 --windows 2 --prompts 2 --gen-tokens 64 --divide-length 16";
  REQUIRE(run_eval(dir, dir.path / "a", args + " --threads 2") == 0);
  REQUIRE(run_eval(dir, dir.path / "b", args + " --threads 1") == 0);
  const std::string a = read_text(dir.path / "a/quality.csv"), b = read_text(dir.path / "b/quality.csv");
  CHECK(!a.empty());
  CHECK(a == b);
}

TEST_CASE("triattn_eval --quick: a finite row for every policy x budget") {
  scratch dir;
  REQUIRE(run_eval(dir, dir.path / "q", "--quick") == 0);
  const auto rows = read_csv(dir.path / "q/quality.csv");
  const std::vector<std::string> policies = listed_policies(dir);
  // The program's list: `full`, the references, then the registry's policies in its order, then variants.
  std::vector<std::string> expected_start{std::string(triattn::full_name), "random", "window"};
  for (const triattn::policy_entry& e : triattn::policy_registry)
    if (e.compresses()) expected_start.emplace_back(e.name);
  REQUIRE(policies.size() > expected_start.size());
  CHECK(std::vector<std::string>(policies.begin(), policies.begin() + static_cast<std::ptrdiff_t>(expected_start.size())) ==
        expected_start);
  CHECK(std::find(policies.begin(), policies.end(), "triattention_seed") != policies.end());
  const std::vector<std::string> contract{"policy", "budget", "nll", "ppl", "kl", "top1", "kv_bytes", "gen_prefix"};
  const std::string header = read_text(dir.path / "q/quality.csv");
  CHECK(header.starts_with("policy,budget,nll,ppl,kl,top1,kv_bytes,gen_prefix"));
  std::set<std::pair<std::string, long>> seen;
  for (const auto& r : rows) {
    INFO(r.at("policy") << " B=" << r.at("budget"));
    seen.insert({r.at("policy"), std::stol(r.at("budget"))});
    for (const auto& c : contract)
      if (c != "policy") CHECK(std::isfinite(std::stod(r.at(c))));
    const double kl = std::stod(r.at("kl")), top1 = std::stod(r.at("top1"));
    CHECK(kl >= 0.0);
    CHECK((top1 >= 0.0 && top1 <= 1.0));
    if (r.at("policy") != "full") {
      CHECK(kl > 0.0);
      // f32 cache: (budget + D) tokens x 5 layers x 4 kv heads x 8 dims x 4 bytes x 2 (K and V).
      CHECK(std::stol(r.at("kv_bytes")) == (std::stol(r.at("budget")) + 16) * 5 * 4 * 8 * 4 * 2);
    }
  }
  for (const auto& p : policies)
    for (const long b : {32L, 64L}) {
      INFO(p << " B=" << b);
      CHECK(seen.contains({p, b}));
    }
  CHECK(rows.size() == policies.size() * 2);
  CHECK(fs::exists(dir.path / "q/quality.md"));
}

TEST_CASE("triattn_eval: selection suffixes (+seg<S>, +split_layer, +split_seq, +floor<F>, +value) on any row") {
  scratch dir;
  const std::string rows =
      "snapkv,snapkv+seg1,snapkv+seg4,knorm+split_layer,triattention+split_seq+floor0.5,triattention,triattention+value";
  REQUIRE(run_eval(dir, dir.path / "s", "--policies full," + rows + " --budgets 32 --windows 2 --prompts 0 --divide-length 16") == 0);
  std::map<std::string, double> kl;
  for (const auto& r : read_csv(dir.path / "s/quality.csv")) kl[r.at("policy")] = std::stod(r.at("kl"));
  for (const std::string p : {"snapkv", "snapkv+seg1", "snapkv+seg4", "knorm+split_layer",
                              "triattention+split_seq+floor0.5", "triattention+value"}) {
    INFO(p);
    REQUIRE(kl.contains(p));
    CHECK((std::isfinite(kl[p]) && kl[p] > 0.0));
  }
  CHECK(kl["snapkv+seg1"] == kl["snapkv"]);  // one run is the plain top-k
  CHECK(kl["triattention+value"] != kl["triattention"]);  // the model's output projection moved keep sets
  // A bad suffix is a usage error naming it (exit 2), before any work.
  const std::string cmd = quote(TRIATTN_TEST_EVAL) + " --model " + quote(model_path().string()) + " --tokenizer " +
                          quote(tokenizer_path().string()) + " --text " + quote(valid_text().string()) + " --out " +
                          quote((dir.path / "bad").string()) + " --policies snapkv+segs 2> " +
                          quote((dir.path / "bad.txt").string());
  const int status = std::system(cmd.c_str());
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 2));
  CHECK_THAT(read_text(dir.path / "bad.txt"), Catch::Contains("+seg") && Catch::Contains("segs"));
}
