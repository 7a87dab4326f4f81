// SlotAllocator: pages are handed out at most once, page 0 never, exhaustion throws and
// allocates nothing, freed pages come back, and a request's token i sits at offset
// i % page_size of its page.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "kvattn/error.h"
#include "kvattn/kv_cache.h"

namespace kvattn {
namespace {

TEST(SlotAllocator, NeverHandsOutAPageTwiceNorPageZero) {
  for (int page_size : {1, 2, 16, 128}) {
    SlotAllocator allocator(64 * page_size, page_size);
    EXPECT_EQ(allocator.num_pages(), 64);
    EXPECT_EQ(allocator.free_page_count(), 63);
    std::set<int32_t> seen;
    for (int64_t count : {1, 5, 20, 37}) {
      for (int32_t p : allocator.allocate_pages(count)) {
        EXPECT_GE(p, 1) << "page 0 is the padding page";
        EXPECT_LT(p, 64);
        EXPECT_TRUE(seen.insert(p).second) << "page " << p << " handed out twice";
      }
    }
    EXPECT_EQ(allocator.free_page_count(), 0);
    EXPECT_EQ(allocator.free_slot_count(), 0);
  }
}

TEST(SlotAllocator, ExhaustionThrowsAndAllocatesNothing) {
  SlotAllocator allocator(16 * 4, 4);
  const std::vector<int32_t> first = allocator.allocate_pages(10);
  EXPECT_EQ(allocator.free_page_count(), 5);
  try {
    allocator.allocate_pages(6);
    FAIL() << "allocated 6 pages out of 5";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources);
    EXPECT_EQ(e.argument(), "count");
  }
  EXPECT_EQ(allocator.free_page_count(), 5) << "a failed allocation took pages";
  // allocate_tokens: 5 free pages hold 20 tokens; 21 must fail and take nothing.
  EXPECT_THROW(allocator.allocate_tokens(0, 0, 21), Error);
  EXPECT_EQ(allocator.free_page_count(), 5);
  // A request whose last page has room for 3 more: 3 + 20 fit, 3 + 21 do not.
  const int32_t last_slot = first[0] * 4;  // offset 0: current_len 1
  EXPECT_THROW(allocator.allocate_tokens(1, last_slot, 24), Error);
  EXPECT_EQ(allocator.free_page_count(), 5);
  EXPECT_EQ(allocator.allocate_tokens(1, last_slot, 23).size(), 23u);
  EXPECT_EQ(allocator.free_page_count(), 0);
  EXPECT_THROW(allocator.allocate_pages(-1), Error);
  EXPECT_TRUE(allocator.allocate_pages(0).empty());
}

TEST(SlotAllocator, FreeAndReallocate) {
  SlotAllocator allocator(32, 1);
  std::vector<int32_t> pages = allocator.allocate_pages(31);
  const std::vector<int32_t> freed(pages.begin() + 10, pages.begin() + 20);
  allocator.free_pages(freed);
  EXPECT_EQ(allocator.free_page_count(), 10);
  std::vector<int32_t> again = allocator.allocate_pages(10);
  std::sort(again.begin(), again.end());
  std::vector<int32_t> expected = freed;
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(again, expected) << "only freed pages may come back";
  // Double free, page 0, an unknown page: throw and free nothing.
  allocator.free_pages(std::vector<int32_t>{again[0]});
  EXPECT_THROW(allocator.free_pages(std::vector<int32_t>{again[1], again[0]}), Error);
  EXPECT_EQ(allocator.free_page_count(), 1) << "a failed free_pages freed something";
  EXPECT_THROW(allocator.free_pages(std::vector<int32_t>{0}), Error);
  EXPECT_THROW(allocator.free_pages(std::vector<int32_t>{32}), Error);
  EXPECT_THROW(allocator.free_pages(std::vector<int32_t>{again[1], again[1]}), Error);
  EXPECT_EQ(allocator.free_page_count(), 1);
  allocator.reset();
  EXPECT_EQ(allocator.free_page_count(), 31);
}

TEST(SlotAllocator, FreeSlotsFreesEachPageOnce) {
  SlotAllocator allocator(8 * 16, 16);
  const std::vector<int32_t> slots = allocator.allocate_tokens(0, 0, 40);  // 3 pages
  EXPECT_EQ(allocator.free_page_count(), 7 - 3);
  allocator.free_slots(slots);
  EXPECT_EQ(allocator.free_page_count(), 7);
}

TEST(SlotAllocator, TokensSitAtTheirOffsetInThePage) {
  std::mt19937 rng(3);
  for (int page_size : {1, 4, 16, 128}) {
    SlotAllocator allocator(int64_t(page_size) * 200, page_size);
    // Three requests growing in interleaved chunks, as an engine's scheduler would.
    std::vector<std::vector<int32_t>> requests(3);
    std::set<int32_t> used;
    for (int round = 0; round < 60; ++round) {
      auto& slots = requests[rng() % 3];
      const int64_t chunk = 1 + rng() % (2 * page_size + 3);
      const int32_t last = slots.empty() ? 0 : slots.back();
      for (int32_t s : allocator.allocate_tokens(int64_t(slots.size()), last, chunk)) {
        EXPECT_TRUE(used.insert(s).second) << "slot " << s << " handed out twice";
        EXPECT_GE(s, page_size) << "slot in the padding page";
        slots.push_back(s);
      }
    }
    for (const auto& slots : requests) {
      for (size_t i = 0; i < slots.size(); ++i) {
        ASSERT_EQ(slots[i] % page_size, int32_t(i % page_size)) << "page_size " << page_size;
        if (i % page_size != 0) {
          ASSERT_EQ(slots[i], slots[i - 1] + 1) << "a page's tokens are contiguous slots";
        }
      }
    }
  }
}

TEST(SlotAllocator, RejectsABadLastSlot) {
  SlotAllocator allocator(16 * 8, 8);
  const std::vector<int32_t> slots = allocator.allocate_tokens(0, 0, 3);
  // current_len 3 means the last token sits at offset 2; offset 1 or a free page is wrong.
  EXPECT_THROW(allocator.allocate_tokens(3, slots[1], 1), Error);
  EXPECT_THROW(allocator.allocate_tokens(3, 15 * 8 + 2, 1), Error);
  EXPECT_EQ(allocator.allocate_tokens(3, slots[2], 1).front(), slots[2] + 1);
}

TEST(SlotAllocator, RejectsBadConstruction) {
  EXPECT_THROW(SlotAllocator(64, 3), Error);
  EXPECT_THROW(SlotAllocator(64, 256), Error);
  EXPECT_THROW(SlotAllocator(60, 8), Error);
  EXPECT_THROW(SlotAllocator(8, 8), Error);  // page 0 alone: nothing to hand out
}

}  // namespace
}  // namespace kvattn
