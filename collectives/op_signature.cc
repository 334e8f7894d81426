#include "collectives/op_signature.h"

namespace morph {

OpSignature OpSignature::Of(const CollectiveOp& op) {
  OpSignature s;
  s.kind = static_cast<uint8_t>(op.kind);
  if (op.kind == CollectiveOp::Kind::kBarrier || op.kind == CollectiveOp::Kind::kSendRecv) {
    return s;
  }
  s.dtype = static_cast<uint8_t>(op.dtype);
  s.count = op.count;
  if (op.kind == CollectiveOp::Kind::kAllreduce || op.kind == CollectiveOp::Kind::kReduceScatter) {
    s.reduce = static_cast<uint8_t>(op.reduce);
  }
  if (op.kind == CollectiveOp::Kind::kBroadcast) s.root = op.root;
  return s;
}

std::string OpSignature::ToString() const {
  static const char* kKinds[] = {"allreduce", "broadcast", "allgather", "reduce_scatter",
                                 "barrier", "send/recv"};
  const auto k = static_cast<CollectiveOp::Kind>(kind);
  std::string out = kind < 6 ? kKinds[kind] : "operation " + std::to_string(kind);
  if (k == CollectiveOp::Kind::kBarrier || k == CollectiveOp::Kind::kSendRecv) return out;
  out += " of " + std::to_string(count) + " x " + std::string(DTypeName(static_cast<DType>(dtype)));
  if (k == CollectiveOp::Kind::kAllgather || k == CollectiveOp::Kind::kReduceScatter) {
    out += " per rank";
  }
  if (k == CollectiveOp::Kind::kAllreduce || k == CollectiveOp::Kind::kReduceScatter) {
    out += " (" + std::string(ReduceOpName(static_cast<ReduceOp>(reduce))) + ")";
  }
  if (k == CollectiveOp::Kind::kBroadcast) out += " from rank " + std::to_string(root);
  return out;
}

Status DisagreementError(std::string_view what, int rank, const OpSignature& theirs, int me,
                         const OpSignature& mine) {
  return InvalidArgumentError(std::string(what) + ": the ranks' calls differ: rank " +
                              std::to_string(rank) + " calls " + theirs.ToString() + ", rank " +
                              std::to_string(me) + " (this one) " + mine.ToString());
}

}  // namespace morph
