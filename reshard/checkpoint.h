// Layout-free checkpoints of sharded tensors. Each participant saves the pieces it holds (a
// Shard of a tensor plus its bytes) asynchronously; any set of processes, in any parallel
// configuration, can later load any shard of any tensor, reading only the byte ranges of the
// saved pieces that intersect it (rounded to checksum blocks), possibly from several files.
//
//   // every rank (no communicator needed):
//   MORPH_ASSIGN_OR_RETURN(auto save, SaveCheckpointAsync("/ckpt/step-100", rank, world,
//                                                          /*step=*/100, R"({"tp": 4})", pieces));
//   ... keep training (pieces were snapshotted) ...
//   MORPH_RETURN_IF_ERROR(save->Wait(Deadline::AfterMs(600000)));
//   // later, in another configuration:
//   MORPH_ASSIGN_OR_RETURN(CheckpointReader ckpt, CheckpointReader::Open("/ckpt/step-100"));
//   MORPH_RETURN_IF_ERROR(ckpt.Read("layers.3.mlp.w1", DType::kF32, my_new_shard, buf.view()));
//
// On disk (docs/reshard-executor.md has the details):
//   <dir>/rank-00003/data.bin        the rank's pieces back to back, 64-byte aligned (4 KiB
//                                    aligned if 4 KiB or larger)
//   <dir>/rank-00003/checksums.bin   one CRC32C per block of data.bin (little-endian u32)
//   <dir>/rank-00003/manifest.json   tensors, pieces (shard, offset), step, config, file size
//                                    and block size
// Atomicity: a rank writes into <dir>/.rank-00003.tmp-<pid>-<n>/, fsyncs both files and the
// folder, renames it to rank-00003 and fsyncs <dir>. A checkpoint is complete when rank-r
// folders exist for every r in [0, num_ranks) and agree on step and num_ranks; Open rejects
// anything else, so a save killed midway never loads as complete.
#ifndef MORPH_RESHARD_CHECKPOINT_H_
#define MORPH_RESHARD_CHECKPOINT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "reshard/buffer.h"
#include "reshard/local_plan.h"

namespace morph {

// One piece to save: `data` holds the shard's elements (shard.NumElements() * dtype size
// bytes). Host memory, or CUDA memory in CUDA builds (copied to the host snapshot first).
// A padded tensor (tensor.padded_shape set) may have a shard reaching into the padding: only
// its state (the elements inside tensor.shape) is saved, so a checkpoint never holds padding
// and loads into any tp, whatever its padded size.
struct CheckpointPiece {
  TensorInfo tensor;
  Shard shard;
  ConstBufferView data;
};

// Keeps the host snapshot buffer of a finished save for the next one. Checkpoints recur, and
// a fresh buffer's first-touch page faults cost as much as the snapshot copy itself, so a
// training loop passes the same pool to every save. Holds at most one buffer (memory: one copy
// of this rank's saved bytes). Thread-safe.
class CheckpointSnapshotPool {
 public:
  // A kept buffer of at least `bytes` (contents undefined), else a fresh host allocation.
  // kResourceExhausted naming the size if the allocation fails.
  StatusOr<Buffer> Take(size_t bytes);
  // Keeps `buffer` for the next Take (replacing a smaller kept one).
  void Give(Buffer buffer);

