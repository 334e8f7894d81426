// Saving checkpoints: validation, the snapshot, and the background write of a rank's folder
// (checkpoint.h; CheckpointReader is in checkpoint_reader.cc).
#include "reshard/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/check.h"
#include "reshard/checkpoint_internal.h"
#include "reshard/crc32c.h"
#include "reshard/strided_copy.h"

#if MORPH_WITH_CUDA
#include "base/cuda_check.h"
#endif

namespace morph {
namespace {

using namespace checkpoint_internal;  // NOLINT
namespace fs = std::filesystem;
using json = nlohmann::json;

std::string RankDirName(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05d", rank);
  return buf;
}

// Keeps a save's writes at or below `bytes_per_second` (0: no limit): after each write, sleeps
// until the bytes written so far could have been written at that rate since the first one.
// Writes are cut into pieces of a twentieth of a second's worth, so the rate holds within one
// file too.
class WritePacer {
 public:
  explicit WritePacer(uint64_t bytes_per_second) : rate_(bytes_per_second) {}
  size_t Chunk(size_t n) const {
    return rate_ == 0 ? n : std::min<size_t>(n, std::max<uint64_t>(1, rate_ / 20));
  }
  void Wrote(size_t n) {
    if (rate_ == 0) return;
    written_ += n;
    const auto due = start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                  std::chrono::duration<double>(static_cast<double>(written_) /
                                                                static_cast<double>(rate_)));
    std::this_thread::sleep_until(due);
  }

 private:
  uint64_t rate_;
  uint64_t written_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

Status WriteAll(int fd, const char* p, size_t n, const std::string& path,
                WritePacer* pacer = nullptr) {
  while (n > 0) {
    size_t step = std::min<size_t>(n, size_t{1} << 30);
    if (pacer != nullptr) step = pacer->Chunk(step);
    MORPH_ASSIGN_SYSCALL_OR_RETURN(ssize_t w, ::write(fd, p, step), "writing " << path);
    p += w;
    n -= static_cast<size_t>(w);
    if (pacer != nullptr) pacer->Wrote(static_cast<size_t>(w));
  }
  return Status();
}

// Creates `path` with `text` and syncs it.
Status WriteSynced(const std::string& path, const std::string& text, WritePacer& pacer) {
  MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd, ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644),
                                 "creating " << path);
  Fd file(fd);
  MORPH_RETURN_IF_ERROR(WriteAll(file.get(), text.data(), text.size(), path, &pacer));
  MORPH_SYSCALL_RETURN_IF_ERROR(::fsync(file.get())) << "syncing " << path;
  return file.Close(path);
}

Status SyncDir(const std::string& path) {
  MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd, ::open(path.c_str(), O_RDONLY | O_DIRECTORY),
                                 "opening folder " << path);
  Fd dir(fd);
  MORPH_SYSCALL_RETURN_IF_ERROR(::fsync(dir.get())) << "syncing folder " << path;
  return dir.Close(path);
}

// CRC32C of each `block`-byte block of a byte stream fed in arbitrary pieces.
class BlockCrc {
 public:
  explicit BlockCrc(uint64_t block) : block_(block) {}
  void Feed(const char* p, size_t n) {
    while (n > 0) {
      if (in_block_ == 0 && n >= 3 * block_) {  // whole blocks, three chains at a time
        const void* blocks[3] = {p, p + block_, p + 2 * block_};
        uint32_t crcs[3];
        Crc32cEach(blocks, block_, 3, crcs);
        crcs_.insert(crcs_.end(), crcs, crcs + 3);
        p += 3 * block_;
        n -= 3 * block_;
        continue;
      }
      const size_t take = std::min<size_t>(n, block_ - in_block_);
      crc_ = Crc32cExtend(crc_, p, take);
      in_block_ += take;
      p += take;
      n -= take;
      if (in_block_ == block_) Close();
    }
  }
  std::vector<uint32_t> Finish() {
    if (in_block_ > 0) Close();
    return std::move(crcs_);
  }

 private:
  void Close() {
    crcs_.push_back(crc_);
    crc_ = 0;
    in_block_ = 0;
  }
  uint64_t block_;
  uint64_t in_block_ = 0;
  uint32_t crc_ = 0;
  std::vector<uint32_t> crcs_;
};

