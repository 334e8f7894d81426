#include "collectives/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "base/cuda_check.h"
#include "base/nccl_check.h"

namespace morph {
namespace {

constexpr auto kPoll = std::chrono::microseconds(100);

ncclDataType_t ToNccl(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
    case DType::kU8:
      return ncclUint8;
    case DType::kI8:
      return ncclInt8;
  }
  return ncclUint8;
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// How long the destructor of a healthy communicator lets ncclCommFinalize flush before it
// aborts instead: teardown must not block the caller for a finalize timeout.
constexpr auto kFinalizeGrace = std::chrono::milliseconds(200);
// How long Wait, after a failure or Abort(), lets the revoked communicator's kernels leave
// the buffers before it releases the communicator with ncclCommAbort.
constexpr auto kQuiesceGrace = std::chrono::milliseconds(500);

}  // namespace

bool CudaDeviceAvailable(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why != nullptr) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  if (n == 0) {
    if (why != nullptr) *why = "cudaGetDeviceCount: no CUDA device";
    return false;
  }
  return true;
}

// The state shared by a communicator and its Works. Every NCCL call on `comm_` is made with
// `mu_` held (the owner mutex), and every such call is non-blocking (returns at once or with
// ncclInProgress), so `mu_` is only ever held briefly: Abort() from any thread takes it,
// which is what lets it act on an operation in progress without racing another NCCL call.
class NcclCommunicator::Impl {
 public:
  enum class State : uint8_t {
    kLive,      // usable
    kRevoked,   // failed or aborted: ncclCommRevoke stops its kernels; kept for Shrink
    kReleased,  // ncclCommAbort or ncclCommDestroy returned: no kernel of it runs any more
  };

  Impl(std::string name, int rank, int size, int64_t generation, int device)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        generation_(generation),
        device_(device) {}

  ~Impl() {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseLocked();
    FreeResources();
  }

  std::string Describe() const {
    return "nccl communicator '" + name_ + "' generation " + std::to_string(generation_) +
           " rank " + std::to_string(rank_) + "/" + std::to_string(size_);
  }

  // Records `why` (the first error wins) and stops the communicator: ncclCommRevoke, so that
  // its kernels exit while the communicator stays valid for Shrink(kFailure); ncclCommAbort if
  // revoking fails. Returns the communicator's error.
  const Status& FailLocked(const Status& why) {
    if (error_.ok()) error_ = why;
    broken_.store(true);
    if (state_ == State::kLive && comm_ != nullptr) {
      cudaSetDevice(device_);
      ncclResult_t r = ncclCommRevoke(comm_, NCCL_REVOKE_DEFAULT);
      if (r == ncclSuccess || r == ncclInProgress) {
        state_ = State::kRevoked;
      } else {
        AbortCommLocked();
      }
    }
    return error_;
  }

  // ncclCommAbort: kernels exit, resources go. Never ncclCommDestroy after a failure.
  void AbortCommLocked() {
    if (state_ != State::kReleased && comm_ != nullptr) {
      cudaSetDevice(device_);
      ncclCommAbort(comm_);
    }
    state_ = State::kReleased;
    broken_.store(true);
  }

  // True once no kernel of this communicator can still touch a buffer: released, or revoked
  // and quiescent (its async state back to ncclSuccess).
  bool QuiescentLocked() {
    if (state_ == State::kReleased) return true;
    if (state_ == State::kLive) return false;
    ncclResult_t st = ncclInProgress;
    ncclResult_t q = ncclCommGetAsyncError(comm_, &st);
    if (q == ncclSuccess && st == ncclSuccess) return true;
    if (q == ncclSuccess && st == ncclInProgress) return false;
    AbortCommLocked();  // cannot tell: make sure
    return true;
  }