 private:
  std::mutex mu_;
  Buffer kept_;
};

struct CheckpointSaveOptions {
  // Copy the pieces into memory owned by the save before returning, so the caller may change
  // its buffers at once. Without it, buffers must stay unchanged until Wait returns.
  bool snapshot = true;
  // Where the snapshot buffer comes from and goes back to once the write ends; null: a fresh
  // allocation per save, freed when the write ends.
  std::shared_ptr<CheckpointSnapshotPool> snapshot_pool;
  // Bytes covered by one checksum (a positive multiple of 64); also the granularity at which
  // loads read and verify. A page by default: a load that keeps only part of each row of a saved
  // piece (another TP split) reads little more than it keeps, and the checksums take 1/1024 of
  // the data (in their own file).
  uint64_t block_bytes = 4096;
  // The most bytes per second the write may put into files (data and manifest; 0: no limit),
  // so that a background save does not take a shared disk or file system from training or
  // other jobs. A save takes at least its bytes / this rate.
  uint64_t max_bytes_per_second = 0;
};

class CheckpointSave {
 public:
  virtual ~CheckpointSave() = default;  // waits for the write to end
  // OK once this rank's part is durable (renamed into place and synced); the write's error
  // (kAlreadyExists if this rank's folder exists, kResourceExhausted disk full, kInternal...)
  // otherwise; kDeadlineExceeded if it is still running at `deadline` (Wait may be called
  // again). Any thread.
  virtual Status Wait(Deadline deadline) = 0;
};

// Starts saving this rank's pieces under `dir` (created if missing). Returns at once, after
// the snapshot copy. `config_json` is stored in every manifest: JSON text (e.g. the parallel
// configuration), or empty for none. kInvalidArgument (naming tensor and field): rank outside
// [0, num_ranks), a `config_json` that does not parse as JSON,
// a piece whose shard lies outside its tensor's shape, whose buffer size differs from the
// shard's, or whose tensor metadata disagrees with another piece of the same name. Called by
// any one thread per rank; ranks need not coordinate.
StatusOr<std::unique_ptr<CheckpointSave>> SaveCheckpointAsync(
    const std::string& dir, int rank, int num_ranks, int64_t step, const std::string& config_json,
    const std::vector<CheckpointPiece>& pieces, const CheckpointSaveOptions& options = {});

class CheckpointReader {
 public:
  // Reads and checks every rank's manifest. kNotFound: no such folder. kFailedPrecondition:
  // the checkpoint is incomplete (a rank's folder is missing: its save was interrupted or
  // never ran; leftover temporary folders are named). kDataLoss: an unreadable manifest, a
  // data file whose size differs from its manifest (truncated), ranks that disagree on step,
  // num_ranks or a tensor's dtype/shape, or saved pieces that overlap or do not cover a tensor
  // (naming the tensor and the first box no piece holds).
  static StatusOr<CheckpointReader> Open(const std::string& dir);

  int64_t step() const { return step_; }
  int num_ranks() const { return num_ranks_; }
  // The config_json of the save, as compact JSON text (keys sorted); empty if it had none.
  const std::string& config_json() const { return config_json_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  // Fills `dst` (shard.NumElements() * dtype size bytes, host or CUDA) with the elements of
  // `shard` of tensor `name`, reading only the checksum blocks that hold them, each once, and
  // verifying every one: an OK Read gave only verified bytes. kNotFound: unknown tensor.
  // kInvalidArgument: dtype differs from the saved one, shard outside the tensor, wrong buffer
  // size. kDataLoss naming the file: checksum mismatch or short read (then `dst` may hold part
  // of the bad data: do not use it). The data files are mapped read-only (the page cache's
  // pages, no copy); a block the shard needs whole is verified in the pass that copies it, the
  // others are verified, then re-sliced while in cache (docs/reshard-executor.md,
  // "Checkpoints"). A file shorter than its manifest says is kDataLoss, but one that another
  // process truncates during the Read raises SIGBUS.
  // Const and thread-safe: several threads may read concurrently.
  Status Read(const std::string& name, DType dtype, const Shard& shard, BufferView dst) const;
  // Same, for `tensor` (name, dtype) of a plan (local_plan.h TensorInfo): with a padded_shape,
  // `shard` may reach into the padding (up to padded_shape, which must contain the saved
  // shape); its padding elements are zero-filled, its state read as above.
  Status Read(const TensorInfo& tensor, const Shard& shard, BufferView dst) const;

  // Reads every data file once, whole, and checks every block against its checksum: what a
  // Read of every saved byte would check, without a destination. OK when all verify; kDataLoss
  // naming the file and block of the first mismatch (as Read does), or a file shorter than its
  // manifest. Costs one sequential read of the checkpoint's data (the files are mapped, 16 MiB
  // at a time). Const and thread-safe.
  Status Verify() const;

  // Bytes read from files so far (all Read and Verify calls).
  int64_t bytes_read() const { return *bytes_read_; }

 private:
  Status ReadImpl(const std::string& name, DType dtype, const Shard& shard, BufferView dst,
                  const std::vector<int64_t>* padded_shape) const;
  struct Piece {
    int file = 0;
    Shard shard;
    uint64_t offset = 0;  // in the file
  };
  struct File {
    std::string path;
    uint64_t bytes = 0;
    uint64_t block_bytes = 0;
    uint64_t blocks = 0;
    std::string crc_path;        // checksums.bin (format 2), read as loads need them
    std::vector<uint32_t> crc;   // format 1: from the manifest
  };
  std::string dir_;
  int64_t step_ = 0;
  int num_ranks_ = 0;
  std::string config_json_;
  std::vector<TensorInfo> tensors_;
  std::vector<std::vector<Piece>> pieces_;  // by tensor index
  std::vector<File> files_;
  std::shared_ptr<std::atomic<int64_t>> bytes_read_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace morph

#endif  // MORPH_RESHARD_CHECKPOINT_H_
