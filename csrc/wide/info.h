// Build and runtime facts of the wide core library.
#pragma once

#include <string>

namespace wide {

/// One line per fact ("key: value"): library version, compiler, C++ standard, OpenMP, ATen
/// threads, and how many threads at::parallel_for really used on a probe loop.
std::string build_info();

} // namespace wide