  // The error a call must return now, or OK: "destroyed" once the NcclCommunicator is gone, a
  // pending Abort() turned into a failure, or the first error.
  Status CheckLocked() {
    if (destroyed_) {
      return FailedPreconditionError(Describe() + ": communicator destroyed");
    }
    if (abort_requested_.load() && error_.ok()) {
      FailLocked(AbortedError(Describe() + ": aborted (Abort() called)")
                     .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}}));
    }
    if (broken_.load()) return error_;
    return Status::Ok();
  }

  // What Settle watches besides `comm`'s own state.
  enum class Watch : uint8_t {
    kThis,          // `comm` is comm_: its failure or a pending Abort() ends the wait
    kChild,         // a child being split from comm_: a pending Abort() ends the wait
    kChildOfShrink  // a shrunk child: nothing (the parent is failed or aborted by design)
  };

  // Polls `comm` until it leaves ncclInProgress after a non-blocking call that returned `r`.
  // Takes `mu_` for each poll only, so Abort() (or a failure seen by another thread) reaches
  // it between polls. Errors are returned, not recorded: the caller decides what fails.
  Status Settle(ncclComm_t comm, Watch watch, ncclResult_t r, const char* what, Deadline deadline,
                const BuildCancel* cancel = nullptr) {
    if (r != ncclSuccess && r != ncclInProgress) {
      std::lock_guard<std::mutex> lock(mu_);
      return NcclToStatus(r, what, __FILE__, __LINE__, comm);
    }
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (watch == Watch::kThis) {
          MORPH_RETURN_IF_ERROR(CheckLocked());
        }
        if (watch == Watch::kChild && abort_requested_.load()) {
          return AbortedError(std::string(what) + ": aborted (Abort() called)")
              .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}});
        }
        if (cancel != nullptr && cancel->cancelled()) {
          return AbortedError(std::string(what) + ": cancelled (BuildCancel)")
              .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}});
        }
        ncclResult_t state = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(comm, &state);
        if (q != ncclSuccess) {
          return NcclToStatus(q, "ncclCommGetAsyncError", __FILE__, __LINE__, comm);
        }
        if (state == ncclSuccess) return Status::Ok();
        if (state != ncclInProgress) return RemoteFailure(state, what, comm);
      }
      if (deadline.Expired()) {
        return DeadlineExceededError(std::string(what) + ": did not finish in time")
            .WithCollectiveFailure({CollectiveFailure::Kind::kTimeout, {}});
      }
      std::this_thread::sleep_for(kPoll);
    }
  }

  // An NCCL async error as Status, typed: NCCL does not say which peer failed.
  static Status RemoteFailure(ncclResult_t state, const char* what, ncclComm_t comm) {
    Status s = NcclToStatus(state, what, __FILE__, __LINE__, comm);
    if (s.code() != StatusCode::kUnavailable) return s;
    return s.WithCollectiveFailure({CollectiveFailure::Kind::kRemoteError, {}});
  }

  // Teardown. A healthy communicator: ncclCommFinalize (non-blocking), polled for at most
  // kFinalizeGrace, then ncclCommDestroy; if the flush takes longer (operations still
  // waiting for peers), ncclCommAbort instead, so the caller never waits for a finalize
  // timeout. A revoked or failed one: ncclCommAbort.
  void ReleaseLocked() {
    if (comm_ == nullptr || state_ == State::kReleased) {
      state_ = State::kReleased;
      return;
    }
    cudaSetDevice(device_);
    if (state_ == State::kLive && !broken_.load() && !abort_requested_.load()) {
      ncclResult_t r = ncclCommFinalize(comm_);
      bool flushed = r == ncclSuccess;
      if (r == ncclInProgress) {
        Deadline grace = Deadline::After(kFinalizeGrace);
        while (true) {
          ncclResult_t st = ncclInProgress;
          if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) break;
          if (st == ncclSuccess) {
            flushed = true;
            break;
          }
          if (st != ncclInProgress || grace.Expired()) break;
          std::this_thread::sleep_for(kPoll);
        }
      }
      if (flushed) {
        ncclCommDestroy(comm_);
        state_ = State::kReleased;
        return;
      }
    }
    AbortCommLocked();
  }

  // After the NCCL communicator exists: stream and scratch space for barriers.
  Status InitResources() {
    MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    MORPH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MORPH_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(int32_t)));
    return Status::Ok();
  }

  // Only once no kernel of the communicator runs (state kReleased).
  void FreeResources() {
    cudaSetDevice(device_);
    if (scratch_ != nullptr) {
      cudaFree(scratch_);
      scratch_ = nullptr;
    }
    if (stream_ != nullptr) {
      cudaStreamDestroy(stream_);
      stream_ = nullptr;
    }
  }

  Status CheckDeviceBuffer(const void* p, std::string_view what) {
    if (p == nullptr) return Status::Ok();
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return InvalidArgumentError(std::string(what) + " is not a CUDA pointer");
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      return InvalidArgumentError(std::string(what) +
                                  " is host memory; the NCCL backend needs device memory");
    }
    return Status::Ok();
  }

  // Enqueues `op` on `stream` with `mu_` held (the calls return at once: non-blocking
  // communicator). ncclInProgress is left to Settle.
  ncclResult_t EnqueueLocked(const CollectiveOp& op, cudaStream_t stream, const char** what,
                             Status* early) {
    const ncclDataType_t dt = ToNccl(op.dtype);
    switch (op.kind) {
      case CollectiveOp::Kind::kAllreduce:
        *what = "ncclAllReduce";
        if (op.count == 0) return ncclSuccess;
        return ncclAllReduce(op.recv, op.recv, op.count, dt, ToNccl(op.reduce), comm_, stream);
      case CollectiveOp::Kind::kBroadcast:
        *what = "ncclBroadcast";
        if (op.count == 0) return ncclSuccess;
        return ncclBroadcast(op.recv, op.recv, op.count, dt, op.root, comm_, stream);
      case CollectiveOp::Kind::kAllgather:
        *what = "ncclAllGather";
        if (op.count == 0) return ncclSuccess;
        return ncclAllGather(op.send, op.recv, op.count, dt, comm_, stream);
      case CollectiveOp::Kind::kReduceScatter:
        *what = "ncclReduceScatter";
        if (op.count == 0) return ncclSuccess;
        return ncclReduceScatter(op.send, op.recv, op.count, dt, ToNccl(op.reduce), comm_, stream);
      case CollectiveOp::Kind::kBarrier:
        *what = "barrier (ncclAllReduce of one int)";
        return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream);
      case CollectiveOp::Kind::kSendRecv: {
        *what = "ncclGroupEnd (send/recv)";
        ncclResult_t g = ncclGroupStart();
        if (g != ncclSuccess) {
          *early = NcclToStatus(g, "ncclGroupStart", __FILE__, __LINE__, comm_);
          return g;
        }
        for (const P2POp& p : op.p2p) {
          if (p.bytes == 0) continue;
          ncclResult_t e = p.kind == P2POp::Kind::kSend
                               ? ncclSend(p.data, p.bytes, ncclUint8, p.peer, comm_, stream)
                               : ncclRecv(p.data, p.bytes, ncclUint8, p.peer, comm_, stream);
          if (e != ncclSuccess && e != ncclInProgress) {
            *early = NcclToStatus(e, p.kind == P2POp::Kind::kSend ? "ncclSend" : "ncclRecv",
                                  __FILE__, __LINE__, comm_);
            ncclGroupEnd();
            return e;
          }
        }
        return ncclGroupEnd();
      }
    }
    return ncclSuccess;
  }

  const std::string name_;
  const int rank_;
  const int size_;
  const int64_t generation_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::atomic<bool> abort_requested_{false};
  std::atomic<bool> broken_{false};  // written under mu_; read anywhere

  std::mutex mu_;  // the owner mutex: every NCCL call on comm_, and the fields below
  ncclComm_t comm_ = nullptr;
  State state_ = State::kLive;
  bool destroyed_ = false;  // the NcclCommunicator is gone; Works may still exist
  Status error_;            // the first error; every later call returns it
};

