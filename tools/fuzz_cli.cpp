// The `triattn` fuzz driver (issue 15): hostile inputs for every input role of the CLI (keys,
// values, attention, queries, positions, stats, model, tokenizer, text) through every command
// that reads it, plus zero-size and absurd geometry and special output paths. Each case runs
// the executable in a child process under a memory cap (RLIMIT_AS) and a time limit.
//
// A case fails when the child dies on a signal, runs past the time limit, exits with a status
// other than 0 or 2, exits 2 without exactly one line on stderr (progress lines aside), leaves an --out file after a
// refusal, or replaces a special --out (a FIFO, a symbolic link). Seeds are valid inputs; a
// case mutates one role's file (truncation, byte flips, header edits, zero and huge dims,
// another dtype, NaN) and runs one command that reads it.
//
// Usage: triattn_fuzz_cli --cli PATH --model-dir DIR [--gguf FILE] [--roles LIST] [--cases N=300]
//                         [--seed S=1] [--memory-mb M=512] [--timeout-s T=10] [--keep]
// M = 0: no memory cap (AddressSanitizer reserves terabytes of address space). --gguf adds a
// GGUF model role (a real model; `calibrate` reads it, under a cap of 4 x M, since a valid
// mutant's weights are converted to f32); --roles keeps the roles named (keys, values,
// attention, queries, positions, stats, model, tokenizer, text, gguf). Prints one line per
// failure and a summary; exits 1 if any case failed.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "triattn/calibration/stats_file.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/registry.hpp"

namespace fs = std::filesystem;
namespace io = triattn::io;

namespace {

constexpr int layers = 2, kv_heads = 2, q_heads = 4, head_dim = 8, tokens = 16, rows = 3, window = 4;

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const fs::path& p, const std::vector<char>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(b.data(), static_cast<std::streamsize>(b.size()));
}

void write_floats(const fs::path& p, const std::vector<std::int64_t>& shape, std::mt19937_64& g, bool probs = false) {
  std::int64_t n = 1;
  for (const auto d : shape) n *= d;
  std::vector<float> v(static_cast<std::size_t>(n));
  std::normal_distribution<float> normal;
  for (float& x : v) x = probs ? 1.0f / static_cast<float>(shape.back()) : normal(g);
  io::write_npy(p, io::element_kind::f32, shape, v.data());
}

triattn::query_stats stats(std::mt19937_64& g) {
  std::normal_distribution<float> normal;
  triattn::query_stats s;
  s.num_layers = layers;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  for (int f = 0; f < head_dim / 2; ++f) s.inv_freq.push_back(std::pow(10000.0, -2.0 * f / head_dim));
  for (std::size_t i = 0; i < s.row(layers, 0); ++i) {
    s.q_mean_real.push_back(normal(g));
    s.q_mean_imag.push_back(normal(g));
    s.q_abs_mean.push_back(std::hypot(s.q_mean_real.back(), s.q_mean_imag.back()) + 0.5f);
  }
  return s;
}

