// Issue 15, item 15: outputs are durable. `write_file_atomically` (every .npy and safetensors
// write) must fsync the temporary file before it renames it over the output, and fsync the
// folder after, so that after a power loss the output is the old file or the new one, never
// an empty one. A power loss cannot be staged in a test, but the order of the calls can be
// seen: this program defines fsync and rename itself, which the dynamic linker binds ahead of
// the C library's (for libstdc++'s calls too), records each call and forwards it by syscall.
// An fsync made to fail must fail the write, naming the file, with the old output intact.
#include <catch2/catch.hpp>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "support/process.hpp"
#include "test_helpers.hpp"
#include "triattn/io/npy.hpp"
#include "triattn/io/safetensors.hpp"

namespace {

std::vector<std::string> calls;  // "fsync <path>", "rename <from> <to>"
bool fail_fsync = false;

std::string fd_path(int fd) {
  return std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(fd)).string();
}

}  // namespace

extern "C" int fsync(int fd) {
  calls.push_back("fsync " + fd_path(fd));
  if (fail_fsync) {
    errno = EIO;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}

extern "C" int rename(const char* from, const char* to) {
  calls.push_back(std::string("rename ") + from + " " + to);
#if defined(SYS_renameat)
  return static_cast<int>(::syscall(SYS_renameat, AT_FDCWD, from, AT_FDCWD, to));
#else  // AArch64 has only renameat2
  return static_cast<int>(::syscall(SYS_renameat2, AT_FDCWD, from, AT_FDCWD, to, 0));
#endif
}

namespace {

namespace fs = std::filesystem;
namespace io = triattn::io;

/// Writes `out` once through write_npy or write_safetensors.
void write_once(const fs::path& out, bool npy, float value) {
  const std::vector<float> data = {value, -value, 2 * value};
  const std::vector<std::int64_t> shape = {3};
  if (npy) {
    io::write_npy(out, io::element_kind::f32, shape, data.data());
  } else {
    const io::safetensors_entry w{"w", "F32", shape, std::as_bytes(std::span(data))};
    io::write_safetensors(out, std::span(&w, 1), {});
  }
}

}  // namespace

TEST_CASE("an output is flushed before it replaces the old one, and the folder after", "[io][durable]") {
  for (const bool npy : {true, false}) {
    INFO((npy ? ".npy" : "safetensors"));
    const triattn_test::scratch_dir dir;
    const fs::path out = dir.path() / (npy ? "scores.npy" : "stats.safetensors");
    const fs::path folder = fs::canonical(dir.path());
    calls.clear();
    write_once(out, npy, 1.5f);
    REQUIRE(calls.size() == 3);
    const std::string tmp_prefix = (folder / out.filename()).string() + ".tmp.";
    // 1. the temporary file's bytes, 2. the rename over the output, 3. the folder's entry
    CHECK(calls[0].rfind("fsync " + tmp_prefix, 0) == 0);
    const std::string tmp = calls[0].substr(6);
    CHECK(calls[1] == "rename " + (dir.path() / fs::path(tmp).filename()).string() + " " + out.string());
    CHECK(calls[2] == "fsync " + folder.string());
    CHECK(dir.files() == std::vector<std::string>{out.filename().string()});
  }
}

TEST_CASE("a failed fsync fails the write, names the file and keeps the old output", "[io][durable]") {
  for (const bool npy : {true, false}) {
    INFO((npy ? ".npy" : "safetensors"));
    const triattn_test::scratch_dir dir;
    const fs::path out = dir.path() / (npy ? "scores.npy" : "stats.safetensors");
    write_once(out, npy, 1.5f);
    const std::string before = triattn_test::read_text(out);
    calls.clear();
    fail_fsync = true;
    triattn_test::require_error([&] { write_once(out, npy, -4.0f); }, {out.string(), "cannot write", "Input/output error"});
    fail_fsync = false;
    CHECK(calls.size() == 1);  // no rename after the failed flush
    CHECK(triattn_test::read_text(out) == before);
    CHECK(dir.files() == std::vector<std::string>{out.filename().string()});  // the temporary file is gone
  }
}