namespace {

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator::Impl> comm, cudaEvent_t event)
      : comm_(std::move(comm)), event_(event) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  Status Wait(Deadline deadline) override {
    if (result_) return *result_;
    result_ = Poll(deadline);
    return *result_;
  }

  // True once the operation's event completed, or the communicator is released (ncclCommAbort
  // or ncclCommDestroy returned) or revoked and quiescent: no kernel touches the buffers.
  bool Done() const override {
    if (result_) return true;
    if (event_ == nullptr || cudaEventQuery(event_) == cudaSuccess) return true;
    std::lock_guard<std::mutex> lock(comm_->mu_);
    return comm_->QuiescentLocked();
  }

 private:
  Status Poll(Deadline deadline) {
    while (true) {
      Status failed;
      {
        std::lock_guard<std::mutex> lock(comm_->mu_);
        if (comm_->destroyed_) {
          return FailedPreconditionError(comm_->Describe() +
                                         ": communicator destroyed before Wait");
        }
        failed = comm_->CheckLocked();
        if (failed.ok()) {
          ncclResult_t state = ncclSuccess;
          ncclResult_t q = ncclCommGetAsyncError(comm_->comm_, &state);
          if (q != ncclSuccess) {
            failed = comm_->FailLocked(
                NcclToStatus(q, "ncclCommGetAsyncError", __FILE__, __LINE__, comm_->comm_)
                    .WithContext(comm_->Describe()));
          } else if (state != ncclSuccess && state != ncclInProgress) {
            failed = comm_->FailLocked(
                NcclCommunicator::Impl::RemoteFailure(state, "NCCL async error", comm_->comm_)
                    .WithContext(comm_->Describe()));
          }
        }
      }
      if (!failed.ok()) return AfterFailure(failed);
      cudaError_t e = event_ == nullptr ? cudaSuccess : cudaEventQuery(event_);
      if (e == cudaSuccess) return Status::Ok();
      if (e != cudaErrorNotReady) {
        std::lock_guard<std::mutex> lock(comm_->mu_);
        failed = comm_->FailLocked(
            CudaToStatus(e, "cudaEventQuery", __FILE__, __LINE__).WithContext(comm_->Describe()));
      } else if (deadline.Expired()) {
        std::lock_guard<std::mutex> lock(comm_->mu_);
        failed = comm_->FailLocked(
            DeadlineExceededError(comm_->Describe() + ": operation did not finish in time")
                .WithCollectiveFailure({CollectiveFailure::Kind::kTimeout, {}}));
      }
      if (!failed.ok()) return AfterFailure(failed);
      std::this_thread::sleep_for(kPoll);
    }
  }

  // The buffers must be free of NCCL's kernels before Wait returns (the caller may free them):
  // waits for the revoked communicator to quiesce, then releases it with ncclCommAbort.
  Status AfterFailure(const Status& failed) {
    Deadline grace = Deadline::After(kQuiesceGrace);
    while (true) {
      if (event_ == nullptr || cudaEventQuery(event_) == cudaSuccess) return failed;
      {
        std::lock_guard<std::mutex> lock(comm_->mu_);
        if (comm_->QuiescentLocked()) return failed;
        if (grace.Expired()) {
          comm_->AbortCommLocked();
          return failed;
        }
      }
      std::this_thread::sleep_for(kPoll);
    }
  }

  std::shared_ptr<NcclCommunicator::Impl> comm_;
  cudaEvent_t event_;
  std::optional<Status> result_;
};