json ShardToJson(const Shard& s) {
  json frame = json::array();
  for (const Interval& i : s.frame.dims()) frame.push_back({i.begin, i.end});
  return {{"frame", frame}, {"flat_begin", s.flat_begin}, {"flat_end", s.flat_end}};
}

size_t PieceBytes(const CheckpointPiece& p) {
  return static_cast<size_t>(p.shard.NumElements()) *
         static_cast<size_t>(DTypeSize(p.tensor.dtype));
}

Status ValidatePieces(const std::vector<CheckpointPiece>& pieces) {
  std::map<std::string, const TensorInfo*> seen;
  for (const CheckpointPiece& p : pieces) {
    const TensorInfo& t = p.tensor;
    if (!t.padded_shape.empty() && t.padded_shape.size() != t.shape.size()) {
      return InvalidArgumentError("tensor '" + t.name + "' has a padded_shape of rank " +
                                  std::to_string(t.padded_shape.size()) + " and a shape of rank " +
                                  std::to_string(t.shape.size()));
    }
    // Padded tensors: the frame may reach into the padding; only state is saved (WriteRank).
    const Box whole = Box::FromShape(t.frame_shape());
    if (p.shard.frame.rank() != whole.rank() || !whole.Contains(p.shard.frame)) {
      return InvalidArgumentError(
          "piece " + p.shard.ToString() + " of tensor '" + t.name + "' lies outside its " +
          (t.padded_shape.empty() ? "shape " : "padded shape ") + whole.ToString());
    }
    MORPH_ASSIGN_OR_RETURN(int64_t frame_n, p.shard.frame.NumElements());
    if (p.shard.flat_begin < 0 || p.shard.flat_end > frame_n) {
      return InvalidArgumentError("piece " + p.shard.ToString() + " of tensor '" + t.name +
                                  "' has a flat range outside its frame");
    }
    if (p.data.bytes != PieceBytes(p)) {
      return InvalidArgumentError("piece " + p.shard.ToString() + " of tensor '" + t.name +
                                  "' has " + std::to_string(p.data.bytes) +
                                  " bytes, its shard needs " + std::to_string(PieceBytes(p)));
    }
    auto [it, fresh] = seen.emplace(t.name, &t);
    if (!fresh && (it->second->dtype != t.dtype || it->second->shape != t.shape)) {
      return InvalidArgumentError("pieces of tensor '" + t.name + "' disagree on dtype or shape");
    }
  }
  return Status();
}

Status CopyToHost(void* dst, ConstBufferView src) {
  if (src.kind == MemoryKind::kHost) {
    if (src.bytes > 0) std::memcpy(dst, src.data, src.bytes);
    return Status();
  }
#if MORPH_WITH_CUDA
  MORPH_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src.data, src.bytes, cudaMemcpyDeviceToHost))
      << "copying a checkpoint piece to the host";
  return Status();
#else
  return FailedPreconditionError(
      "a checkpoint piece is in CUDA memory but morph was built "
      "without CUDA");
#endif
}

