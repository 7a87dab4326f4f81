// Bad input on the CPU backend: the shared suite (tests/support/bad_input_suite.h) instantiated for
// BackendKind::kCpu, plus the rules that involve no backend (KV cache and allocator settings).
#include "support/bad_input_suite.h"

namespace kvattn::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Cpu, BadInput, ::testing::Values(BackendKind::kCpu), backend_param_name);

TEST(BadKvCacheConfig, NonStorageDtype) {
  KvCacheConfig config;
  config.num_slots = 64;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.dtype = DType::kFloat32;
  try {
    KvCache::allocate(config);
    ADD_FAILURE() << "fp32 KV cache accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "dtype");
  }
}

TEST(BadKvCacheConfig, PageSizes) {
  for (int page_size : {0, 3, 24, 256}) {
    KvCacheConfig config;
    config.num_slots = 1024;
    config.num_kv_heads = 2;
    config.head_dim = 64;
    config.page_size = page_size;
    try {
      KvCache::allocate(config);
      ADD_FAILURE() << "page_size " << page_size << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "page_size");
      EXPECT_NE(std::string(e.what()).find("page_size"), std::string::npos);
    }
    EXPECT_THROW(SlotAllocator(1024, page_size), Error);
  }
  KvCacheConfig config;
  config.num_slots = 100;  // not a multiple of the page size
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.page_size = 16;
  try {
    KvCache::allocate(config);
    ADD_FAILURE() << "num_slots 100 with page_size 16 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "num_slots");
  }
}

}  // namespace
}  // namespace kvattn::testing