// Rank and size of a new NCCL communicator, checked.
Status QueryRankAndSize(ncclComm_t comm, int* rank, int* size) {
  MORPH_NCCL_RETURN_IF_ERROR(ncclCommUserRank(comm, rank));
  MORPH_NCCL_RETURN_IF_ERROR(ncclCommCount(comm, size));
  return Status::Ok();
}

}  // namespace

namespace {

// The unique id rank 0 published, waited for in slices so that `cancel` ends the wait.
StatusOr<std::string> GetUniqueId(Store& store, const std::string& key, Deadline deadline,
                                  const BuildCancel* cancel) {
  while (true) {
    if (cancel != nullptr && cancel->cancelled()) {
      return AbortedError("waiting for the unique id: cancelled (BuildCancel)");
    }
    const Deadline slice = cancel ? Min(deadline, Deadline::AfterMs(100)) : deadline;
    StatusOr<std::string> got = store.Get(key, slice);
    if (got.ok() || got.status().code() != StatusCode::kDeadlineExceeded || deadline.Expired()) {
      return got;
    }
  }
}

}  // namespace

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    Store& store, std::string_view name, int rank, int size, int cuda_device, Deadline deadline,
    const BuildCancel* cancel) {
  if (cancel != nullptr && cancel->cancelled()) {
    return AbortedError("nccl communicator '" + std::string(name) + "': cancelled (BuildCancel)");
  }
  if (name.empty()) return InvalidArgumentError("nccl communicator name is empty");
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgumentError("nccl communicator '" + std::string(name) + "': rank " +
                                std::to_string(rank) + " of size " + std::to_string(size) +
                                " out of range");
  }
  std::string why;
  if (!CudaDeviceAvailable(&why)) return UnavailableError("nccl communicator: " + why);
  auto impl =
      std::make_shared<Impl>(std::string(name), rank, size, store.generation(), cuda_device);
  MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(cuda_device)) << impl->Describe();
  // A fresh unique id per communicator and generation, handed out through the store.
  const std::string key = "nccl/" + std::string(name) + "/id";
  ncclUniqueId id;
  if (rank == 0) {
    MORPH_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id)) << impl->Describe();
    MORPH_RETURN_IF_ERROR(
        store.Set(key, std::string_view(id.internal, sizeof(id.internal)), deadline))
        << impl->Describe();
  } else {
    MORPH_ASSIGN_OR_RETURN(std::string bytes, GetUniqueId(store, key, deadline, cancel),
                           impl->Describe());
    if (bytes.size() != sizeof(id.internal)) {
      return InternalError(impl->Describe() + ": unique id of " + std::to_string(bytes.size()) +
                           " bytes in the store");
    }
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (comm == nullptr) {
    return NcclToStatus(r == ncclSuccess ? ncclInternalError : r, "ncclCommInitRankConfig",
                        __FILE__, __LINE__)
        .WithContext(impl->Describe());
  }
  {
    std::lock_guard<std::mutex> lock(impl->mu_);
    impl->comm_ = comm;
  }
  // From here on the Impl owns the communicator: its destructor releases it on any error.
  Status s =
      impl->Settle(comm, Impl::Watch::kThis, r, "ncclCommInitRankConfig", deadline, cancel);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(impl->mu_);
    impl->AbortCommLocked();
    return s.WithContext(impl->Describe());
  }
  MORPH_RETURN_IF_ERROR(impl->InitResources()) << impl->Describe();
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