Status WriteRank(const std::string& dir, int rank, int num_ranks, int64_t step, const json& config,
                 const std::vector<CheckpointPiece>& pieces, const std::vector<const char*>& data,
                 uint64_t block_bytes, uint64_t max_bytes_per_second) {
  WritePacer pacer(max_bytes_per_second);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoToStatus(ec.value(), "create_directories(" + dir + ")", __FILE__, __LINE__);
  const std::string final_dir = dir + "/" + RankDirName(rank);
  if (fs::exists(final_dir, ec)) {
    return AlreadyExistsError("checkpoint folder " + final_dir + " already exists");
  }
  static std::atomic<int> counter{0};
  const std::string tmp = dir + "/." + RankDirName(rank) + ".tmp-" + std::to_string(::getpid()) +
                          "-" + std::to_string(counter++);
  MORPH_SYSCALL_RETURN_IF_ERROR(::mkdir(tmp.c_str(), 0755)) << "creating " << tmp;
  auto write = [&]() -> Status {
    const std::string data_path = tmp + "/" + kDataFileName;
    MORPH_ASSIGN_SYSCALL_OR_RETURN(int fd,
                                   ::open(data_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644),
                                   "creating " << data_path);
    Fd file(fd);
    BlockCrc crc(block_bytes);
    json jpieces = json::array();
    std::map<std::string, const TensorInfo*> tensors;
    uint64_t offset = 0;
    static const char kZeros[kPageAlign] = {};
    std::vector<char> packed;
    auto put = [&](const std::string& name, const Shard& shard, const char* bytes,
                   size_t n) -> Status {
      const uint64_t align = n >= kPageAlign ? kPageAlign : kAlign;
      const uint64_t pad = (align - offset % align) % align;
      MORPH_RETURN_IF_ERROR(WriteAll(file.get(), kZeros, pad, data_path, &pacer));
      crc.Feed(kZeros, pad);
      offset += pad;
      MORPH_RETURN_IF_ERROR(WriteAll(file.get(), bytes, n, data_path, &pacer));
      crc.Feed(bytes, n);
      jpieces.push_back(
          {{"tensor", name}, {"shard", ShardToJson(shard)}, {"offset", offset}, {"bytes", n}});
      offset += n;
      return Status();
    };
    for (size_t i = 0; i < pieces.size(); ++i) {
      const CheckpointPiece& p = pieces[i];
      tensors.emplace(p.tensor.name, &p.tensor);
      const Box state = Box::FromShape(p.tensor.shape);
      if (state.Contains(p.shard.frame)) {
        MORPH_RETURN_IF_ERROR(put(p.tensor.name, p.shard, data[i], PieceBytes(p)));
        continue;
      }
      // Padding is not state: save each state box of the piece, packed, as a piece of its own.
      const int es = DTypeSize(p.tensor.dtype);
      for (const Box& b : IntersectShard(p.shard, state)) {
        MORPH_ASSIGN_OR_RETURN(StridedView v, ViewOf(p.shard, b));
        MORPH_ASSIGN_OR_RETURN(CopyGeometry g, MakeCopyGeometry(ContiguousView(b.shape()), v));
        packed.resize(static_cast<size_t>(g.num_elements * es));
        HostStridedCopy(g, packed.data(), data[i], es, 0, g.num_elements);
        MORPH_ASSIGN_OR_RETURN(Shard whole, Shard::Whole(b));
        MORPH_RETURN_IF_ERROR(put(p.tensor.name, whole, packed.data(), packed.size()));
      }
    }
    MORPH_SYSCALL_RETURN_IF_ERROR(::fsync(file.get())) << "syncing " << data_path;
    MORPH_RETURN_IF_ERROR(file.Close(data_path));

    json jtensors = json::array();
    for (const auto& [name, t] : tensors) {
      jtensors.push_back(
          {{"name", name}, {"dtype", std::string(DTypeName(t->dtype))}, {"shape", t->shape}});
    }
    // The block checksums, little-endian, in a file of their own (4 bytes per block: 1 MiB per
    // GiB at the default 4 KiB blocks, which would be ~10 MiB of JSON text in the manifest).
    const std::vector<uint32_t> crcs = crc.Finish();
    std::string crc_bytes(crcs.size() * 4, '\0');
    for (size_t i = 0; i < crcs.size(); ++i) {
      for (int b = 0; b < 4; ++b) crc_bytes[4 * i + b] = static_cast<char>(crcs[i] >> (8 * b));
    }
    MORPH_RETURN_IF_ERROR(WriteSynced(tmp + "/" + kChecksumFileName, crc_bytes, pacer));
    json manifest = {{"format", "morph-checkpoint"},
                     {"version", kFormatVersion},
                     {"rank", rank},
                     {"num_ranks", num_ranks},
                     {"step", step},
                     {"config", config},
                     {"tensors", jtensors},
                     {"pieces", jpieces},
                     {"files", json::array({{{"name", kDataFileName},
                                             {"bytes", offset},
                                             {"block_bytes", block_bytes},
                                             {"checksums", kChecksumFileName}}})}};
    MORPH_RETURN_IF_ERROR(WriteSynced(tmp + "/manifest.json", manifest.dump(1), pacer));
    MORPH_RETURN_IF_ERROR(SyncDir(tmp));
    MORPH_SYSCALL_RETURN_IF_ERROR(::rename(tmp.c_str(), final_dir.c_str()))
        << "renaming " << tmp << " to " << final_dir;
    return SyncDir(dir);
  };
  Status s = write();
  if (!s.ok()) fs::remove_all(tmp, ec);  // best effort; a leftover is harmless to loaders
  return s.WithContext("saving checkpoint rank " + std::to_string(rank) + " to " + dir);
}

