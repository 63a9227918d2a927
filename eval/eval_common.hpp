/// \file eval/eval_common.hpp
/// \brief What triattn_eval's commands share: option parsing, number formatting, atomic file
/// writes and the log-softmax sums every metric starts from.
#pragma once

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace triattn_eval {

namespace fs = std::filesystem;

/// A command-line mistake: printed as one line, exit code 2.
struct usage_error {
  std::string message;
};

/// The non-empty comma-separated items of `s`.
inline std::vector<std::string> split(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const auto c = std::min(s.find(','), s.size());
    if (c > 0) out.emplace_back(s.substr(0, c));
    s.remove_prefix(std::min(c + 1, s.size()));
  }
  return out;
}

/// `v` as an integer >= `lo`, or usage_error naming option `opt`.
inline std::int64_t parse_int(const std::string& opt, const std::string& v, std::int64_t lo) {
  std::int64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || x < lo)
    throw usage_error{"option " + opt + ": '" + v + "' is not an integer >= " + std::to_string(lo)};
  return x;
}

/// `v` as a finite number in [lo, hi], or usage_error naming option `opt`.
inline double parse_double(const std::string& opt, const std::string& v, double lo, double hi) {
  double x = 0.0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || !std::isfinite(x) || x < lo || x > hi)
    throw usage_error{"option " + opt + ": '" + v + "' is not a number in [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "]"};
  return x;
}

/// When the rounds of a compressed prefill run (`--compress-at`).
enum class prefill_rounds : std::uint8_t {
  chunks,  ///< after every chunk that leaves more than the budget cached
  end,     ///< once, after the whole prompt (kvpress's setting)
};

inline prefill_rounds parse_prefill_rounds(const std::string& v) {
  if (v == "chunks") return prefill_rounds::chunks;
  if (v == "end") return prefill_rounds::end;
  throw usage_error{"option --compress-at: '" + v + "' is not chunks or end"};
}
inline const char* prefill_rounds_name(prefill_rounds r) { return r == prefill_rounds::end ? "end" : "chunks"; }

/// `--name value` / `--name=value` pairs of a subcommand, and the bare `flags` (stored as "1");
/// an option in neither list is an error.
inline std::map<std::string, std::string> subcommand_options(int argc, char** argv,
                                                             std::initializer_list<std::string_view> known,
                                                             std::initializer_list<std::string_view> flags = {}) {
  std::map<std::string, std::string> out;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (std::find(flags.begin(), flags.end(), arg) != flags.end()) {
      out[arg] = "1";
      continue;
    }
    std::optional<std::string> value;
    if (const auto eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
    }
    if (std::find(known.begin(), known.end(), arg) == known.end())
      throw usage_error{std::string(argv[1]) + ": unknown option " + arg};
    if (!value) {
      if (i + 1 >= argc) throw usage_error{"option " + arg + " needs a value"};
      value = argv[++i];
    }
    out[arg] = *value;
  }
  return out;
}

inline std::string required(const std::map<std::string, std::string>& o, const std::string& name, const char* command) {
  const auto it = o.find(name);
  if (it == o.end() || it->second.empty()) throw usage_error{std::string(command) + ": missing " + name};
  return it->second;
}

/// log Σ exp(z), in double.
inline double log_sum_exp(std::span<const float> z) {
  const double max = *std::max_element(z.begin(), z.end());
  double sum = 0.0;
  for (const float v : z) sum += std::exp(v - max);
  return max + std::log(sum);
}

/// `x` formatted by `f`, or "nan".
inline std::string fmt(const char* f, double x) {
  if (!std::isfinite(x)) return "nan";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

/// Writes `dir`/`name` through a temporary file, so a reader never sees half a file.
inline void write_file(const fs::path& dir, const std::string& name, const std::string& text) {
  fs::create_directories(dir);
  const fs::path tmp = dir / (name + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.good()) throw std::runtime_error("cannot write " + tmp.string());
  }
  fs::rename(tmp, dir / name);
}

/// Mean and standard error of the mean of `x` (NaN when empty; SE 0 for one value).
struct mean_se {
  double mean = NAN, se = NAN;
};
inline mean_se mean_and_se(std::span<const double> x) {
  if (x.empty()) return {};
  double sum = 0.0;
  for (const double v : x) sum += v;
  const double m = sum / static_cast<double>(x.size());
  if (x.size() == 1) return {m, 0.0};
  double sq = 0.0;
  for (const double v : x) sq += (v - m) * (v - m);
  return {m, std::sqrt(sq / static_cast<double>(x.size() - 1) / static_cast<double>(x.size()))};
}

/// A progress bar on stderr shared by the threads of a command.
class progress_bar {
 public:
  progress_bar(const char* what, std::int64_t total) : what_(what), total_(std::max<std::int64_t>(total, 1)) {}
  void add(std::int64_t units) {
    const std::int64_t done = done_.fetch_add(units) + units;
    const int permille = static_cast<int>(1000 * done / total_);
    const std::lock_guard lock(mutex_);
    if (permille <= shown_) return;
    shown_ = permille;
    const int filled = std::min(40, permille * 40 / 1000);
    std::fprintf(stderr, "\r%s [%s%s] %5.1f%% %7.1fs", what_, std::string(static_cast<std::size_t>(filled), '#').c_str(),
                 std::string(static_cast<std::size_t>(40 - filled), '.').c_str(), permille / 10.0, seconds());
    std::fflush(stderr);
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  const char* what_;
  std::int64_t total_;
  std::atomic<std::int64_t> done_{0};
  std::mutex mutex_;
  int shown_ = -1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace triattn_eval
