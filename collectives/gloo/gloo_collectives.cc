// GlooCommunicator::Impl's collective bodies (gloo_communicator_impl.h), run on its op
// thread: the dispatch by kind, allgather, allreduce (ours or Gloo's ring), and the
// point-to-point exchange with its size handshake.
#include "collectives/gloo/gloo_communicator_impl.h"

namespace morph {

Status GlooCommunicator::Impl::ExecuteOrThrow(const CollectiveOp& op, uint32_t tag) {
  const size_t esize = DTypeSize(op.dtype);
  switch (op.kind) {
    case CollectiveOp::Kind::kAllreduce:
      return AllreduceInPlace(op.recv, op.count, op.dtype, op.reduce, op.timeout, tag);
    case CollectiveOp::Kind::kBroadcast: {
      if (op.count == 0 || size_ == 1) return Status::Ok();
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(op.recv), op.count * esize);
      opts.setRoot(op.root);
      opts.setTag(tag);
      opts.setTimeout(op.timeout);
      gloo::broadcast(opts);
      return Status::Ok();
    }
    case CollectiveOp::Kind::kAllgather:
      return Allgather(op.send, op.recv, op.count * esize, op.timeout, tag);
    case CollectiveOp::Kind::kReduceScatter: {
      if (op.count == 0) return Status::Ok();
      if (size_ == 1) {
        std::memmove(op.recv, op.send, op.count * esize);
        return Status::Ok();
      }
      gloo_algorithms::Messenger m(context_.get(), &workspace_, tag, Deadline::After(op.timeout),
                                   Describe() + ": reduce_scatter", &waits_);
      if (op.count * esize * size_ <= GlooCommunicator::kOneShotMaxBytes) {
        return gloo_algorithms::ReduceScatterDirect(m, *mailboxes_, rank_, size_, op.send, op.recv,
                                                    op.count, op.dtype, op.reduce);
      }
      return gloo_algorithms::ReduceScatterRing(m, rank_, size_, op.send, op.recv, op.count,
                                                op.dtype, op.reduce);
    }
    case CollectiveOp::Kind::kBarrier: {
      if (size_ == 1) return Status::Ok();
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(op.timeout);
      gloo::barrier(opts);
      return Status::Ok();
    }
    case CollectiveOp::Kind::kSendRecv:
      return SendRecv(op);
  }
  return InternalError("unknown operation");
}

Status GlooCommunicator::Impl::Allgather(const void* send, void* recv, size_t bytes,
                                         std::chrono::milliseconds timeout, uint32_t tag) {
  if (bytes == 0) return Status::Ok();  // Gloo divides by the size: guard empty inputs
  if (size_ == 1) {
    std::memmove(recv, send, bytes);
    return Status::Ok();
  }
  gloo::AllgatherOptions opts(context_);
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send)), bytes);
  opts.setOutput(static_cast<uint8_t*>(recv), bytes * size_);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allgather(opts);
  return Status::Ok();
}

Status GlooCommunicator::Impl::AllreduceInPlace(void* buf, size_t count, DType dtype,
                                                ReduceOp reduce, std::chrono::milliseconds timeout,
                                                uint32_t tag) {
  if (count == 0 || size_ == 1) return Status::Ok();
  gloo_algorithms::Messenger m(context_.get(), &workspace_, tag, Deadline::After(timeout),
                               Describe() + ": allreduce", &waits_);
  if (count * DTypeSize(dtype) <= GlooCommunicator::kOneShotMaxBytes) {
    return gloo_algorithms::AllreduceOneShot(m, *mailboxes_, rank_, size_, buf, count, dtype,
                                             reduce);
  }
  gloo::AllreduceOptions opts(context_);
  switch (dtype) {
    case DType::kF16:
    case DType::kBF16:
      return gloo_algorithms::AllreduceRing(m, rank_, size_, buf, count, dtype, reduce);
    case DType::kF32:
      opts.setOutput(static_cast<float*>(buf), count);
      opts.setReduceFunction(ReduceFn<float>(reduce));
      break;
    case DType::kF64:
      opts.setOutput(static_cast<double*>(buf), count);
      opts.setReduceFunction(ReduceFn<double>(reduce));
      break;
    case DType::kI32:
      opts.setOutput(static_cast<int32_t*>(buf), count);
      opts.setReduceFunction(ReduceFn<int32_t>(reduce));
      break;
    case DType::kI64:
      opts.setOutput(static_cast<int64_t*>(buf), count);
      opts.setReduceFunction(ReduceFn<int64_t>(reduce));
      break;
    case DType::kU8:
      opts.setOutput(static_cast<uint8_t*>(buf), count);
      opts.setReduceFunction(ReduceFn<uint8_t>(reduce));
      break;
    case DType::kI8:
      opts.setOutput(static_cast<int8_t*>(buf), count);
      opts.setReduceFunction(ReduceFn<int8_t>(reduce));
      break;
  }
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
  return Status::Ok();
}

