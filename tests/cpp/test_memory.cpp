// Note [The wide caching allocator] (csrc/wide/memory/caching_allocator.cpp): scoped reuse of
// large CPU blocks, everything else forwarded to the allocator installed before it.
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <thread>

#include "wide/memory/caching_allocator.h"

namespace {

constexpr int64_t kFloats = 1 << 18;  // 1 MiB

int64_t live() { return std::get<1>(wide::memory::cache_stats()); }
int64_t hits() { return std::get<3>(wide::memory::cache_stats()); }

struct Scope {
  Scope() { wide::memory::caching_scope(true); }
  ~Scope() { wide::memory::caching_scope(false); }
};

TEST(WideMemory, ScopedBlocksAreReusedAndOthersForwarded) {
  wide::memory::cache_control(-1, /*empty=*/true, /*working_set_limit=*/false);
  const int64_t base = live();
  {
    Scope scope;
    at::Tensor a = at::empty({kFloats});
    EXPECT_EQ(live(), base + 4 * kFloats);
    void* ptr = a.data_ptr();
    a.reset();
    const int64_t before = hits();
    at::Tensor b = at::empty({kFloats - 64});  // best fit: within 5/4 of the request
    EXPECT_EQ(b.data_ptr(), ptr);
    EXPECT_EQ(hits(), before + 1);
    at::Tensor small = at::empty({16});  // under kMinBytes: the default allocator's
    EXPECT_EQ(live(), base + 4 * kFloats);
  }
  EXPECT_EQ(live(), base);
  at::Tensor outside = at::empty({kFloats});
  EXPECT_EQ(live(), base);  // outside a scope: forwarded
}

TEST(WideMemory, TheLastFreedBlockOfASizeIsReusedFirst) {
  // LIFO: the block most likely still in the CPU's caches (Note [The wide caching allocator]).
  Scope scope;
  at::Tensor a = at::empty({kFloats}), b = at::empty({kFloats}), c = at::empty({kFloats});
  void* second = b.data_ptr();
  a.reset();
  b.reset();
  c.reset();  // freed last, reused first
  void* third = nullptr;
  {
    at::Tensor again = at::empty({kFloats});
    third = again.data_ptr();
  }
  at::Tensor x = at::empty({kFloats}), y = at::empty({kFloats});
  EXPECT_EQ(x.data_ptr(), third);
  EXPECT_EQ(y.data_ptr(), second);
}

TEST(WideMemory, RawAllocationsRoundTrip) {
  // oneDNN's scratch memory comes through raw_allocate/raw_deallocate, inside and outside a scope.
  c10::Allocator* alloc = c10::GetCPUAllocator();
  void* outside = alloc->raw_allocate(4 * kFloats);
  {
    Scope scope;
    void* inside = alloc->raw_allocate(4 * kFloats);
    alloc->raw_deallocate(inside);
  }
  alloc->raw_deallocate(outside);
  SUCCEED();
}

TEST(WideMemory, ScopesArePerThreadAndBalanced) {
  Scope scope;
  const int64_t base = live();
  std::thread other([] { at::Tensor t = at::empty({kFloats}); });
  other.join();
  EXPECT_EQ(live(), base);
  wide::memory::caching_scope(true);
  EXPECT_EQ(wide::memory::caching_scope(false), 1);  // the outer scope is still open
}

TEST(WideMemory, LimitAndErrors) {
  wide::memory::cache_control(0, false, false);
  {
    Scope scope;
    at::Tensor t = at::empty({kFloats});
  }
  EXPECT_EQ(std::get<0>(wide::memory::cache_stats()), 0);
  wide::memory::cache_control(int64_t{1} << 30, false, false);
  EXPECT_EQ(std::get<2>(wide::memory::cache_stats()), int64_t{1} << 30);
  wide::memory::cache_control(-1, false, /*working_set_limit=*/true);  // the default again
  EXPECT_GE(std::get<2>(wide::memory::cache_stats()), int64_t{1} << 30);

  EXPECT_THROW(wide::memory::cache_control(-2, false, false), c10::Error);
  EXPECT_THROW(wide::memory::cache_control(0, false, true), c10::Error);
  EXPECT_THROW(wide::memory::caching_scope(false), c10::Error);
}

}  // namespace
