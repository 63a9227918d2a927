// `triattn` refuses bad input as shared/spec/cli.md says: exit status 2, exactly one line on
// stderr naming the file or option at fault, nothing on stdout, and no file written (the
// scratch folder holds the same entries before and after). Every bad command is one change
// away from a good one, which is run first and must succeed, so a refusal cannot come from
// some other mistake in the command. `--help` exits 0.
#include <catch2/catch.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "support/npy_bytes.hpp"
#include "support/random.hpp"
#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/npy.hpp"

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;
using triattn_test::cli::check_one_line_error;
using triattn_test::cli::run_cli;
using triattn_test::cli::scratch_dir;

constexpr int layers = 2, q_heads = 4, kv_heads = 2, head_dim = 8, tokens = 16;

triattn::query_stats small_stats() {
  auto g = triattn_test::rng(1);
  triattn::query_stats s;
  s.num_layers = layers;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.style = triattn::rope_style::half;
  for (int f = 0; f < head_dim / 2; ++f) s.inv_freq.push_back(std::pow(10000.0, -2.0 * f / head_dim));
  const std::size_t n = s.row(layers, 0);
  s.q_mean_real = triattn_test::normal_floats(g, n);
  s.q_mean_imag = triattn_test::normal_floats(g, n);
  for (std::size_t i = 0; i < n; ++i)
    s.q_abs_mean.push_back(2.0f * std::hypot(s.q_mean_real[i], s.q_mean_imag[i]) + 0.1f);
  return s;
}

/// A .npy of `kind` and `shape` with random values (small integers for integer kinds).
void write_array(const fs::path& p, io::element_kind kind, const std::vector<std::int64_t>& shape) {
  auto g = triattn_test::rng(2);
  std::int64_t n = 1;
  for (const auto d : shape) n *= d;
  const std::vector<float> v = triattn_test::normal_floats(g, static_cast<std::size_t>(n));
  std::vector<std::byte> data(static_cast<std::size_t>(n) * io::element_bytes(kind));
  for (std::size_t i = 0; i < v.size(); ++i) {
    switch (kind) {
      case io::element_kind::f32:
        std::memcpy(data.data() + 4 * i, &v[i], 4);
        break;
      case io::element_kind::f64: {
        const double d = v[i];
        std::memcpy(data.data() + 8 * i, &d, 8);
        break;
      }
      case io::element_kind::i32: {
        const auto x = static_cast<std::int32_t>(i % 7);
        std::memcpy(data.data() + 4 * i, &x, 4);
        break;
      }
      case io::element_kind::i64: {
        const auto x = static_cast<std::int64_t>(i % 7);
        std::memcpy(data.data() + 8 * i, &x, 8);
        break;
      }
      default:
        FAIL("unsupported kind in the test");
    }
  }
  io::write_npy(p, kind, shape, data.data());
}

struct fixture {
  scratch_dir dir{"cli_errors"};
  std::string stats = (dir / "stats.safetensors").string();
  std::string keys = (dir / "keys.npy").string();
  std::string out = (dir / "out.npy").string();

  fixture() {
    triattn::save_stats(stats, small_stats());
    write_array(keys, io::element_kind::f32, {layers, kv_heads, tokens, head_dim});
  }

  std::vector<std::string> score_args(const std::string& keys_file) const {
    return {"score", "triattention", "--stats", stats, "--keys", keys_file, "--round-start", "40", "--out", out};
  }
  std::vector<std::string> select_args(const std::string& keys_file, const std::string& budget = "5") const {
    auto a = score_args(keys_file);
    a[0] = "select";
    a.insert(a.end(), {"--budget", budget});
    return a;
  }

  /// `args` must fail with one line holding `needles`, and leave the folder as it was.
  void expect_refused(const std::vector<std::string>& args, const std::vector<std::string>& needles) const {
    const auto before = dir.listing();
    const auto r = run_cli(dir, args);
    check_one_line_error(r, needles);
    INFO("command: " << r.command);
    CHECK(!fs::exists(out));
    CHECK(dir.listing() == before);
  }
};

