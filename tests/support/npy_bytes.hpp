// A .npy file built byte by byte, for tests that need headers the library's writer would
// never produce (malformed, absurd shapes, other versions).
#pragma once

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

namespace triattn_test {

/// Magic, version major.0, the header length (u16 for 1.0, u32 otherwise), the header exactly
/// as given, then `data`.
inline std::vector<std::byte> npy_file(int major, std::string_view header, std::span<const std::byte> data = {}) {
  std::vector<std::byte> out;
  for (const char c : std::string_view("\x93NUMPY", 6)) out.push_back(static_cast<std::byte>(c));
  out.push_back(static_cast<std::byte>(major));
  out.push_back(std::byte{0});
  const std::size_t len_bytes = major == 1 ? 2 : 4;
  for (std::size_t i = 0; i < len_bytes; ++i) out.push_back(static_cast<std::byte>((header.size() >> (8 * i)) & 0xff));
  for (const char c : header) out.push_back(static_cast<std::byte>(c));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

}  // namespace triattn_test
