#include "collectives/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/cuda_check.h"
#include "base/nccl_check.h"

namespace morph {
namespace {

constexpr auto kPoll = std::chrono::microseconds(100);

ncclDataType_t ToNccl(DataType t) {
  switch (t) {
    case DataType::kF32:
      return ncclFloat32;
    case DataType::kF64:
      return ncclFloat64;
    case DataType::kF16:
      return ncclFloat16;
    case DataType::kBF16:
      return ncclBfloat16;
    case DataType::kI32:
      return ncclInt32;
    case DataType::kI64:
      return ncclInt64;
    case DataType::kU8:
      return ncclUint8;
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

// Waits until `comm` leaves ncclInProgress after a non-blocking call that returned `r`.
// kAborted when `abort` is raised meanwhile, kDeadlineExceeded at the deadline; in both cases
// the caller must ncclCommAbort the communicator.
Status Settle(ncclComm_t comm, ncclResult_t r, const char* what, Deadline deadline,
              const std::atomic<bool>* abort) {
  if (r != ncclSuccess && r != ncclInProgress) {
    return NcclToStatus(r, what, __FILE__, __LINE__, comm);
  }
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) return NcclToStatus(q, "ncclCommGetAsyncError", __FILE__, __LINE__, comm);
    if (state == ncclSuccess) return Status::Ok();
    if (state != ncclInProgress) return NcclToStatus(state, what, __FILE__, __LINE__, comm);
    if (abort != nullptr && abort->load()) return AbortedError(std::string(what) + ": aborted");
    if (deadline.Expired())
      return DeadlineExceededError(std::string(what) + ": did not finish in time");
    std::this_thread::sleep_for(kPoll);
  }
}

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

class NcclCommunicator::Impl {
 public:
  Impl(std::string name, int rank, int size, int64_t generation, int device)
      : name_(std::move(name)),
        rank_(rank),
        size_(size),
        generation_(generation),
        device_(device) {}

  ~Impl() { Release(); }

  std::string Describe() const {
    return "nccl communicator '" + name_ + "' generation " + std::to_string(generation_) +
           " rank " + std::to_string(rank_) + "/" + std::to_string(size_);
  }

  // Owning thread only: releases the NCCL communicator with ncclCommAbort (never Destroy
  // after a failure) and remembers why.
  void AbortNow(const Status& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = why;
    }
    broken_.store(true);
    if (comm_ != nullptr && !comm_released_) {
      cudaSetDevice(device_);
      ncclCommAbort(comm_);
      comm_released_ = true;
    }
  }

  Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  // Turns a pending Abort() request into ncclCommAbort. Owning thread.
  Status CheckAbort() {
    if (abort_requested_.load() && !comm_released_) {
      AbortNow(AbortedError(Describe() + ": aborted (Abort() called)"));
    }
    if (broken_.load()) return error();
    return Status::Ok();
  }

  void Release() {
    if (comm_ != nullptr && !comm_released_) {
      cudaSetDevice(device_);
      bool clean = !broken_.load() && !abort_requested_.load();
      if (clean) {
        clean = Settle(comm_, ncclCommFinalize(comm_), "ncclCommFinalize", Deadline::AfterMs(10000),
                       nullptr)
                    .ok();
      }
      if (clean) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_released_ = true;
    }
    if (scratch_ != nullptr) {
      cudaFree(scratch_);
      scratch_ = nullptr;
    }
    if (stream_ != nullptr) {
      cudaStreamDestroy(stream_);
      stream_ = nullptr;
    }
  }

  // After the NCCL communicator exists: stream and scratch space for barriers.
  Status InitResources() {
    MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    MORPH_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MORPH_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(int32_t)));
    return Status::Ok();
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

