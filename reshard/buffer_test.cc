#include "reshard/buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "base/testing.h"

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

std::vector<unsigned char> Pattern(size_t n, int seed) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 13 + seed);
  return v;
}

TEST(MovePagesTest, MovesTheSourceIntoTheDestinationAtAPageAlignedOffset) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer dst, Buffer::MapHost(10 * page + 300));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer src, Buffer::MapHost(3 * page + 77));  // a partial last page
  EXPECT_TRUE(dst.page_mapped());
  const auto d = Pattern(dst.size(), 1), s = Pattern(src.size(), 2);
  std::memcpy(dst.data(), d.data(), d.size());
  std::memcpy(src.data(), s.data(), s.size());
  const size_t offset = 4 * page;
  MORPH_ASSERT_OK(MovePages(src, dst, offset));
  EXPECT_EQ(src.size(), 0u);
  EXPECT_EQ(src.data(), nullptr);
  const auto* got = static_cast<const unsigned char*>(dst.data());
  EXPECT_EQ(std::memcmp(got, d.data(), offset), 0) << "bytes before the offset changed";
  EXPECT_EQ(std::memcmp(got + offset, s.data(), s.size()), 0) << "the moved bytes differ";
  // Bytes past the moved pages are dst's own.
  const size_t after = offset + 4 * page;
  EXPECT_EQ(std::memcmp(got + after, d.data() + after, d.size() - after), 0);
}

TEST(MovePagesTest, RefusesWhatItCannotMove) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer dst, Buffer::MapHost(4 * page));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer src, Buffer::MapHost(2 * page));
  Status s = MovePages(src, dst, 100);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("page-aligned offset"), std::string_view::npos) << s;
  s = MovePages(src, dst, 3 * page);  // past the end
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  std::vector<char> heap(2 * page);
  Buffer adopted = Buffer::Adopt(heap.data(), heap.size(), MemoryKind::kHost, nullptr);
  s = MovePages(adopted, dst, 0);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("page-mapped"), std::string_view::npos) << s;
  EXPECT_EQ(src.size(), 2 * page) << "a refused move changed the source";
  EXPECT_EQ(adopted.size(), heap.size());
}

TEST(MovePagesTest, HostAllocatorMapsLargeBuffersOnly) {
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer big, HostAllocator()(size_t{1} << 20));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer small, HostAllocator()(4096));
  EXPECT_TRUE(big.page_mapped());
  EXPECT_FALSE(small.page_mapped());
  Buffer moved = std::move(big);
  EXPECT_TRUE(moved.page_mapped());
  EXPECT_FALSE(big.page_mapped());  // NOLINT: moved-from is empty
}

TEST(PagePoolTest, NewBuffersTakeTheReleasedPagesFirst) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer a, Buffer::MapHost(3 * page + 5));
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer b, Buffer::MapHost(2 * page));
  std::memset(a.data(), 7, a.size());
  std::memset(b.data(), 9, b.size());
  std::vector<char> heap(page);
  Buffer adopted = Buffer::Adopt(heap.data(), heap.size(), MemoryKind::kHost, nullptr);
  PagePool pool;
  EXPECT_FALSE(pool.Put(adopted));
  EXPECT_EQ(adopted.size(), heap.size());
  ASSERT_TRUE(pool.Put(a));
  ASSERT_TRUE(pool.Put(b));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(pool.bytes(), 6 * page);
  // 5 pages: b's two, then three of a's four; the pool keeps one page.
  size_t recycled = 0;
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer c, pool.Get(5 * page, &recycled));
  EXPECT_EQ(recycled, 5 * page);
  EXPECT_EQ(pool.bytes(), page);
  EXPECT_TRUE(c.page_mapped());
  EXPECT_EQ(ResidentPages(c.data(), c.size()), 5u) << "recycled pages are already faulted in";
  const auto* p = static_cast<const unsigned char*>(c.data());
  EXPECT_EQ(p[0], 9);  // b's pages first
  EXPECT_EQ(p[2 * page], 7);
  std::memset(c.data(), 1, c.size());  // writable throughout
  // More than the pool holds: its last page, then fresh ones.
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer d, pool.Get(3 * page, &recycled));
  EXPECT_EQ(recycled, page);
  EXPECT_EQ(pool.bytes(), 0u);
  std::memset(d.data(), 2, d.size());
  MORPH_ASSERT_OK_AND_ASSIGN(Buffer e, pool.Get(page, &recycled));
  EXPECT_EQ(recycled, 0u);
  pool.Clear();
}

}  // namespace
}  // namespace morph
