#include "wide/memory/caching_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <optional>
#include <unordered_map>
#include <mutex>
#include <tuple>

#include <unistd.h>

// Note [The wide caching allocator]
// ---------------------------------
// A wide activation is N times a member's. On glibc a block above the mmap threshold (128 KiB,
// raised as large blocks are freed, up to 32 MiB) is mapped on every allocation and unmapped on
// free, so a call that makes a few MiB of intermediates pays a page fault per 4 KiB page, every
// call (Note [Page faults on wide activations] in python/wide_compiler/allocator.py: the same
// encoder layer ran at 3.8 or 7.4 ms depending on the allocator's state). Raising glibc's
// thresholds (wc.tune_cpu_allocator) fixes it for the whole process; this allocator fixes it for
// the wide model alone:
//  * It wraps the CPU allocator that was installed when first used (c10::SetCPUAllocator).
//    Outside a caching scope, and for blocks under kMinBytes, it forwards to that allocator and
//    the block carries that allocator's own deleter: the process sees no difference.
//  * Inside a scope (thread-local, entered by WideModel around its graph call and, for a train
//    graph, around the backward pass), a request is served from the free blocks of at least its
//    size and at most 5/4 of it (best fit), else newly allocated; the block's deleter returns it
//    to the free list whenever and on whichever thread the tensor dies, so an output handed to a
//    user is reused only after the user drops it. Among free blocks of one size the last freed
//    is reused first (LIFO): it is the one most likely still in the CPU's caches. First-freed
//    first (a multimap's plain insert) made the ResNet-style net's eval graph (N=16, in chunks of
//    4 members) take 10.7 ms instead of 8.7 ms once a train graph had left 16 blocks of each of
//    its sizes in the cache: every call cycled through all of them, cold.
//  * Free blocks are kept up to a limit; a block freed beyond it goes back to the system.
//    empty_cache() releases them all. By default the limit follows the working set: twice the
//    most bytes ever handed out at once (the peak, reset by empty_cache()), at least 1 GiB and
//    at most a sixteenth of the machine's memory. Twice, because blocks are matched by size, so
//    a loop holds more blocks than its peak: ResNet-18's training step at N=16 (SGD) peaks at
//    895 MiB in use and settles at 1120 MiB of blocks, so a fixed 1 GiB freed and page-faulted
//    blocks every step (1-9 of its ~1900 allocations). The cap, because twice the peak of a
//    large model's training step is gigabytes held idle: uncapped, `benchmark real` (several
//    copies of GPT-2-sized models at N=4 in one process) was killed by the kernel at 24 GiB.
//    set_cache_limit(bytes) fixes the limit instead.
//  * Blocks left unused go back to the system: every kAgeScopes exits from an outermost scope
//    (a call, a backward pass; on any thread) the blocks freed kAgeScopes or more exits earlier
//    and not taken since are released. A steady loop takes all its blocks every call, and a few
//    models called in turn (a router's architectures, a train and an eval graph) every few
//    calls, so neither loses any; a model no longer called stops holding memory (blocks sized
//    for one model rarely fit the next).
// Blocks stay mapped and faulted in between calls, which is what the thresholds bought.
namespace wide::memory {
namespace {

struct CacheStats {
  std::size_t cached_bytes, live_bytes, limit_bytes;
  std::int64_t hits, misses;
  std::size_t peak_bytes;
};

constexpr std::size_t kLimitFloor = std::size_t{1} << 30;  // the working-set limit's least value
constexpr std::uint64_t kAgeScopes = 32;  // outermost scope exits a free block may stay unused

struct FreeBlock {
  void* ptr;
  std::uint64_t freed_at;  // the scope-exit count when it was freed
};

thread_local int scope_depth = 0;

class CachingAllocator final : public c10::Allocator {
 public:
  explicit CachingAllocator(c10::Allocator* base) : base_(base), ram_(physical_memory()) {}

  c10::DataPtr allocate(std::size_t n) override {
    if (scope_depth == 0 || n < kMinBytes) return base_->allocate(n);
    std::size_t size = (n + kPage - 1) / kPage * kPage;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= size + size / 4) {
        size = it->first;
        ptr = it->second.ptr;
        free_.erase(it);
        cached_ -= size;
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (ptr == nullptr) ptr = c10::alloc_cpu(size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_bytes_ += size;
      peak_bytes_ = std::max(peak_bytes_, live_bytes_);
      live_.emplace(ptr, size);
    }
    return {ptr, ptr, &CachingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate (oneDNN's scratch memory) goes through allocate(); its pointers come back here.
  c10::DeleterFnPtr raw_deleter() const override { return &CachingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void empty() {
    std::multimap<std::size_t, FreeBlock> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(free_);
      cached_ = 0;
      peak_bytes_ = live_bytes_;
    }
    free_all(drop);
  }

  // An outermost scope ended: every kAgeScopes of them, release the blocks unused since the last.
  void scope_exited() {
    std::multimap<std::size_t, FreeBlock> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (++exits_ % kAgeScopes != 0) return;
      for (auto it = free_.begin(); it != free_.end();) {
        if (it->second.freed_at + kAgeScopes <= exits_) {
          cached_ -= it->first;
          drop.insert(free_.extract(it++));
        } else {
          ++it;
        }
      }
    }
    free_all(drop);
  }

  CacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {cached_, live_bytes_, limit(), hits_, misses_, peak_bytes_};
  }

  // A fixed limit, or (nullopt) the working-set policy.
  void set_limit(std::optional<std::size_t> bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      fixed_limit_ = bytes;
    }
    trim();
  }

