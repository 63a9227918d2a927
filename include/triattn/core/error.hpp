/// \file triattn/core/error.hpp
/// \brief `triattn::error` and the host-side precondition macro.
///
/// Every host API validates its inputs before it touches the cache and reports a violation
/// as `triattn::error` whose message starts with the API name and quotes the bad value:
/// `triattn::compress: budget 0 must be >= 1`. Build with `TRIATTN_NO_EXCEPTIONS` (engines
/// compiled with `-fno-exceptions`) to print the same message and abort instead.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#ifdef TRIATTN_NO_EXCEPTIONS
#include <cstdio>
#include <cstdlib>
#endif

#include "triattn/core/config.hpp"

TRIATTN_NAMESPACE_BEGIN

/// The one exception type of the library. `what()` names the API and the offending value.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

/// Concatenates the API name and the message parts with `operator<<`, then throws.
/// (GCC 12 has no `<format>`.)
template <class... Parts>
[[noreturn]] void fail(const char* api, const Parts&... parts) {
  std::ostringstream os;
  os << api << ": ";
  (os << ... << parts);
#ifdef TRIATTN_NO_EXCEPTIONS
  std::fprintf(stderr, "%s\n", os.str().c_str());
  std::abort();
#else
  throw error(os.str());
#endif
}

}  // namespace detail

TRIATTN_NAMESPACE_END

/// Host precondition: `TRIATTN_CHECK(budget >= 1, "triattn::compress", "budget ", budget,
/// " must be >= 1")`. The message parts are only evaluated when the check fails.
#ifndef TRIATTN_CHECK
#define TRIATTN_CHECK(cond, api, ...)                       \
  do {                                                      \
    if (!(cond)) ::TRIATTN_NAMESPACE::detail::fail(api, __VA_ARGS__); \
  } while (0)
#endif