/// Removes the output of a good run, so the next bad one starts from a folder without it.
void good_run(const fixture& f, const std::vector<std::string>& args, const std::vector<std::int64_t>& shape) {
  const auto r = run_cli(f.dir, args);
  INFO("command: " << r.command << "\nstderr: " << r.err);
  REQUIRE(r.code == 0);
  REQUIRE(r.err.empty());
  const io::npy_array a = io::read_npy(f.out);
  CHECK(a.shape == shape);
  fs::remove(f.out);
}

}  // namespace

TEST_CASE("the good commands that the bad ones derive from succeed", "[cli][errors]") {
  const fixture f;
  good_run(f, f.score_args(f.keys), {layers, q_heads, tokens});
  good_run(f, f.select_args(f.keys), {kv_heads, 5});
  // float64 keys are accepted too
  const std::string keys64 = (f.dir / "keys64.npy").string();
  write_array(keys64, io::element_kind::f64, {layers, kv_heads, tokens, head_dim});
  good_run(f, f.score_args(keys64), {layers, q_heads, tokens});
}

TEST_CASE("keys of the wrong dtype, rank or geometry name the keys file", "[cli][errors]") {
  const fixture f;
  const auto check_keys = [&](const std::string& name, io::element_kind kind, const std::vector<std::int64_t>& shape) {
    const std::string k = (f.dir / name).string();
    write_array(k, kind, shape);
    INFO(name);
    f.expect_refused(f.score_args(k), {k});
    f.expect_refused(f.select_args(k), {k});
  };
  check_keys("keys_int32.npy", io::element_kind::i32, {layers, kv_heads, tokens, head_dim});
  check_keys("keys_int64.npy", io::element_kind::i64, {layers, kv_heads, tokens, head_dim});
  check_keys("keys_rank3.npy", io::element_kind::f32, {layers, kv_heads, tokens * head_dim});
  check_keys("keys_rank5.npy", io::element_kind::f32, {1, layers, kv_heads, tokens, head_dim});
  // Zero-size axes (issue 15): nothing may be sized by the other axes before they are checked.
  check_keys("keys_no_layers.npy", io::element_kind::f32, {0, kv_heads, tokens, head_dim});
  check_keys("keys_no_heads.npy", io::element_kind::f32, {layers, 0, tokens, head_dim});
  check_keys("keys_no_dim.npy", io::element_kind::f32, {layers, kv_heads, tokens, 0});
  check_keys("keys_no_dim_huge.npy", io::element_kind::f32, {1000000, 1000000, 1000000, 0});
  // The geometry must match the stats file, which the message names too.
  const auto check_mismatch = [&](const std::string& name, const std::vector<std::int64_t>& shape) {
    const std::string k = (f.dir / name).string();
    write_array(k, io::element_kind::f32, shape);
    INFO(name);
    f.expect_refused(f.score_args(k), {k, f.stats});
    f.expect_refused(f.select_args(k), {k, f.stats});
  };
  check_mismatch("keys_layers.npy", {layers + 1, kv_heads, tokens, head_dim});
  check_mismatch("keys_heads.npy", {layers, kv_heads * 2, tokens, head_dim});
  check_mismatch("keys_head_dim.npy", {layers, kv_heads, tokens, head_dim + 2});
}

