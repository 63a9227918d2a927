// Where the tests find the third-party data (model, text, reference statistics). CTest
// passes TRIATTN_DATA_DIR in the environment of the tests registered with NEEDS_DATA.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace triattn_test {

/// The data folder (laid out like shared/), or an empty path when none is configured.
inline std::filesystem::path data_dir() {
  const char* d = std::getenv("TRIATTN_DATA_DIR");
  return d != nullptr ? std::filesystem::path(d) : std::filesystem::path();
}

/// Whether the bundled model is reachable.
inline bool data_available() {
  const auto d = data_dir();
  return !d.empty() && std::filesystem::exists(d / "models" / "stories260K" / "stories260K.bin");
}

}  // namespace triattn_test
