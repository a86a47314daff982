// A CPU caching allocator for wide models' intermediates, active only inside a scope.
// See Note [The wide caching allocator] in caching_allocator.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>

namespace wide::memory {

/// Allocations smaller than this are left to the default allocator (glibc serves them from its heap).
inline constexpr std::size_t kMinBytes = 64 * 1024;

/// Enters (enter=true) or leaves a caching scope on this thread (scopes nest); returns 1 while
/// inside one. Inside, CPU allocations of at least kMinBytes come from and return to the cache.
int64_t caching_scope(bool enter);

/// Bytes held free in the cache, bytes handed out and not yet returned, the limit on the first,
/// the allocations served from the cache (hits) and from the system (misses), and the most bytes
/// handed out at once since the last empty (the peak).
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> cache_stats();

/// Fixes the most free bytes the cache keeps (limit_bytes >= 0; -1 leaves it), or with
/// working_set_limit returns to the default limit (twice the peak, at most 1/16 of the machine's
/// memory, at least 1 GiB); with empty, returns every free block to the system (blocks in use are
/// unaffected) and resets the peak.
void cache_control(int64_t limit_bytes, bool empty, bool working_set_limit);

}  // namespace wide::memory