  static CachingAllocator* instance;

 private:
  static constexpr std::size_t kPage = 4096;

  static void release(void* ptr) { instance->give_back(ptr); }

  static void free_all(const std::multimap<std::size_t, FreeBlock>& blocks) {
    for (const auto& [size, block] : blocks) c10::free_cpu(block.ptr);
  }

  std::size_t limit() const {  // under mu_
    return fixed_limit_ ? *fixed_limit_ : std::max(kLimitFloor, std::min(2 * peak_bytes_, ram_ / 16));
  }

  void give_back(void* ptr) {
    bool ours = false, keep = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr);
      if (it != live_.end()) {
        ours = true;
        const std::size_t size = it->second;
        live_.erase(it);
        live_bytes_ -= size;
        keep = cached_ + size <= limit();
        if (keep) {
          // first of its size: reused next (LIFO)
          free_.emplace_hint(free_.lower_bound(size), size, FreeBlock{ptr, exits_});
          cached_ += size;
        }
      }
    }
    if (!ours) {
      base_->raw_deleter()(ptr);  // a raw allocation forwarded to the base (outside a scope, or small)
    } else if (!keep) {
      c10::free_cpu(ptr);
    }
  }

  void trim() {
    std::multimap<std::size_t, FreeBlock> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (cached_ > limit() && !free_.empty()) {
        auto it = std::prev(free_.end());  // largest first
        cached_ -= it->first;
        drop.insert(free_.extract(it));
      }
    }
    free_all(drop);
  }

  // The machine's memory in bytes (0 where sysconf cannot say: the limit is then 1 GiB).
  static std::size_t physical_memory() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
#else
    return 0;
#endif
  }

  c10::Allocator* base_;
  const std::size_t ram_;
  std::mutex mu_;
  std::multimap<std::size_t, FreeBlock> free_;      // free blocks by size
  std::unordered_map<void*, std::size_t> live_;      // blocks handed out, by pointer
  std::size_t cached_ = 0, live_bytes_ = 0, peak_bytes_ = 0;
  std::optional<std::size_t> fixed_limit_;           // nullopt: the working-set limit
  std::int64_t hits_ = 0, misses_ = 0;
  std::uint64_t exits_ = 0;                          // outermost scope exits so far
};

CachingAllocator* CachingAllocator::instance = nullptr;

// Installed on first use, never uninstalled: tensors alive anywhere may carry its deleter. The
// instance is leaked on purpose (blocks may be freed during static destruction).
CachingAllocator& allocator() {
  static CachingAllocator* a = [] {
    auto* made = new CachingAllocator(c10::GetCPUAllocator());
    CachingAllocator::instance = made;
    c10::SetCPUAllocator(made, /*priority=*/0);
    return made;
  }();
  return *a;
}

}  // namespace

int64_t caching_scope(bool enter) {
  if (enter) {
    allocator();  // installs it
    ++scope_depth;
  } else {
    TORCH_CHECK(scope_depth > 0, "wide::_caching_scope: left a caching scope that was not entered");
    if (--scope_depth == 0) allocator().scope_exited();
  }
  return scope_depth > 0 ? 1 : 0;
}

std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t> cache_stats() {
  const auto s = allocator().stats();
  return {static_cast<int64_t>(s.cached_bytes), static_cast<int64_t>(s.live_bytes),
          static_cast<int64_t>(s.limit_bytes), s.hits, s.misses, static_cast<int64_t>(s.peak_bytes)};
}

void cache_control(int64_t limit_bytes, bool empty, bool working_set_limit) {
  TORCH_CHECK(limit_bytes >= -1, "wide::_cache_control: expected limit_bytes >= 0 (or -1: unchanged), got ",
              limit_bytes);
  TORCH_CHECK(!(working_set_limit && limit_bytes >= 0),
              "wide::_cache_control: a fixed limit and the working-set limit were both asked for");
  if (limit_bytes >= 0) allocator().set_limit(static_cast<std::size_t>(limit_bytes));
  if (working_set_limit) allocator().set_limit(std::nullopt);
  if (empty) allocator().empty();
}

}  // namespace wide::memory