  // Enqueues `op` on the stream. Owning thread.
  Status Enqueue(const CollectiveOp& op) {
    const ncclDataType_t dt = ToNccl(op.dtype);
    Deadline deadline = Deadline::After(op.timeout);
    ncclResult_t r = ncclSuccess;
    const char* what = "";
    switch (op.kind) {
      case CollectiveOp::Kind::kAllreduce:
        if (op.count == 0) return Status::Ok();
        what = "ncclAllReduce";
        r = ncclAllReduce(op.recv, op.recv, op.count, dt, ToNccl(op.reduce), comm_, stream_);
        break;
      case CollectiveOp::Kind::kBroadcast:
        if (op.count == 0) return Status::Ok();
        what = "ncclBroadcast";
        r = ncclBroadcast(op.recv, op.recv, op.count, dt, op.root, comm_, stream_);
        break;
      case CollectiveOp::Kind::kAllgather:
        if (op.count == 0) return Status::Ok();
        what = "ncclAllGather";
        r = ncclAllGather(op.send, op.recv, op.count, dt, comm_, stream_);
        break;
      case CollectiveOp::Kind::kReduceScatter:
        if (op.count == 0) return Status::Ok();
        what = "ncclReduceScatter";
        r = ncclReduceScatter(op.send, op.recv, op.count, dt, ToNccl(op.reduce), comm_, stream_);
        break;
      case CollectiveOp::Kind::kBarrier:
        what = "barrier (ncclAllReduce of one int)";
        r = ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_);
        break;
      case CollectiveOp::Kind::kSendRecv: {
        what = "ncclGroupEnd (send/recv)";
        ncclResult_t g = ncclGroupStart();
        if (g != ncclSuccess) return NcclToStatus(g, "ncclGroupStart", __FILE__, __LINE__, comm_);
        for (const P2POp& p : op.p2p) {
          if (p.bytes == 0) continue;
          ncclResult_t e = p.kind == P2POp::Kind::kSend
                               ? ncclSend(p.data, p.bytes, ncclUint8, p.peer, comm_, stream_)
                               : ncclRecv(p.data, p.bytes, ncclUint8, p.peer, comm_, stream_);
          if (e != ncclSuccess && e != ncclInProgress) {
            ncclGroupEnd();
            return NcclToStatus(e, p.kind == P2POp::Kind::kSend ? "ncclSend" : "ncclRecv", __FILE__,
                                __LINE__, comm_);
          }
        }
        r = ncclGroupEnd();
        break;
      }
    }
    return Settle(comm_, r, what, deadline, &abort_requested_);
  }

  const std::string name_;
  const int rank_;
  const int size_;
  const int64_t generation_;
  const int device_;
  ncclComm_t comm_ = nullptr;
  bool comm_released_ = false;  // owning thread
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  std::atomic<bool> abort_requested_{false};
  std::atomic<bool> broken_{false};
  mutable std::mutex mu_;
  Status error_;
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

  bool Done() const override {
    if (result_ || comm_->broken_.load() || comm_->abort_requested_.load()) return true;
    return event_ == nullptr || cudaEventQuery(event_) == cudaSuccess;
  }

 private:
  Status Poll(Deadline deadline) {
    cudaSetDevice(comm_->device_);
    while (true) {
      MORPH_RETURN_IF_ERROR(comm_->CheckAbort());
      cudaError_t e = event_ == nullptr ? cudaSuccess : cudaEventQuery(event_);
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_->comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        comm_->AbortNow(NcclToStatus(state, "NCCL async error", __FILE__, __LINE__, comm_->comm_)
                            .WithContext(comm_->Describe()));
        return comm_->error();
      }
      if (e == cudaSuccess) return Status::Ok();
      if (e != cudaErrorNotReady) {
        comm_->AbortNow(
            CudaToStatus(e, "cudaEventQuery", __FILE__, __LINE__).WithContext(comm_->Describe()));
        return comm_->error();
      }
      if (deadline.Expired()) {
        comm_->AbortNow(
            DeadlineExceededError(comm_->Describe() + ": operation did not finish in time"));
        return comm_->error();
      }
      std::this_thread::sleep_for(kPoll);
    }
  }

  std::shared_ptr<NcclCommunicator::Impl> comm_;
  cudaEvent_t event_;
  std::optional<Status> result_;
};

}  // namespace

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    Store& store, std::string_view name, int rank, int size, int cuda_device, Deadline deadline) {
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
    MORPH_ASSIGN_OR_RETURN(std::string bytes, store.Get(key, deadline), impl->Describe());
    if (bytes.size() != sizeof(id.internal)) {
      return InternalError(impl->Describe() + ": unique id of " + std::to_string(bytes.size()) +
                           " bytes in the store");
    }
    std::memcpy(id.internal, bytes.data(), bytes.size());
  }
  ncclConfig_t config = NonBlockingConfig();
  ncclResult_t r = ncclCommInitRankConfig(&impl->comm_, size, id, rank, &config);
  if (impl->comm_ == nullptr) {
    return NcclToStatus(r == ncclSuccess ? ncclInternalError : r, "ncclCommInitRankConfig",
                        __FILE__, __LINE__)
        .WithContext(impl->Describe());
  }
  Status s = Settle(impl->comm_, r, "ncclCommInitRankConfig", deadline, nullptr);
  if (!s.ok()) {
    impl->AbortNow(s);
    return s.WithContext(impl->Describe());
  }
  MORPH_RETURN_IF_ERROR(impl->InitResources()) << impl->Describe();
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCommunicator::~NcclCommunicator() { impl_->Release(); }

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Shrink(std::span<const int> exclude,
                                                                     int64_t generation,
                                                                     Deadline deadline) {
  for (int r : exclude) {
    if (r < 0 || r >= size()) {
      return InvalidArgumentError(impl_->Describe() + ": shrink: excluded rank " +
                                  std::to_string(r) + " out of range");
    }
    if (r == rank()) {
      return InvalidArgumentError(impl_->Describe() + ": shrink: this rank is excluded");
    }
  }
  if (impl_->comm_released_) {
    return FailedPreconditionError(impl_->Describe() +
                                   ": shrink: the communicator was already released");
  }
  cudaSetDevice(impl_->device_);
  std::vector<int> list(exclude.begin(), exclude.end());
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t next = nullptr;
  int flags = impl_->broken_.load() || impl_->abort_requested_.load() ? NCCL_SHRINK_ABORT
                                                                      : NCCL_SHRINK_DEFAULT;
  ncclResult_t r = ncclCommShrink(impl_->comm_, list.data(), static_cast<int>(list.size()), &next,
                                  &config, flags);
  Status s = next == nullptr ? NcclToStatus(r == ncclSuccess ? ncclInternalError : r,
                                            "ncclCommShrink", __FILE__, __LINE__, impl_->comm_)
                             : Settle(next, r, "ncclCommShrink", deadline, nullptr);
  // The parent is released with ncclCommAbort, never Destroy (FACTS.md).
  impl_->AbortNow(AbortedError(impl_->Describe() + ": replaced by a shrunk communicator"));
  if (!s.ok()) {
    if (next != nullptr) ncclCommAbort(next);
    return s.WithContext(impl_->Describe() + ": shrink");
  }
  int new_rank = 0, new_size = 0;
  ncclCommUserRank(next, &new_rank);
  ncclCommCount(next, &new_size);
  auto impl = std::make_shared<Impl>(impl_->name_, new_rank, new_size, generation, impl_->device_);
  impl->comm_ = next;
  MORPH_RETURN_IF_ERROR(impl->InitResources()) << impl->Describe();
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(std::move(impl)));
}