class SaveImpl final : public CheckpointSave {
 public:
  SaveImpl(std::string dir, int rank, int num_ranks, int64_t step, json config,
           std::vector<CheckpointPiece> pieces, Buffer snapshot,
           const CheckpointSaveOptions& options) {
    std::vector<const char*> data;
    size_t off = 0;
    for (const CheckpointPiece& p : pieces) {
      if (options.snapshot) {
        data.push_back(static_cast<const char*>(snapshot.data()) + off);
        off += PieceBytes(p);
      } else {
        data.push_back(static_cast<const char*>(p.data.data));
      }
    }
    thread_ =
        std::thread([this, dir = std::move(dir), rank, num_ranks, step, config = std::move(config),
                     pieces = std::move(pieces), snapshot = std::move(snapshot),
                     data = std::move(data), block = options.block_bytes,
                     rate = options.max_bytes_per_second,
                     pool = options.snapshot_pool]() mutable {
          Status s = WriteRank(dir, rank, num_ranks, step, config, pieces, data, block, rate);
          if (pool && snapshot.size() > 0) pool->Give(std::move(snapshot));
          std::lock_guard<std::mutex> lock(mu_);
          status_ = std::move(s);
          done_ = true;
          cv_.notify_all();
        });
  }
  ~SaveImpl() override { thread_.join(); }

  Status Wait(Deadline deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline.when(), [&] { return done_; })) {
      return DeadlineExceededError("checkpoint save still running at its deadline");
    }
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  std::thread thread_;
};
}  // namespace

StatusOr<Buffer> CheckpointSnapshotPool::Take(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kept_.size() >= bytes && kept_.data() != nullptr) return std::move(kept_);
  }
  return HostAllocator()(bytes);
}

void CheckpointSnapshotPool::Give(Buffer buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (buffer.size() >= kept_.size()) kept_ = std::move(buffer);
}

StatusOr<std::unique_ptr<CheckpointSave>> SaveCheckpointAsync(
    const std::string& dir, int rank, int num_ranks, int64_t step, const std::string& config_json,
    const std::vector<CheckpointPiece>& pieces, const CheckpointSaveOptions& options) {
  json config;  // null when there is none
  if (!config_json.empty()) {
    config = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded()) {
      return InvalidArgumentError("checkpoint config_json is not JSON: '" +
                                  config_json.substr(0, 80) + "'");
    }
  }
  if (num_ranks <= 0 || rank < 0 || rank >= num_ranks) {
    return InvalidArgumentError("checkpoint rank " + std::to_string(rank) + " of " +
                                std::to_string(num_ranks) + " is out of range");
  }
  if (options.block_bytes == 0 || options.block_bytes % kAlign != 0) {
    return InvalidArgumentError("checkpoint block_bytes " + std::to_string(options.block_bytes) +
                                " must be a positive multiple of 64");
  }
  MORPH_RETURN_IF_ERROR(ValidatePieces(pieces));
  Buffer snapshot;  // not zero-filled: every byte is overwritten by the copy
  if (options.snapshot) {
    size_t total = 0;
    for (const CheckpointPiece& p : pieces) total += PieceBytes(p);
    if (options.snapshot_pool) {
      MORPH_ASSIGN_OR_RETURN(snapshot, options.snapshot_pool->Take(total), "checkpoint snapshot");
    } else {
      MORPH_ASSIGN_OR_RETURN(snapshot, HostAllocator()(total), "checkpoint snapshot");
    }
    size_t off = 0;
    for (const CheckpointPiece& p : pieces) {
      MORPH_RETURN_IF_ERROR(CopyToHost(static_cast<char*>(snapshot.data()) + off, p.data));
      off += PieceBytes(p);
    }
  } else {
    for (const CheckpointPiece& p : pieces) {
      if (p.data.kind != MemoryKind::kHost) {
        return InvalidArgumentError("piece of tensor '" + p.tensor.name +
                                    "' is in CUDA memory: save it with snapshot = true");
      }
    }
  }
  return std::unique_ptr<CheckpointSave>(
      new SaveImpl(dir, rank, num_ranks, step, config, pieces, std::move(snapshot), options));
}

}  // namespace morph