NcclCommunicator::~NcclCommunicator() {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->destroyed_ = true;
  impl_->ReleaseLocked();
  impl_->FreeResources();
}

// A child communicator (split or shrink) once `next` exists and its creation settled.
static StatusOr<std::shared_ptr<NcclCommunicator::Impl>> Adopt(ncclComm_t next, std::string name,
                                                               int64_t generation, int device) {
  int new_rank = 0, new_size = 0;
  Status q = QueryRankAndSize(next, &new_rank, &new_size);
  auto impl = std::make_shared<NcclCommunicator::Impl>(std::move(name), new_rank, new_size,
                                                       generation, device);
  {
    std::lock_guard<std::mutex> lock(impl->mu_);
    impl->comm_ = next;  // the Impl releases it from here on, also on the errors below
    if (!q.ok()) impl->FailLocked(q);
  }
  MORPH_RETURN_IF_ERROR(q) << impl->Describe();
  MORPH_RETURN_IF_ERROR(impl->InitResources()) << impl->Describe();
  return impl;
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Shrink(std::span<const int> exclude,
                                                                 ShrinkMode mode,
                                                                 int64_t generation,
                                                                 Deadline deadline) {
  const std::string what = impl_->Describe() + ": shrink";
  if (exclude.empty()) return InvalidArgumentError(what + ": no rank to exclude");
  std::vector<int> list(exclude.begin(), exclude.end());
  std::sort(list.begin(), list.end());
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] < 0 || list[i] >= size()) {
      return InvalidArgumentError(what + ": excluded rank " + std::to_string(list[i]) +
                                  " out of range");
    }
    if (list[i] == rank()) return InvalidArgumentError(what + ": this rank is excluded");
    if (i > 0 && list[i] == list[i - 1]) {
      return InvalidArgumentError(what + ": rank " + std::to_string(list[i]) + " excluded twice");
    }
  }
  // A revoked communicator must be quiescent before management calls (nccl.h).
  while (true) {
    {
      std::lock_guard<std::mutex> lock(impl_->mu_);
      if (impl_->state_ != Impl::State::kRevoked || impl_->QuiescentLocked()) break;
    }
    if (deadline.Expired()) {
      return DeadlineExceededError(what + ": the revoked communicator did not quiesce in time");
    }
    std::this_thread::sleep_for(kPoll);
  }
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t next = nullptr;
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (impl_->state_ == Impl::State::kReleased) {
      return FailedPreconditionError(
          what +
          ": the communicator was already released (ncclCommAbort after a failure that "
          "outlasted the quiesce grace, or an earlier Shrink); build a new one");
    }
    const bool failed = impl_->broken_.load() || impl_->abort_requested_.load();
    if (mode == ShrinkMode::kPlanned && failed) {
      return FailedPreconditionError(what + ": a planned shrink needs a healthy communicator (" +
                                     std::string(impl_->error_.message()) +
                                     "); use ShrinkMode::kFailure");
    }
    cudaSetDevice(impl_->device_);
    r = ncclCommShrink(impl_->comm_, list.data(), static_cast<int>(list.size()), &next, &config,
                       mode == ShrinkMode::kFailure ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT);
  }
  Status s = next == nullptr
                 ? NcclToStatus(r == ncclSuccess ? ncclInternalError : r, "ncclCommShrink",
                                __FILE__, __LINE__)
                 : impl_->Settle(next, Impl::Watch::kChildOfShrink, r, "ncclCommShrink", deadline);
  {
    // The parent is released with ncclCommAbort, never Destroy (FACTS.md), once the child
    // no longer needs it.
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (impl_->error_.ok()) {
      impl_->error_ = FailedPreconditionError(impl_->Describe() + ": released by Shrink");
    }
    impl_->AbortCommLocked();
  }
  if (!s.ok()) {
    if (next != nullptr) ncclCommAbort(next);
    return s.WithContext(what);
  }
  MORPH_ASSIGN_OR_RETURN(auto impl, Adopt(next, impl_->name_, generation, impl_->device_), what);
  return std::unique_ptr<Communicator>(new NcclCommunicator(std::move(impl)));
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Split(int color, int key,
                                                                std::string name,
                                                                Deadline deadline) {
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t next = nullptr;
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    MORPH_RETURN_IF_ERROR(impl_->CheckLocked());
    cudaSetDevice(impl_->device_);
    r = ncclCommSplit(impl_->comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &next, &config);
  }
  // The split is collective over the parent: wait for the parent, then for the child.
  Status s = impl_->Settle(impl_->comm_, Impl::Watch::kThis, r, "ncclCommSplit", deadline);
  if (s.ok() && next != nullptr) {
    s = impl_->Settle(next, Impl::Watch::kChild, ncclSuccess, "ncclCommSplit", deadline);
  }
  if (!s.ok()) {
    if (next != nullptr) ncclCommAbort(next);
    std::lock_guard<std::mutex> lock(impl_->mu_);
    impl_->FailLocked(s.WithContext(impl_->Describe() + ": split"));
    return s.WithContext(impl_->Describe() + ": split");
  }
  if (color < 0) return std::unique_ptr<Communicator>();
  MORPH_ASSIGN_OR_RETURN(auto impl,
                         Adopt(next, std::move(name), impl_->generation_, impl_->device_),
                         impl_->Describe() << ": split");
  return std::unique_ptr<Communicator>(new NcclCommunicator(std::move(impl)));
}