Status GlooCommunicator::Impl::Exchange(const std::vector<Message>& messages, uint64_t slot_base,
                                        Deadline deadline, std::vector<uint64_t>& send_seq,
                                        std::vector<uint64_t>& recv_seq) {
  gloo_algorithms::Messenger m(context_.get(), &workspace_, 0, deadline, Describe() + ": send/recv",
                               &waits_);
  for (int pass = 0; pass < 2; ++pass) {  // receives first
    for (const Message& msg : messages) {
      if ((pass == 0) == msg.send || msg.bytes == 0) continue;
      uint64_t& seq = msg.send ? send_seq[msg.peer] : recv_seq[msg.peer];
      uint64_t slot = slot_base | (seq++ & kP2PSlotMask);
      if (msg.send) {
        m.SendToSlot(msg.peer, slot, msg.data, msg.bytes);
      } else {
        m.RecvFromSlot(msg.peer, slot, msg.data, msg.bytes);
      }
    }
  }
  return m.WaitAll();
}

Status GlooCommunicator::Impl::SendRecv(const CollectiveOp& op) {
  Deadline deadline = Deadline::After(op.timeout);
  struct Header {
    uint64_t count = 0;
    uint64_t hash = 14695981039346656037ull;  // FNV-1a over the sizes
    void Add(uint64_t bytes) {
      ++count;
      for (int i = 0; i < 8; ++i) {
        hash = (hash ^ ((bytes >> (8 * i)) & 0xff)) * 1099511628211ull;
      }
    }
  };
  std::vector<Header> out(size_), expected(size_), got(size_);
  std::vector<bool> sends_to(size_, false), recvs_from(size_, false);
  for (const P2POp& p : op.p2p) {
    if (p.kind == P2POp::Kind::kSend) {
      out[p.peer].Add(p.bytes);
      sends_to[p.peer] = true;
    } else {
      expected[p.peer].Add(p.bytes);
      recvs_from[p.peer] = true;
    }
  }
  std::vector<Message> headers;
  for (int peer = 0; peer < size_; ++peer) {
    if (sends_to[peer]) headers.push_back({true, peer, &out[peer], sizeof(Header)});
    if (recvs_from[peer]) headers.push_back({false, peer, &got[peer], sizeof(Header)});
  }
  MORPH_RETURN_IF_ERROR(
      Exchange(headers, kHeaderSlotBase, deadline, header_send_seq_, header_recv_seq_));
  for (int peer = 0; peer < size_; ++peer) {
    if (!recvs_from[peer]) continue;
    if (got[peer].count != expected[peer].count || got[peer].hash != expected[peer].hash) {
      return InternalError(Describe() + ": send/recv: peer " + std::to_string(peer) + " sends " +
                           std::to_string(got[peer].count) + " messages, this rank receives " +
                           std::to_string(expected[peer].count) +
                           (got[peer].count == expected[peer].count ? " (sizes differ)" : ""));
    }
  }
  std::vector<Message> payload;
  payload.reserve(op.p2p.size());
  for (const P2POp& p : op.p2p) {
    payload.push_back({p.kind == P2POp::Kind::kSend, p.peer, p.data, p.bytes});
  }
  return Exchange(payload, kP2PSlotBase, deadline, send_seq_, recv_seq_);
}

}  // namespace morph
