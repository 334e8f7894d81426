// Pieces shared by the checkpoint writer (checkpoint.cc) and reader (checkpoint_reader.cc):
// the on-disk names and constants, and a file descriptor owner. Not installed.
#ifndef MORPH_RESHARD_CHECKPOINT_INTERNAL_H_
#define MORPH_RESHARD_CHECKPOINT_INTERNAL_H_

#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>

#include "morph/status.h"

namespace morph::checkpoint_internal {

// Pieces start at a multiple of kAlign bytes in data.bin, and those of kPageAlign bytes or
// more at a multiple of kPageAlign, so that checksum blocks of up to that size (the default)
// begin where a piece's rows do: a loader that needs half of every row then reads only that half.
inline constexpr uint64_t kAlign = 64;
inline constexpr uint64_t kPageAlign = 4096;
// 2: one little-endian CRC32C per block in checksums.bin. 1 (still read): the CRCs inline in
// the manifest, as a JSON array.
inline constexpr int kFormatVersion = 2;
inline constexpr char kDataFileName[] = "data.bin";
inline constexpr char kChecksumFileName[] = "checksums.bin";

// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  Status Close(const std::string& path) {
    const int fd = std::exchange(fd_, -1);
    MORPH_SYSCALL_RETURN_IF_ERROR(::close(fd)) << "closing " << path;
    return Status();
  }

 private:
  int fd_;
};

}  // namespace morph::checkpoint_internal

#endif  // MORPH_RESHARD_CHECKPOINT_INTERNAL_H_
