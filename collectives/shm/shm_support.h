// Small pieces shared by the same-host shared-memory paths (shm_collectives.h for the Gloo
// communicator's small collectives, shm_channel.h for CommTransport's cross-memory attach):
// which processes may share memory, futex waits and wakes on a word in a shared mapping, and
// peer-death detection through a pidfd. Internal to collectives/ (not installed); header-only.
// Every function may be called from any thread.
#ifndef MORPH_COLLECTIVES_SHM_SUPPORT_H_
#define MORPH_COLLECTIVES_SHM_SUPPORT_H_

#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <fstream>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace morph::shm_support {

inline std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// A hash of what two processes must share to use each other's shared memory and name each
// other's pids: the kernel (boot id), the PID namespace and the user. Equal values: the same
// host as far as shared memory goes.
inline uint64_t HostIdentity() {
  std::string id = ReadFirstLine("/proc/sys/kernel/random/boot_id");
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) == 0) id += "/" + std::to_string(st.st_ino);
  id += "/" + std::to_string(getuid());
  uint64_t h = 14695981039346656037ull;  // FNV-1a
  for (unsigned char c : id) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Sleeps while *word == value, at most `timeout` (spurious wake-ups possible). Shared, not
// FUTEX_PRIVATE: the word may live in memory mapped by several processes.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t value,
                      std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000),
              static_cast<long>(timeout.count() % 1000000000)};
  (void)syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, value, &ts, nullptr, 0);
}

// Wakes every waiter of `word` (after the caller changed it).
inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  (void)syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
                0);
}

// Bumps a doorbell word and wakes its waiters: a waiter that read the old value before it
// slept either sees the new one or is woken.
inline void RingDoorbell(std::atomic<uint32_t>* doorbell) {
  doorbell->fetch_add(1, std::memory_order_release);
  FutexWakeAll(doorbell);
}

// A pidfd for `pid` (readable once the process exited), or -1 (kernel < 5.3, no such pid).
inline int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

// Whether the process behind `pidfd` has exited (false for -1). Never blocks.
inline bool PidfdExited(int pidfd) {
  if (pidfd < 0) return false;
  pollfd pfd{pidfd, POLLIN, 0};
  return poll(&pfd, 1, 0) > 0;
}

// One step of a busy-wait: tells the core (and a hyperthread sibling) that this is a spin.
// 2 MiB: the huge page size ShmArena's segments use, and the alignment of their mappings.
inline constexpr size_t kHugePage = size_t{2} << 20;

// `bytes` of `fd` mapped MAP_SHARED with `prot` at a 2 MiB-aligned address, so that the kernel
// can map a segment's huge pages with one entry each; MAP_FAILED (errno set) on failure.
inline void* MapHugeAligned(int fd, size_t bytes, int prot) {
  void* area = mmap(nullptr, bytes + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (area == MAP_FAILED) return MAP_FAILED;
  const uintptr_t start = reinterpret_cast<uintptr_t>(area);
  const uintptr_t aligned = (start + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
  void* p = mmap(reinterpret_cast<void*>(aligned), bytes, prot, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    munmap(area, bytes + kHugePage);
    return MAP_FAILED;
  }
  if (aligned > start) munmap(area, aligned - start);
  const uintptr_t end = aligned + bytes, area_end = start + bytes + kHugePage;
  if (area_end > end) munmap(reinterpret_cast<void*>(end), area_end - end);
  return p;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace morph::shm_support

#endif  // MORPH_COLLECTIVES_SHM_SUPPORT_H_
