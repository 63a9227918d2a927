// Running processes from tests: shell quoting, exit status, whole-file reads and writes, and
// tools/convert_reference_stats.py (TRIATTN_TEST_PYTHON, TRIATTN_TEST_CONVERTER, set by
// triattn_test_uses_converter() in tests/CMakeLists.txt).
#pragma once

#include <catch2/catch.hpp>
#include <sys/wait.h>  // WIFEXITED / WEXITSTATUS of std::system

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace triattn_test {

namespace fs = std::filesystem;

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

/// The exit status of a shell command; -1 when it did not exit normally (killed by a signal).
inline int system_status(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline std::vector<std::byte> read_bytes(const fs::path& p) {
  const std::string s = read_text(p);
  std::vector<std::byte> out(s.size());
  std::transform(s.begin(), s.end(), out.begin(), [](char c) { return static_cast<std::byte>(c); });
  return out;
}

inline void write_bytes(const fs::path& p, const std::vector<std::byte>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

#if defined(TRIATTN_TEST_PYTHON) && defined(TRIATTN_TEST_CONVERTER)
/// Skips the whole test (exit 77) when the interpreter lacks NumPy, unless the build requires
/// the data tests to run (TRIATTN_REQUIRE_DATA=1): then it fails.
inline void require_numpy() {
  const std::string python = TRIATTN_TEST_PYTHON;
  if (system_status(shell_quote(python) + " -c 'import numpy' 2>/dev/null") == 0) return;
  const char* required = std::getenv("TRIATTN_REQUIRE_DATA");
  if (required != nullptr && std::string(required) == "1")
    FAIL("NumPy is missing for " << python << " (install python3-numpy); TRIATTN_REQUIRE_DATA is ON");
  std::printf("SKIPPED: NumPy is missing for %s; the converter needs it\n", python.c_str());
  std::fflush(stdout);
  std::exit(77);
}

/// Converts `input` (a reference .pt file) with `flags` to `out`.
inline void convert(const fs::path& input, const std::string& flags, const fs::path& out) {
  require_numpy();
  REQUIRE(fs::exists(input));
  const std::string command = shell_quote(TRIATTN_TEST_PYTHON) + " " + shell_quote(TRIATTN_TEST_CONVERTER) + " " +
                              shell_quote(input.string()) + " " + flags + " --out " + shell_quote(out.string()) +
                              " >/dev/null";
  INFO(command);
  REQUIRE(system_status(command) == 0);
  REQUIRE(fs::exists(out));
}
#endif

}  // namespace triattn_test
