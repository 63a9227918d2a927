// Shared by the tests of tests/tools: running the `triattn` executable (TRIATTN_TEST_CLI) as a
// user does, through the shell, with stdout and stderr captured into files; a scratch folder
// per test; the converter (TRIATTN_TEST_PYTHON, TRIATTN_TEST_CONVERTER) where a test needs it.
#pragma once

#include <catch2/catch.hpp>
#include <sys/wait.h>  // WIFEXITED / WEXITSTATUS of std::system
#include <unistd.h>    // getpid

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "support/process.hpp"
#include "triattn/io/npy.hpp"

namespace triattn_test::cli {

namespace fs = std::filesystem;
using triattn_test::read_bytes;
using triattn_test::read_text;
using triattn_test::shell_quote;
using triattn_test::system_status;
using triattn_test::write_bytes;
#if defined(TRIATTN_TEST_PYTHON) && defined(TRIATTN_TEST_CONVERTER)
using triattn_test::convert;
using triattn_test::require_numpy;
#endif

/// A fresh, empty folder under the system's temp folder, removed with its contents at the end
/// of the scope (kept when TRIATTN_TEST_KEEP_TMP=1, to look at after a failure).
class scratch_dir {
 public:
  explicit scratch_dir(const std::string& tag) {
    std::random_device rd;
    for (int attempt = 0;; ++attempt) {
      path_ = fs::temp_directory_path() /
              ("triattn_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
      if (fs::create_directory(path_)) break;
      REQUIRE(attempt < 100);
    }
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  ~scratch_dir() {
    const char* keep = std::getenv("TRIATTN_TEST_KEEP_TMP");
    if (keep != nullptr && std::string(keep) == "1") return;
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

  /// Names of every entry below the folder (to check that a failed command wrote nothing).
  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& e : fs::recursive_directory_iterator(path_)) names.insert(e.path().string());
    return names;
  }

 private:
  fs::path path_;
};

/// What a command did.
struct result {
  int code = -1;  ///< exit status; -1 when killed by a signal (a crash)
  std::string out, err;
  std::string command;

  /// The lines of stderr (a final line without '\n' counts too).
  std::size_t err_lines() const {
    std::size_t n = static_cast<std::size_t>(std::count(err.begin(), err.end(), '\n'));
    if (!err.empty() && err.back() != '\n') ++n;
    return n;
  }
};

/// Runs `triattn <args...>` with stdout and stderr captured into files of `dir` (which are
/// removed again, so `dir.listing()` shows only what the command wrote).
inline result run_cli(const scratch_dir& dir, const std::vector<std::string>& args) {
  result r;
  r.command = shell_quote(TRIATTN_TEST_CLI);
  for (const auto& a : args) {
    r.command += ' ';
    r.command += shell_quote(a);  // (not `" " + ...`: GCC 12 reports a bogus -Wrestrict for it)
  }
  const fs::path out = dir.path().parent_path() / (dir.path().filename().string() + ".stdout");
  const fs::path err = dir.path().parent_path() / (dir.path().filename().string() + ".stderr");
  r.code = system_status(r.command + " >" + shell_quote(out.string()) + " 2>" + shell_quote(err.string()));
  r.out = read_text(out);
  r.err = read_text(err);
  std::error_code ignored;
  fs::remove(out, ignored);
  fs::remove(err, ignored);
  return r;
}

/// Runs `triattn <args...>`, which must succeed silently (status 0, nothing on stdout or
/// stderr), and returns the .npy it wrote to `out`, which is removed again.
inline triattn::io::npy_array run_cli_npy(const scratch_dir& dir, const std::vector<std::string>& args,
                                          const fs::path& out) {
  const result r = run_cli(dir, args);
  INFO("command: " << r.command << "\nstderr: " << r.err);
  REQUIRE(r.code == 0);
  REQUIRE(r.err.empty());
  REQUIRE(r.out.empty());
  triattn::io::npy_array a = triattn::io::read_npy(out);
  fs::remove(out);
  return a;
}

/// The failure every bad input must give: exit status 2, exactly one line on stderr that
/// holds every needle (the file or option at fault), nothing on stdout.
inline void check_one_line_error(const result& r, const std::vector<std::string>& needles) {
  INFO("command: " << r.command);
  INFO("stderr: " << r.err);
  CHECK(r.code == 2);
  CHECK(r.err_lines() == 1);
  CHECK((!r.err.empty() && r.err.back() == '\n'));
  CHECK(r.out.empty());
  for (const auto& n : needles) {
    INFO("expected in stderr: " << n);
    CHECK(r.err.find(n) != std::string::npos);
  }
}

}  // namespace triattn_test::cli