TEST_CASE("shapes past what memory can address name the file, before anything is allocated", "[cli][errors]") {
  // Issue 15, item 12: a header may declare more elements than a std::vector can hold
  // (max_size() is 2^61 floats) or more bytes than an int64 counts, over a file of a few
  // bytes. Each is refused from the header and the file's size, with the file named.
  const fixture f;
  const auto header_only = [&](const std::string& name, const std::string& descr, const std::string& shape) {
    std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + shape + "), }";
    dict.append(63 - (10 + dict.size()) % 64, ' ');
    dict.push_back('\n');
    const std::string k = (f.dir / name).string();
    const std::vector<std::byte> data(64, std::byte{1});  // a few bytes of data
    triattn_test::write_bytes(k, triattn_test::npy_file(1, dict, data));
    return k;
  };
  const std::string beyond = std::to_string(std::numeric_limits<std::int64_t>::max() / 8 + 1);  // 2^60
  for (const auto& [name, descr, shape, problem] : std::vector<std::array<std::string, 4>>{
           {"max_size_f32.npy", "<f4", "2, 2, 576460752303423488, 8, ", "overflows"},  // 2^63 floats' bytes
           {"max_size_f16.npy", "<f2", "1, 1, 288230376151711744, 9, ", "truncated"},  // 9 x 2^58 > max_size()
           {"int64_product.npy", "<f4", beyond + ", " + beyond + ", 16, 16, ", "overflows"},  // the product wraps
       }) {
    const std::string k = header_only(name, descr, shape);
    INFO(name);
    f.expect_refused(f.score_args(k), {k, problem});
    f.expect_refused(f.select_args(k), {k, problem});
  }
}

TEST_CASE("missing and malformed input files are named", "[cli][errors]") {
  const fixture f;
  const std::string missing = (f.dir / "no_such_keys.npy").string();
  f.expect_refused(f.score_args(missing), {missing});
  auto a = f.score_args(f.keys);
  a[3] = (f.dir / "no_such_stats.safetensors").string();
  f.expect_refused(a, {a[3]});
  a[3] = f.keys;  // a .npy is not a stats file
  f.expect_refused(a, {f.keys});
  // Keys as the stats, the stats as keys.
  f.expect_refused(f.score_args(f.stats), {f.stats});
}

TEST_CASE("bad options are named", "[cli][errors]") {
  const fixture f;
  f.expect_refused(f.select_args(f.keys, "0"), {"--budget"});
  f.expect_refused(f.select_args(f.keys, "-3"), {"--budget"});
  f.expect_refused(f.select_args(f.keys, "12x"), {"--budget"});
  auto no_budget = f.score_args(f.keys);
  no_budget[0] = "select";
  f.expect_refused(no_budget, {"--budget"});

  for (const bool select : {false, true}) {
    auto a = select ? f.select_args(f.keys) : f.score_args(f.keys);
    INFO((select ? "select" : "score"));
    auto no_out = a;
    const auto it = std::find(no_out.begin(), no_out.end(), "--out");
    no_out.erase(it, it + 2);
    f.expect_refused(no_out, {"--out"});

    auto unknown = a;
    unknown.push_back("--bogus-option");
    f.expect_refused(unknown, {"--bogus-option"});
    unknown.back() = "--bogus-option=3";
    f.expect_refused(unknown, {"--bogus-option"});

    auto pre_rope = a;
    pre_rope.push_back("--pre-rope");
    f.expect_refused(pre_rope, {"--positions"});

    auto no_round = a;
    const auto r = std::find(no_round.begin(), no_round.end(), "--round-start");
    no_round.erase(r, r + 2);
    f.expect_refused(no_round, {"--round-start"});

    auto policy = a;
    policy[1] = "no_such_policy";
    f.expect_refused(policy, {"no_such_policy"});

    auto dangling = a;
    dangling.push_back("--window");  // a value option without its value
    f.expect_refused(dangling, {"--window"});
  }
  f.expect_refused({"frobnicate", "--out", f.out}, {"frobnicate"});
  f.expect_refused({"score"}, {"score"});
  f.expect_refused({"inspect"}, {"inspect"});

  // Issue 15: integers past their range are refused, not narrowed; a round start past 2^31
  // overflowed round start + offset.
  auto far = f.score_args(f.keys);
  const auto r = std::find(far.begin(), far.end(), "--round-start");
  *(r + 1) = "9223372036854775807";
  f.expect_refused(far, {"--round-start", "must be <= 2147483648"});
  *(r + 1) = "2147483648";
  good_run(f, far, {layers, q_heads, tokens});
}