/// One hostile version of `b`: truncated, bytes flipped, a header number replaced by 0, a
/// huge or negative one, a dtype changed, a NaN written, or bytes appended.
std::vector<char> mutate(std::vector<char> b, std::mt19937_64& g) {
  std::uniform_int_distribution<int> kind(0, 7);
  const auto at = [&](std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n ? n - 1 : 0)(g); };
  switch (b.empty() ? 7 : kind(g)) {
    case 0:  // truncated
      b.resize(at(b.size()));
      break;
    case 1:  // a few bytes flipped anywhere
      for (int i = 0; i < 4; ++i) b[at(b.size())] ^= static_cast<char>(1 << at(8));
      break;
    case 2:    // a byte of the first 128 (headers) flipped
    case 3: {  // a digit of the header replaced: 0, huge, negative
      const std::size_t head = std::min<std::size_t>(b.size(), 128);
      for (std::size_t i = 0; i < head; ++i) {
        const std::size_t j = at(head);
        if (b[j] >= '0' && b[j] <= '9') {
          static const char* const subst[] = {"0", "9999999999", "-1", "4294967297", "00"};
          const std::string s = subst[at(5)];
          b.erase(b.begin() + static_cast<std::ptrdiff_t>(j));
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(j), s.begin(), s.end());
          break;
        }
      }
      if (kind(g) < 2) b[at(head)] = static_cast<char>(at(256));
      break;
    }
    case 4: {  // another dtype in a .npy header
      static const char* const from[] = {"<f4", "<f2", "<i8"};
      static const char* const to[] = {"<i4", "|b1", "<f8", "<c8", ">f4", "<u8", "<f2"};
      const std::string text(b.begin(), b.end());
      for (const char* f : from)
        if (const auto p = text.find(f); p != std::string::npos) {
          const std::string t = to[at(7)];
          std::copy(t.begin(), t.end(), b.begin() + static_cast<std::ptrdiff_t>(p));
          break;
        }
      break;
    }
    case 5: {  // a NaN or an infinity in the last bytes (the data of a float array)
      const float bad[] = {NAN, INFINITY, -INFINITY, 1e38f};
      if (b.size() >= 4) std::memcpy(b.data() + b.size() - 4 - 4 * at(std::min<std::size_t>(b.size() / 4, 16)), &bad[at(4)], 4);
      break;
    }
    case 6:  // bytes appended
      b.insert(b.end(), at(64) + 1, static_cast<char>(at(256)));
      break;
    default:  // empty
      b.clear();
      break;
  }
  return b;
}

struct outcome {
  bool signaled = false, timed_out = false;
  int code = 0;
  std::string err;
};

/// Runs `cli args` with stdout and stderr into files, under the caps.
outcome run(const std::vector<std::string>& args, const fs::path& dir, std::size_t memory_mb, int timeout_s) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    if (memory_mb > 0) {
      const rlimit lim{memory_mb << 20, memory_mb << 20};
      ::setrlimit(RLIMIT_AS, &lim);
    }
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  outcome r;
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(timeout_s)) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  r.signaled = !r.timed_out && WIFSIGNALED(status);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const auto e = read_bytes(err);
  r.err.assign(e.begin(), e.end());
  return r;
}

/// The lines of `err` but progress lines (which start with a carriage return: the CLI's
/// progress bar redraws itself, and a refusal may come after the work it shows).
std::ptrdiff_t refusal_lines(const std::string& err) {
  std::ptrdiff_t n = 0;
  for (std::size_t begin = 0; begin < err.size();) {
    const std::size_t end = std::min(err.find('\n', begin), err.size());
    if (err[begin] != '\r') ++n;
    begin = end + 1;
  }
  return n;
}

