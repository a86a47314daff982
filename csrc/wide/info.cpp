#include "wide/info.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <sstream>

#ifndef WIDE_VERSION
#define WIDE_VERSION "unknown"
#endif
#ifndef WIDE_CXX_COMPILER
#define WIDE_CXX_COMPILER "unknown"
#endif

namespace wide {

namespace {
// Runs a small at::parallel_for and counts the distinct worker threads that took part: 1 means
// the library's parallel loops are serial (no OpenMP, or one thread allowed).
int64_t probe_parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() % 64));
  });
  return __builtin_popcountll(seen.load());
}
} // namespace

std::string build_info() {
  std::ostringstream out;
  out << "version: " << WIDE_VERSION << "\n";
  out << "compiler: " << WIDE_CXX_COMPILER << "\n";
  out << "cxx_standard: " << __cplusplus << "\n";
#ifdef _OPENMP
  out << "openmp: " << _OPENMP << "\n";
#else
  out << "openmp: no\n";
#endif
  out << "aten_threads: " << at::get_num_threads() << "\n";
  out << "parallel_for_threads_used: " << probe_parallel_threads() << "\n";
  out << "aten_parallel: " << at::get_parallel_info();
  return out.str();
}

} // namespace wide