StatusOr<std::unique_ptr<Communicator>> NcclCommunicator::Split(int color, int key,
                                                                std::string name,
                                                                Deadline deadline) {
  MORPH_RETURN_IF_ERROR(impl_->CheckAbort());
  cudaSetDevice(impl_->device_);
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t next = nullptr;
  ncclResult_t r =
      ncclCommSplit(impl_->comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &next, &config);
  // The split is collective over the parent: wait for the parent, then for the child.
  Status s = Settle(impl_->comm_, r, "ncclCommSplit", deadline, &impl_->abort_requested_);
  if (s.ok() && next != nullptr) s = Settle(next, ncclSuccess, "ncclCommSplit", deadline, nullptr);
  if (!s.ok()) {
    if (next != nullptr) ncclCommAbort(next);
    impl_->AbortNow(s);
    return s.WithContext(impl_->Describe() + ": split");
  }
  if (color < 0) return std::unique_ptr<Communicator>();
  int new_rank = 0, new_size = 0;
  ncclCommUserRank(next, &new_rank);
  ncclCommCount(next, &new_size);
  auto impl = std::make_shared<Impl>(std::move(name), new_rank, new_size, impl_->generation_,
                                     impl_->device_);
  impl->comm_ = next;
  MORPH_RETURN_IF_ERROR(impl->InitResources()) << impl->Describe();
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
  c.reduce_types = {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                    DataType::kI32, DataType::kI64, DataType::kU8};
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
  MORPH_RETURN_IF_ERROR(impl_->CheckAbort());
  MORPH_CUDA_RETURN_IF_ERROR(cudaSetDevice(impl_->device_));
  Status s = impl_->Enqueue(op);
  if (!s.ok()) {
    if (s.code() != StatusCode::kInvalidArgument) impl_->AbortNow(s.WithContext(impl_->Describe()));
    return s.WithContext(impl_->Describe());
  }
  cudaEvent_t event = nullptr;
  MORPH_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  cudaError_t e = cudaEventRecord(event, impl_->stream_);
  if (e != cudaSuccess) {
    cudaEventDestroy(event);
    return CudaToStatus(e, "cudaEventRecord", __FILE__, __LINE__).WithContext(impl_->Describe());
  }
  return std::unique_ptr<Work>(new NcclWork(impl_, event));
}

void NcclCommunicator::Abort() { impl_->abort_requested_.store(true); }
bool NcclCommunicator::broken() const {
  return impl_->broken_.load() || impl_->abort_requested_.load();
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