std::string arg_value(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cli = arg_value(argc, argv, "--cli", "");
  const fs::path model_dir = arg_value(argc, argv, "--model-dir", "");
  const int cases = std::stoi(arg_value(argc, argv, "--cases", "300"));
  const auto seed = std::stoull(arg_value(argc, argv, "--seed", "1"));
  const auto memory_mb = static_cast<std::size_t>(std::stoul(arg_value(argc, argv, "--memory-mb", "512")));
  const int timeout_s = std::stoi(arg_value(argc, argv, "--timeout-s", "10"));
  const fs::path gguf_seed = arg_value(argc, argv, "--gguf", "");
  const std::string role_names = arg_value(argc, argv, "--roles", "");
  if (cli.empty() || model_dir.empty()) {
    std::fprintf(stderr,
                 "usage: %s --cli PATH --model-dir DIR [--gguf FILE] [--roles LIST] [--cases N] [--seed S] "
                 "[--memory-mb M] [--timeout-s T]\n",
                 argv[0]);
    return 2;
  }
  const fs::path dir = fs::temp_directory_path() / ("triattn_fuzz_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::mt19937_64 g(seed);

  // Valid seeds of every role.
  const fs::path keys = dir / "keys.npy", values = dir / "values.npy", attn = dir / "attn.npy",
                 queries = dir / "queries.npy", positions = dir / "positions.npy", stats_file = dir / "stats.safetensors",
                 model = dir / "model.bin", tok = dir / "tok.bin", text = dir / "text.txt", gguf = dir / "model.gguf";
  write_floats(keys, {layers, kv_heads, tokens, head_dim}, g);
  write_floats(values, {layers, kv_heads, tokens, head_dim}, g);
  write_floats(attn, {layers, q_heads, rows, tokens}, g, true);
  write_floats(queries, {layers, q_heads, window, head_dim}, g);
  {
    std::vector<std::int64_t> p(static_cast<std::size_t>(layers) * kv_heads * tokens);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<std::int64_t>(i % tokens);
    const std::vector<std::int64_t> shape = {layers, kv_heads, tokens};
    io::write_npy(positions, io::element_kind::i64, shape, p.data());
  }
  triattn::save_stats(stats_file, stats(g));
  fs::copy_file(model_dir / "stories260K.bin", model, fs::copy_options::overwrite_existing);
  fs::copy_file(model_dir / "tok512.bin", tok, fs::copy_options::overwrite_existing);
  if (!gguf_seed.empty()) fs::copy_file(gguf_seed, gguf, fs::copy_options::overwrite_existing);
  {
    std::string t;
    for (int i = 0; i < 40; ++i) t += "Once upon a time there was a little cat who liked to play. ";
    write_bytes(text, {t.begin(), t.end()});
  }

  const fs::path out = dir / "out.npy", out_st = dir / "out.safetensors";
  const std::string k = keys.string(), v = values.string(), a = attn.string(), q = queries.string(),
                    p = positions.string(), s = stats_file.string(), o = out.string();
  // Every command and the roles it reads.
  struct command {
    std::vector<std::string> args;
  };
  std::vector<command> commands = {
      {{"score", "triattention", "--stats", s, "--keys", k, "--round-start", "16", "--out", o}},
      {{"select", "triattention", "--stats", s, "--keys", k, "--positions", p, "--pre-rope", "--round-start", "16",
        "--budget", "5", "--out", o}},
      {{"inspect", s}},
      {{"calibrate", "--model", model.string(), "--tokenizer", tok.string(), "--text", text.string(), "--out",
        out_st.string(), "--windows", "1", "--window-tokens", "32"}},
  };
  // Every policy of the registry that observes attention or queries, with the inputs its
  // entry names; select and score in turn.
  for (const triattn::policy_entry& e : triattn::policy_registry) {
    if (!e.needs.attention && !e.needs.queries) continue;
    command c{{commands.size() % 2 == 0 ? "select" : "score", std::string(e.name), "--keys", k}};
    if (e.needs.values) c.args.insert(c.args.end(), {"--values", v});
    if (e.needs.attention) c.args.insert(c.args.end(), {"--attn", a});
    if (e.needs.queries) c.args.insert(c.args.end(), {"--queries", q});
    if (c.args[0] == "select") c.args.insert(c.args.end(), {"--budget", "5"});
    c.args.insert(c.args.end(), {"--out", o});
    commands.push_back(std::move(c));
  }
  if (!gguf_seed.empty())
    commands.push_back({{"calibrate", "--model", gguf.string(), "--text", text.string(), "--out", out_st.string(),
                         "--windows", "1", "--window-tokens", "32"}});
  const std::pair<const char*, fs::path> named_roles[] = {
      {"keys", keys},   {"values", values}, {"attention", attn}, {"queries", queries}, {"positions", positions},
      {"stats", stats_file}, {"model", model}, {"tokenizer", tok}, {"text", text},     {"gguf", gguf}};
  std::vector<fs::path> roles;
  for (const auto& [name, path] : named_roles) {
    const bool named = role_names.empty() || ("," + role_names + ",").find("," + std::string(name) + ",") != std::string::npos;
    if (named && (path != gguf || !gguf_seed.empty())) roles.push_back(path);
  }
  if (roles.empty()) {
    std::fprintf(stderr, "%s: --roles %s names no role this run has\n", argv[0], role_names.c_str());
    return 2;
  }

  // Special outputs: a FIFO and a symbolic link must stay what they are.
  const fs::path fifo = dir / "out.fifo", link = dir / "link.npy", target = dir / "target.txt";
  ::mkfifo(fifo.c_str(), 0600);
  write_bytes(target, {'x'});
  fs::create_symlink(target, link);

  int failures = 0, refused = 0, accepted = 0;
  const auto fail = [&](const std::string& what, const std::vector<std::string>& args) {
    ++failures;
    std::string cmd;
    for (const auto& x : args) cmd += x + ' ';
    std::printf("FAIL %s: %s\n", what.c_str(), cmd.c_str());
  };
  for (int c = 0; c < cases; ++c) {
    const fs::path& role = roles[std::uniform_int_distribution<std::size_t>(0, roles.size() - 1)(g)];
    const std::vector<char> original = read_bytes(role);
    if (role == gguf) {
      // A model's metadata (tokenizer included) is its first megabytes; flips in the weights
      // make a valid model. So the metadata is mutated and the rest follows it as it was.
      const std::size_t head = std::min<std::size_t>(original.size(), std::size_t{2} << 20);
      std::vector<char> b = mutate({original.begin(), original.begin() + static_cast<std::ptrdiff_t>(head)}, g);
      if (!b.empty()) b.insert(b.end(), original.begin() + static_cast<std::ptrdiff_t>(head), original.end());
      write_bytes(role, b);
    } else {
      write_bytes(role, mutate(original, g));
    }
    for (const command& cmd : commands) {
      // calibrate reads its text too; every command reads the files it names
      const bool reads = std::find(cmd.args.begin(), cmd.args.end(), role.string()) != cmd.args.end() ||
                         (cmd.args.front() == "calibrate" && role == text);
      if (!reads) continue;
      std::vector<std::string> args = {cli};
      args.insert(args.end(), cmd.args.begin(), cmd.args.end());
      // Now and then, a special --out.
      const auto out_at = std::find(args.begin(), args.end(), "--out");
      const int special = std::uniform_int_distribution<int>(0, 9)(g);
      if (out_at != args.end() && special < 2) *(out_at + 1) = (special == 0 ? fifo : link).string();
      fs::remove(out);
      fs::remove(out_st);
      const bool reads_gguf = std::find(args.begin(), args.end(), gguf.string()) != args.end();
      const outcome r = run(args, dir, reads_gguf ? 4 * memory_mb : memory_mb, timeout_s);
      if (r.timed_out) fail("ran past " + std::to_string(timeout_s) + " s", args);
      else if (r.signaled) fail("died on a signal", args);
      else if (r.code != 0 && r.code != 2) fail("exit status " + std::to_string(r.code) + ": " + r.err, args);
      else if (r.code == 2 && refusal_lines(r.err) != 1) fail("not one line: " + r.err, args);
      else if (r.code == 2 && (fs::exists(out) || fs::exists(out_st))) fail("an output after a refusal", args);
      (r.code == 0 ? accepted : refused) += 1;
      if (!fs::is_fifo(fs::symlink_status(fifo)) || !fs::is_symlink(fs::symlink_status(link)))
        fail("a special --out was replaced", args);
      if (!fs::is_fifo(fs::symlink_status(fifo))) {
        fs::remove(fifo);
        ::mkfifo(fifo.c_str(), 0600);
      }
      if (!fs::is_symlink(fs::symlink_status(link))) {
        fs::remove(link);
        fs::create_symlink(target, link);
      }
    }
    write_bytes(role, original);
  }
  std::printf("fuzz: %d cases (seed %llu): %d runs refused, %d accepted, %d failures\n", cases,
              static_cast<unsigned long long>(seed), refused, accepted, failures);
  if (std::find(argv, argv + argc, std::string("--keep")) == argv + argc) fs::remove_all(dir);
  return failures == 0 ? 0 : 1;
}