TEST_CASE("a bad value inside an array names the file and the problem", "[cli][errors]") {
  // Issue 15: 1.3% of rejections did not name the file (NaN/Inf in keys, queries or values,
  // probabilities out of range, an integer array where floats are expected and the reverse),
  // and more attention rows than tokens was reported as "h2o::observe: position -4".
  const fixture f;
  auto g = triattn_test::rng(3);
  const auto path = [&](const std::string& name) { return (f.dir / name).string(); };
  // Probabilities in (0, 1) for `--attn`, random floats otherwise, one element set to `bad`.
  const auto write_f32 = [&](const std::string& p, const std::vector<std::int64_t>& shape, bool probabilities,
                             std::optional<float> bad = std::nullopt) {
    std::int64_t n = 1;
    for (const auto d : shape) n *= d;
    std::vector<float> v = triattn_test::normal_floats(g, static_cast<std::size_t>(n));
    if (probabilities)
      for (float& x : v) x = 0.5f / (1.0f + std::exp(-x));
    if (bad) v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(g)] = *bad;
    io::write_npy(p, io::element_kind::f32, shape, v.data());
  };
  const std::string values = path("values.npy"), attn = path("attn.npy"), queries = path("queries.npy");
  write_f32(values, {layers, kv_heads, tokens, head_dim}, false);
  write_f32(attn, {layers, q_heads, 3, tokens}, true);
  write_f32(queries, {layers, q_heads, 4, head_dim}, false);
  const auto h2o = [&](const std::string& a) {
    return std::vector<std::string>{"score", "h2o", "--keys", f.keys, "--attn", a, "--out", f.out};
  };
  const auto vatp = [&](const std::string& v) {
    return std::vector<std::string>{"score", "vatp", "--keys", f.keys, "--values", v, "--attn", attn, "--out", f.out};
  };
  const auto snapkv = [&](const std::string& k, const std::string& q) {
    return std::vector<std::string>{"score", "snapkv", "--keys", k, "--queries", q, "--out", f.out};
  };
  good_run(f, h2o(attn), {layers, kv_heads, tokens});
  good_run(f, vatp(values), {layers, kv_heads, tokens});
  good_run(f, snapkv(f.keys, queries), {layers, kv_heads, tokens});

  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    INFO("bad value " << bad);
    const std::string k = path("keys_bad.npy"), v = path("values_bad.npy"), a = path("attn_bad.npy"),
                      q = path("queries_bad.npy");
    write_f32(k, {layers, kv_heads, tokens, head_dim}, false, bad);
    write_f32(v, {layers, kv_heads, tokens, head_dim}, false, bad);
    write_f32(a, {layers, q_heads, 3, tokens}, true, bad);
    write_f32(q, {layers, q_heads, 4, head_dim}, false, bad);
    f.expect_refused(f.score_args(k), {k});
    f.expect_refused(f.select_args(k), {k});
    f.expect_refused(snapkv(k, queries), {k});
    f.expect_refused(snapkv(f.keys, q), {q, "queries"});
    f.expect_refused(vatp(v), {v, "values"});
    f.expect_refused(h2o(a), {a, "attention"});
  }
  for (const float bad : {1.5f, -0.25f}) {
    const std::string a = path("attn_range.npy");
    write_f32(a, {layers, q_heads, 3, tokens}, true, bad);
    f.expect_refused(h2o(a), {a, "[0, 1]"});
  }
  // More attention rows than tokens: row r is the query at position N - rows + r.
  const std::string tall = path("attn_tall.npy");
  write_f32(tall, {layers, q_heads, tokens + 4, tokens}, true);
  f.expect_refused(h2o(tall), {tall, "exceed num_tokens"});

  // An integer array where floats are expected, and floats where integers are.
  const std::string attn_int = path("attn_int.npy"), positions_f32 = path("positions_f32.npy");
  write_array(attn_int, io::element_kind::i32, {layers, q_heads, 3, tokens});
  f.expect_refused(h2o(attn_int), {attn_int});
  write_array(positions_f32, io::element_kind::f32, {layers, kv_heads, tokens});
  auto pre_rope = f.select_args(f.keys);
  pre_rope.insert(pre_rope.end(), {"--pre-rope", "--positions", positions_f32});
  f.expect_refused(pre_rope, {positions_f32, "dtype"});
  // Integer positions are accepted, and one past int32 is refused naming the file.
  const std::string positions = path("positions.npy");
  const std::vector<std::int64_t> pos_shape = {layers, kv_heads, tokens};
  std::vector<std::int64_t> pos(static_cast<std::size_t>(layers * kv_heads * tokens));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int64_t>(i % tokens);
  io::write_npy(positions, io::element_kind::i64, pos_shape, pos.data());
  pre_rope.back() = positions;
  good_run(f, pre_rope, {kv_heads, 5});
  pos[5] = std::int64_t{1} << 40;
  io::write_npy(positions, io::element_kind::i64, pos_shape, pos.data());
  f.expect_refused(pre_rope, {positions, "out of range"});
}

