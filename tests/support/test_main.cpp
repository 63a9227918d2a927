// The one main() of every Catch2 test executable. A test registered with NEEDS_DATA checks
// for the data folder first and reports itself skipped (exit 77) without it, or fails when
// the build was configured with TRIATTN_REQUIRE_DATA=ON (as CI does). A test given
// TRIATTN_TEST_NEEDS_FILE (a model CI does not download) is skipped without that file.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "support/data.hpp"

int main(int argc, char** argv) {
  const auto flag = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && std::string(v) == "1";
  };
  if (flag("TRIATTN_TEST_NEEDS_DATA") && !triattn_test::data_available()) {
    const std::string dir = triattn_test::data_dir().string();
    if (flag("TRIATTN_REQUIRE_DATA")) {
      std::fprintf(stderr, "FAILED: no model under the CMake cache variable TRIATTN_DATA_DIR (\"%s\")\n", dir.c_str());
      return 1;
    }
    std::printf("SKIPPED: needs the data folder: set the CMake cache variable TRIATTN_DATA_DIR (now \"%s\")\n",
                dir.c_str());
    return 77;
  }
  if (const char* file = std::getenv("TRIATTN_TEST_NEEDS_FILE"); file != nullptr) {
    std::FILE* f = std::fopen(file, "rb");
    if (f == nullptr) {
      std::printf("SKIPPED: needs %s (not downloaded in CI; see docs/real-model.md)\n", file);
      return 77;
    }
    std::fclose(f);
  }
  return Catch::Session().run(argc, argv);
}
