#include "reshard/buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace morph {
namespace {

// Pages of [p, p + bytes) that are resident now (mincore), after aligning the start down.
size_t ResidentPages(void* p, size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  std::vector<unsigned char> vec((end - begin) / page);
  EXPECT_EQ(mincore(reinterpret_cast<void*>(begin), end - begin, vec.data()), 0);
  size_t n = 0;
  for (unsigned char c : vec) n += c & 1;
  return n;
}

TEST(PrefaultHostTest, MakesEveryPageOfAFreshMappingResident) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 64 * page + 123;  // not a whole number of pages
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(ResidentPages(p, bytes), 0u);  // a fresh anonymous mapping: nothing faulted yet
  ASSERT_TRUE(PrefaultHost({p, bytes, MemoryKind::kHost}).ok());
  EXPECT_EQ(ResidentPages(p, bytes), 65u);
  munmap(p, bytes);
}

TEST(PrefaultHostTest, KeepsTheContentsOfAnUnalignedBuffer) {
  // A buffer that shares its first and last page with other data: those bytes stay as they are.
  std::vector<unsigned char> data(3 * 4096 + 100);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 1);
  const std::vector<unsigned char> before = data;
  ASSERT_TRUE(PrefaultHost({data.data() + 5, data.size() - 10, MemoryKind::kHost}).ok());
  EXPECT_EQ(data, before);
}

TEST(PrefaultHostTest, EmptyIsOkAndCudaIsRejected) {
  EXPECT_TRUE(PrefaultHost({nullptr, 0, MemoryKind::kHost}).ok());
  int x = 0;
  const Status s = PrefaultHost({&x, sizeof(x), MemoryKind::kCuda});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cuda"), std::string_view::npos) << s.ToString();
}

TEST(PrefaultHostTest, HostAllocatorBufferIsResidentAfterPrefault) {
  auto b = HostAllocator()(size_t{8} << 20);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(PrefaultHost(b->view()).ok());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_GE(ResidentPages(b->data(), b->size()), (size_t{8} << 20) / page);
}

}  // namespace
}  // namespace morph
