/// \file demo/common.hpp
/// \brief What the two demos share: their options' syntax, and generated text printed
/// word-wrapped.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>
#include <system_error>

namespace demo {

/// One option of the command line: `--name value` or `--name=value`.
struct option {
  std::string_view name, value;
};

/// The option at argv[i], advancing `i` past a separate value. Calls `fail(message)`, which
/// must not return, when argv[i] is not an option or its value is missing.
template <class Fail>
option next_option(int argc, char** argv, int& i, Fail&& fail) {
  const std::string_view arg = argv[i];
  if (const std::size_t eq = arg.find('='); eq != std::string_view::npos) return {arg.substr(0, eq), arg.substr(eq + 1)};
  if (!arg.starts_with("--")) fail("unexpected argument \"" + std::string(arg) + "\"");
  if (i + 1 >= argc) fail("option " + std::string(arg) + " needs a value");
  return {arg, argv[++i]};
}

/// The integer `text` of `option`, at least `min`; calls `fail(message)`, which must not
/// return, otherwise.
template <class Int, class Fail>
Int parse_int(std::string_view option, std::string_view text, Int min, Fail&& fail) {
  Int v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < min)
    fail(std::string(option) + " expects an integer >= " + std::to_string(min) + ", got \"" + std::string(text) +
         "\"");
  return v;
}

/// Prints `text` line by line, each wrapped at the last space before column 92 and indented
/// by four spaces.
inline void print_wrapped(std::string_view text) {
  constexpr std::size_t width = 92;
  std::string_view rest = text;
  while (!rest.empty()) {
    std::string_view line = rest.substr(0, std::min(rest.find('\n'), rest.size()));
    rest.remove_prefix(std::min(line.size() + 1, rest.size()));
    do {
      std::size_t cut = line.size();
      if (cut > width) {
        const std::size_t space = line.rfind(' ', width);
        cut = space == std::string_view::npos || space == 0 ? width : space;
      }
      std::printf("    %.*s\n", static_cast<int>(cut), line.data());
      line.remove_prefix(cut);
      if (line.starts_with(' ')) line.remove_prefix(1);
    } while (!line.empty());
  }
}

}  // namespace demo
