// MRL_CHECK: TORCH_CHECK whose message is assembled with std::to_string, never with iostreams.
//
// On the H200 image (torch 2.11.0+cu130, extension built by its /opt/gcc g++), streaming an
// integer through std::ostringstream inside this extension -- which is what TORCH_CHECK does with
// non-string message arguments -- segfaulted instead of raising; string-only messages were fine.
// Every check whose message carries a number goes through this macro (tests/ops/test_packing.py::
// test_bad_layout_raises_in_the_ops runs such checks in a fresh interpreter).
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace megatron_rl {

inline std::string msg_part(const char* s) { return s; }
inline std::string msg_part(const std::string& s) { return s; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
std::string msg_part(T v) {
  return std::to_string(v);
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (out += ... += msg_part(args));
  return out;
}

}  // namespace megatron_rl

#define MRL_CHECK(cond, ...)                                                  \
  do {                                                                        \
    if (C10_UNLIKELY(!(cond))) {                                              \
      TORCH_CHECK(false, ::megatron_rl::message(__VA_ARGS__));                \
    }                                                                         \
  } while (false)