TEST_CASE("inspect escapes the file's metadata before the terminal sees it", "[cli][errors]") {
  // Issue 15: metadata reached the terminal unescaped, so a file could send escape sequences.
  const fixture f;
  triattn::query_stats s = small_stats();
  s.info["model"] = "evil\x1b]0;title\x07\x1b[31mred\xc2\x9b" "2J caf\xc3\xa9";
  const std::string hostile = (f.dir / "hostile.safetensors").string();
  triattn::save_stats(hostile, s);
  const auto r = run_cli(f.dir, {"inspect", hostile});
  INFO("command: " << r.command << "\nstderr: " << r.err);
  REQUIRE(r.code == 0);
  CHECK(r.out.find('\x1b') == std::string::npos);
  CHECK(r.out.find('\x07') == std::string::npos);
  CHECK(r.out.find("\xc2\x9b") == std::string::npos);
  CHECK(r.out.find("model: evil\\x1b]0;title\\x07\\x1b[31mred\\xc2\\x9b2J caf\xc3\xa9") != std::string::npos);
}

TEST_CASE("--out is never a special file or a link: a rename would replace it", "[cli][errors]") {
  // Issue 15: outputs are written to a temporary file and renamed over --out, which replaced a
  // FIFO, a device or a symbolic link by a regular file (as root, --out /dev/null replaced the
  // system's /dev/null). They are refused, and stay what they were.
  const fixture f;
  const fs::path fifo = f.dir / "out.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const fs::path target = f.dir / "target.npy", link = f.dir / "link.npy";
  { std::ofstream(target) << "target"; }
  fs::create_symlink(target, link);
  for (const fs::path& out : {fifo, link, f.dir.path()}) {
    auto a = f.score_args(f.keys);
    *(std::find(a.begin(), a.end(), "--out") + 1) = out.string();
    const auto r = run_cli(f.dir, a);
    INFO("command: " << r.command);
    check_one_line_error(r, {out.string()});
  }
  CHECK(fs::is_fifo(fs::symlink_status(fifo)));
  CHECK(fs::is_symlink(fs::symlink_status(link)));
  std::ifstream in(target);
  std::string text;
  in >> text;
  CHECK(text == "target");
  fs::remove(fifo);
  fs::remove(link);
  fs::remove(target);
}

TEST_CASE("--help exits 0 and prints the usage", "[cli][errors]") {
  const scratch_dir dir("cli_help");
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--help"},
                                               {"score", "triattention", "--help"},
                                               {"select", "triattention", "--help"},
                                               {"calibrate", "--help"}}) {
    const auto r = run_cli(dir, args);
    INFO("command: " << r.command);
    CHECK(r.code == 0);
    CHECK(r.out.find("usage") != std::string::npos);
    CHECK(r.out.find("triattn score") != std::string::npos);
    CHECK(r.err.empty());
  }
  CHECK(dir.listing().empty());
  // No command at all is a usage error: exit 2, the usage on stderr.
  const auto r = run_cli(dir, {});
  CHECK(r.code == 2);
  CHECK(r.out.empty());
  CHECK(r.err.find("usage") != std::string::npos);
}
