#include "collectives/comm_transport.h"

namespace morph {
namespace {

class CommTransportWork : public TransportWork {
 public:
  explicit CommTransportWork(std::unique_ptr<Work> work) : work_(std::move(work)) {}
  Status Wait(Deadline deadline) override { return work_->Wait(deadline); }

 private:
  std::unique_ptr<Work> work_;
};

}  // namespace

StatusOr<std::unique_ptr<TransportWork>> CommTransport::Start(std::span<const SendOp> sends,
                                                              std::span<const RecvOp> recvs) {
  // SupportsStridedOps() is false: contiguous buffers only.
  for (const SendOp& s : sends) {
    if (s.strided != nullptr) return InvalidArgumentError("strided send op to a CommTransport");
  }
  for (const RecvOp& r : recvs) {
    if (r.strided != nullptr) return InvalidArgumentError("strided receive op to a CommTransport");
  }
  std::vector<P2POp> ops;
  ops.reserve(sends.size() + recvs.size());
  for (const SendOp& s : sends) {
    ops.push_back({P2POp::Kind::kSend, s.peer, const_cast<void*>(s.data), s.bytes});
  }
  for (const RecvOp& r : recvs) ops.push_back({P2POp::Kind::kRecv, r.peer, r.data, r.bytes});
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<Work> work,
                         comm_->Start(CollectiveOp::SendRecv(std::move(ops), timeout_)),
                         "transport");
  return std::unique_ptr<TransportWork>(new CommTransportWork(std::move(work)));
}

}  // namespace morph
