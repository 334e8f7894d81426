// An in-process stand-in for the NCCL backend and a GPU, for CPU tests of the device data path
// (device_transport.h, union_comm.h, the switch's device path): ranks are threads, "device
// memory" is host memory registered with a FakeDevice, and the communicators have NCCL's shape
// and its rules where the device path depends on them. Bytes really move (memcpy between the
// ranks' buffers), so a test that passes proves the data arrived where it belongs.
//
//   auto device = std::make_shared<FakeDevice>();
//   auto hub = std::make_shared<FakeNcclHub>(/*processes=*/4, device);
//   CommunicatorFactory f = hub->Factory(/*process=*/r);      // like NcclFactory(cuda_device)
//   MORPH_ASSIGN_OR_RETURN(auto comm, f(store, "world", r, 4, deadline));
//   MORPH_ASSIGN_OR_RETURN(Buffer b, device->Allocate(1 << 20));   // "device memory"
//   hub->Kill(2);                                               // process 2 dies
//
// What it checks and does as NCCL would:
//   - every send/recv buffer must be FakeDevice memory (kInvalidArgument "host memory" else);
//   - creation (Factory: init with a fresh id per store generation and name; Shrink) is
//     collective: it returns when every member arrived, or kDeadlineExceeded;
//   - point-to-point only (kSendRecv groups; Barrier as a group of empty messages); sends and
//     receives between a pair match in posting order across groups; a size mismatch fails both
//     sides (kInternal);
//   - Abort() from any thread: this rank's waits return kAborted, its peers' operations with it
//     fail (kUnavailable, CollectiveFailure kRemoteError naming the peer — real NCCL names
//     none), and the communicator stays broken; a Wait past its deadline does the same with
//     kDeadlineExceeded; Kill(p) is a dead process (every communicator it is in fails for it
//     and for its peers, collectives waiting for it time out);
//   - Shrink(exclude, kPlanned | kFailure) without a rendezvous over the survivors (dead ranks
//     do not block it), survivors keeping their order; the parent is released afterwards
//     (later calls: kFailedPrecondition), kPlanned needs a healthy parent;
//   - no Split (capabilities().split is false), no reductions (kUnimplemented).
// Not modelled: streams (CollectiveOp::stream is accepted and ignored), NCCL's lack of failure
// propagation between ranks (real peers may only learn of an abort at their deadline).
#ifndef MORPH_COLLECTIVES_FAKE_NCCL_H_
#define MORPH_COLLECTIVES_FAKE_NCCL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "collectives/build_cancel.h"
#include "collectives/communicator.h"
#include "collectives/device_memory.h"
#include "collectives/groups.h"

namespace morph {

// "Device memory": host allocations registered as device ranges. Any thread.
class FakeDevice : public std::enable_shared_from_this<FakeDevice> {
 public:
  // Allocations fail with kResourceExhausted once more than `capacity` bytes are held
  // (-1: unlimited), as cudaMalloc does on a full device.
  explicit FakeDevice(int64_t capacity = -1) : capacity_(capacity) {}
  // One GPU of a node: its allocations and registrations are `node`'s ranges too (so a hub over
  // `node` takes them for device memory), while held_bytes() and peak_bytes() count its own.
  FakeDevice(int64_t capacity, std::shared_ptr<FakeDevice> node)
      : capacity_(capacity), node_(std::move(node)) {}
  // A registered buffer; unregistered when it dies.
  StatusOr<Buffer> Allocate(size_t bytes);
  Allocator allocator();
  // Registers memory the caller owns (tests' std::vectors) as device memory until Unregister.
  void Register(const void* p, size_t bytes);
  void Unregister(const void* p);
  bool Contains(const void* p, size_t bytes) const;
  int64_t held_bytes() const;
  int64_t peak_bytes() const;
  void ResetPeak();  // peak_bytes() from now on: the most held from here
  // A DeviceMemory over this device (no stream: copies are memcpy).
  std::unique_ptr<DeviceMemory> Memory();

 private:
  const int64_t capacity_;
  const std::shared_ptr<FakeDevice> node_;
  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> ranges_;
  int64_t held_ = 0, peak_ = 0;
};

class FakeNcclHub {
 public:
  // `processes` processes (one GPU each), numbered 0..processes-1.
  FakeNcclHub(int processes, std::shared_ptr<FakeDevice> device);
  ~FakeNcclHub();
  FakeNcclHub(const FakeNcclHub&) = delete;
  FakeNcclHub& operator=(const FakeNcclHub&) = delete;

  // Communicators of process `process`: the callers passing the same store generation and name
  // form one (collective; `size` must agree), rank `rank` each.
  // With `cancel`: a creation in progress returns kAborted once it is cancelled (its arrival
  // withdrawn: the others keep waiting, as NCCL's would), later ones at once.
  CommunicatorFactory Factory(int process, std::shared_ptr<const BuildCancel> cancel = nullptr);
  // Process `process` dies (any thread).
  void Kill(int process);
  // Process `process` dies as soon as `bytes` bytes have been delivered in all (deterministic
  // mid-operation faults). Any thread; one pending kill at a time.
  void KillWhenDelivered(int process, int64_t bytes);
  // Matching stops once `bytes` bytes have been delivered (operations stay pending) until
  // ResumeDelivery: a deterministic "mid-operation" for tests that act from another thread.
  void PauseDeliveryAt(int64_t bytes);
  bool delivery_paused() const;
  void ResumeDelivery();
  // Bytes delivered and groups started so far, all communicators.
  int64_t bytes_delivered() const;
  int64_t groups_started() const;
  const std::shared_ptr<FakeDevice>& device() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_FAKE_NCCL_H_
