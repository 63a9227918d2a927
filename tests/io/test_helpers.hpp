// Shared by the tests of tests/io: byte buffers from text, the error-message check, and a
// scratch folder.
#pragma once

#include <catch2/catch.hpp>

#include <cstddef>
#include <filesystem>
#include <initializer_list>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "triattn/core/error.hpp"

namespace triattn_test {

inline std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> out;
  for (const char c : s) out.push_back(static_cast<std::byte>(c));
  return out;
}

inline std::string text_of(const std::vector<std::byte>& b) {
  std::string out;
  for (const std::byte x : b) out += static_cast<char>(x);
  return out;
}

/// `call` must throw triattn::error with a one-line message holding every needle.
template <class F>
void require_error(F&& call, std::initializer_list<std::string_view> needles) {
  try {
    call();
  } catch (const triattn::error& e) {
    const std::string m = e.what();
    INFO("message: " << m);
    CHECK(m.find('\n') == std::string::npos);
    for (const std::string_view n : needles) CHECK(m.find(n) != std::string::npos);
    return;
  }
  FAIL("no triattn::error was thrown");
}

/// A fresh, empty folder, removed with everything in it at the end of the scope.
class scratch_dir {
 public:
  scratch_dir() {
    std::random_device rd;  // unique per folder, not per seed: tests may run in parallel
    path_ = std::filesystem::temp_directory_path() /
            ("triattn-io-test-" + std::to_string(rd()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  /// The names of the files in the folder (to prove that no temporary file is left).
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) out.push_back(e.path().filename().string());
    return out;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace triattn_test