int NcclCommunicator::rank() const { return impl_->rank_; }
int NcclCommunicator::size() const { return impl_->size_; }
int64_t NcclCommunicator::generation() const { return impl_->generation_; }

Capabilities NcclCommunicator::capabilities() const {
  Capabilities c;
  c.backend = "nccl";
  c.device_memory = true;
  c.point_to_point = true;
  c.shrink = true;
  c.split = true;
  c.reduce_types = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                    DType::kI32, DType::kI64, DType::kU8, DType::kI8};
  c.reduce_ops = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};
  return c;
}

StatusOr<std::unique_ptr<Work>> NcclCommunicator::Start(CollectiveOp op) {
  MORPH_RETURN_IF_ERROR(ValidateOp(op, capabilities())) << impl_->Describe();
  MORPH_RETURN_IF_ERROR(impl_->CheckDeviceBuffer(op.recv, "recv buffer")) << impl_->Describe();
  MORPH_RETURN_IF_ERROR(impl_->CheckDeviceBuffer(op.send, "send buffer")) << impl_->Describe();
  for (const P2POp& p : op.p2p) {
    MORPH_RETURN_IF_ERROR(impl_->CheckDeviceBuffer(p.data, "send/recv buffer"))
        << impl_->Describe();
  }
  MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device_));
  cudaStream_t stream =
      op.stream != nullptr ? static_cast<cudaStream_t>(op.stream) : impl_->stream_;
  cudaEvent_t event = nullptr;
  MORPH_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  auto fail = [&](Status s) -> Status {
    cudaEventDestroy(event);
    return s;
  };
  const char* what = "";
  ncclResult_t r = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    if (Status s = impl_->CheckLocked(); !s.ok()) return fail(s);
    Status early;
    r = impl_->EnqueueLocked(op, stream, &what, &early);
    if (!early.ok() || (r != ncclSuccess && r != ncclInProgress)) {
      Status s = early.ok() ? NcclToStatus(r, what, __FILE__, __LINE__, impl_->comm_) : early;
      s = s.WithContext(impl_->Describe());
      if (s.code() != StatusCode::kInvalidArgument) impl_->FailLocked(s);
      return fail(s);
    }
  }
  Status s = impl_->Settle(impl_->comm_, Impl::Watch::kThis, r, what, Deadline::After(op.timeout));
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    return fail(impl_->FailLocked(s.WithContext(impl_->Describe())));
  }
  cudaError_t e = cudaEventRecord(event, stream);
  if (e != cudaSuccess) {
    return fail(
        CudaToStatus(e, "cudaEventRecord", __FILE__, __LINE__).WithContext(impl_->Describe()));
  }
  return std::unique_ptr<Work>(new NcclWork(impl_, event));
}

