// DeviceTransport: the reshard executor's Transport (reshard/transport.h) for device-resident
// state: grouped sends and receives of device buffers over an NCCL-shaped communicator (one
// Transport::Start = one ncclGroupStart ... ncclGroupEnd on the transport's own stream), never
// through host memory. The communicator is the change's union communicator (union_comm.h): it
// spans the old and the new members, and its ranks need not be the participant numbers the
// plan uses, so the transport carries the map between them.
//
//   MORPH_ASSIGN_OR_RETURN(UnionComm u, BuildUnionComm(...));           // during prepare
//   MORPH_ASSIGN_OR_RETURN(auto t, DeviceTransport::Create(u.comm, u.plan.comm_rank_of_participant,
//                                                          CudaDeviceMemory(device), timeout));
//   MORPH_ASSIGN_OR_RETURN(ExecutorStats s, ExecutePlan(plan, olds, news, *t, options, dl));
//
// What it adds to the communicator's send/recv groups:
//   - ranks: rank() and size() are the plan's (participants); peers are translated to
//     communicator ranks on the way in, and the peers a failure names (Status::failed_peers)
//     back to participants on the way out (ranks of the communicator that are not participants
//     are dropped from the list);
//   - message tags (transport.h): per group, per direction and peer, one 16-byte record of the
//     tags of its messages leads the payload (tag_record.h), as over CommTransport; a mismatch
//     fails the receiving Wait with kFailedPrecondition naming the peer (a participant);
//   - host-memory messages (the executor's handshake records, the tag records): bounced
//     through device memory of the transport's own (copied to the device on the stream before
//     the group, back to the host after it), so the communicator only ever sees device buffers;
//     the bounce buffers of a group are released (for reuse) when its Wait returned;
//   - staging: StagingAllocator() is the device's, so the executor packs strided pieces with
//     its CUDA kernels into device staging (bounded by ExecutorOptions::staging_bytes).
// Strided ops are not supported (SupportsStridedOps() is false): the executor packs them.
//
// Failure: as the communicator's (every Wait after a failure returns the first error); Abort()
// from any thread aborts the communicator (NcclCommunicator: the abort race of docs/facts.md is
// the communicator's, see nccl_communicator.h). The transport never destroys the communicator.
#ifndef MORPH_COLLECTIVES_DEVICE_TRANSPORT_H_
#define MORPH_COLLECTIVES_DEVICE_TRANSPORT_H_

#include <chrono>
#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/device_memory.h"
#include "reshard/transport.h"

namespace morph {

class DeviceTransport final : public Transport {
 public:
  // `comm_rank_of_participant[p]`: the communicator rank of participant p (distinct, in range);
  // this process is the participant whose entry is comm->rank(). kInvalidArgument when the map
  // is empty, has a duplicate or an entry out of range, does not contain comm->rank(), or the
  // communicator has no device-memory point-to-point (capabilities()). `comm` must outlive the
  // transport.
  static StatusOr<std::unique_ptr<DeviceTransport>> Create(
      Communicator* comm, std::vector<int> comm_rank_of_participant,
      std::unique_ptr<DeviceMemory> memory, std::chrono::milliseconds timeout);
  ~DeviceTransport() override;

  int rank() const override { return participant_; }
  int size() const override { return static_cast<int>(comm_rank_.size()); }
  bool SupportsDeviceMemory() const override { return true; }
  bool SupportsStridedOps() const override { return false; }
  Allocator StagingAllocator() override;
  // kInvalidArgument naming the op for a peer out of range or equal to this participant, or a
  // strided op; the communicator's errors (a broken one's first error; an allocation of bounce
  // memory: kResourceExhausted).
  StatusOr<std::unique_ptr<TransportWork>> Start(std::span<const SendOp> sends,
                                                 std::span<const RecvOp> recvs) override;
  void Abort() override;

  // Communicator rank of participant `p` (for logs and tests).
  int comm_rank(int p) const { return comm_rank_[static_cast<size_t>(p)]; }
  // Bounce bytes posted so far (host messages moved through device memory).
  int64_t bounced_bytes() const { return bounced_bytes_; }
  // Device memory allocated for bounce buffers over the transport's life (an upper bound on what
  // it holds at any time: freed buffers are reused, at most 8 kept). Any thread.
  int64_t bounce_allocated_bytes() const;

  struct Pool;  // bounce buffers, shared with the works

 private:
  DeviceTransport(Communicator* comm, std::vector<int> comm_rank, int participant,
                  std::unique_ptr<DeviceMemory> memory, std::chrono::milliseconds timeout);

  Communicator* comm_;
  std::vector<int> comm_rank_;    // participant -> communicator rank
  std::vector<int> participant_of_;  // communicator rank -> participant, -1: none
  int participant_;
  std::shared_ptr<DeviceMemory> memory_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Pool> pool_;
  int64_t bounced_bytes_ = 0;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_DEVICE_TRANSPORT_H_