void NcclCommunicator::Abort() {
  impl_->abort_requested_.store(true);
  // Every holder of mu_ is inside a non-blocking NCCL call or between polls, so this waits
  // briefly; the revoke then reaches an operation in progress on any thread.
  std::lock_guard<std::mutex> lock(impl_->mu_);
  (void)impl_->CheckLocked();
}

bool NcclCommunicator::broken() const {
  return impl_->broken_.load() || impl_->abort_requested_.load();
}

CommunicatorFactory NcclFactory(int cuda_device, std::shared_ptr<const BuildCancel> cancel) {
  return [cuda_device, cancel](Store& store, std::string_view name, int rank, int size,
                               Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    MORPH_ASSIGN_OR_RETURN(auto comm,
                           NcclCommunicator::Create(store, name, rank, size, cuda_device, deadline,
                                                    cancel.get()));
    return std::unique_ptr<Communicator>(std::move(comm));
  };
}

CommunicatorFactory NcclFactory(int cuda_device) {
  return [cuda_device](Store& store, std::string_view name, int rank, int size,
                       Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    MORPH_ASSIGN_OR_RETURN(
        auto comm, NcclCommunicator::Create(store, name, rank, size, cuda_device, deadline));
    return std::unique_ptr<Communicator>(std::move(comm));
  };
}

}  // namespace morph
