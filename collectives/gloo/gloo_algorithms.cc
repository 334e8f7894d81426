#include "collectives/gloo/gloo_algorithms.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace morph::gloo_algorithms {
namespace {

using std::chrono::milliseconds;

// Above the slots of Gloo's collectives and of the communicator's point-to-point messages
// (0xAB..0xAD << 56): prefix, 31-bit collective tag, 16-bit step.
constexpr uint64_t kSlotBase = uint64_t{0xAE} << 56;
// Mailbox rounds: prefix and a 56-bit round number.
constexpr uint64_t kMailboxSlotBase = uint64_t{0xAF} << 56;

bool IsHalf(DType t) { return t == DType::kF16 || t == DType::kBF16; }
// Partial results of f16/bf16 are f32.
size_t AccSize(DType t) { return IsHalf(t) ? sizeof(float) : DTypeSize(t); }

// Inline copies of communicator.h's bf16 conversions (same bits), for the hot loops.
inline float Bf16ToF(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }
inline uint16_t FToBf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// The loops below run in blocks of a fixed count over buffers that do not overlap: what GCC
// vectorizes at -O2 (communicator.cc's ReduceInto says why).
constexpr size_t kBlock = 16;

template <float (*ToF)(uint16_t)>
void ToAccHalf(float* __restrict d, const uint16_t* __restrict s, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) d[i + j] = ToF(s[i + j]);
  }
  for (; i < n; ++i) d[i] = ToF(s[i]);
}

template <uint16_t (*FromF)(float)>
void FromAccHalf(uint16_t* __restrict d, const float* __restrict s, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) d[i + j] = FromF(s[i + j]);
  }
  for (; i < n; ++i) d[i] = FromF(s[i]);
}

// dst (accumulation type) = src (`t`).
void ToAcc(void* dst, const void* src, size_t n, DType t) {
  if (!IsHalf(t)) {
    if (n != 0) std::memcpy(dst, src, n * DTypeSize(t));
    return;
  }
  float* d = static_cast<float*>(dst);
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (t == DType::kBF16) {
    ToAccHalf<&Bf16ToF>(d, s, n);
  } else {
    ToAccHalf<&HalfToFloat>(d, s, n);
  }
}

// dst (`t`) = src (accumulation type), rounding f32 to nearest even for f16/bf16.
void FromAcc(void* dst, const void* src, size_t n, DType t) {
  if (!IsHalf(t)) {
    if (n != 0) std::memmove(dst, src, n * DTypeSize(t));
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  const float* s = static_cast<const float*>(src);
  if (t == DType::kBF16) {
    FromAccHalf<&FToBf16>(d, s, n);
  } else {
    FromAccHalf<&FloatToHalf>(d, s, n);
  }
}

// acc[i] = op(acc[i], f32(x[i])) in f32: what ReduceInto(kF32) computes, fused with the
// conversion.
template <float (*ToF)(uint16_t)>
void AccumulateHalf(float* __restrict acc, const uint16_t* __restrict x, size_t n, ReduceOp op) {
  auto run = [&](auto combine) {
    size_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      for (size_t j = 0; j < kBlock; ++j) acc[i + j] = combine(acc[i + j], ToF(x[i + j]));
    }
    for (; i < n; ++i) acc[i] = combine(acc[i], ToF(x[i]));
  };
  switch (op) {
    case ReduceOp::kSum:
      return run([](float a, float b) { return a + b; });
    case ReduceOp::kMax:
      return run([](float a, float b) { return std::max(a, b); });
    case ReduceOp::kMin:
      return run([](float a, float b) { return std::min(a, b); });
  }
}

// acc[i] = op(acc[i], x[i]): acc in the accumulation type, x in `t`. For a partial result
// received from a peer, the partial comes first (with NaN operands, max/min depend on the
// argument order).
void Accumulate(void* acc, const void* x, size_t n, DType t, ReduceOp op) {
  if (!IsHalf(t)) {
    ReduceInto(acc, x, n, t, op);
    return;
  }
  float* a = static_cast<float*>(acc);
  const uint16_t* h = static_cast<const uint16_t*>(x);
  if (t == DType::kBF16) {
    AccumulateHalf<&Bf16ToF>(a, h, n, op);
  } else {
    AccumulateHalf<&HalfToFloat>(a, h, n, op);
  }
}

int Mod(int k, int n) { return ((k % n) + n) % n; }

// Element offsets of the `size` chunks of `count` elements: chunk c = [off[c], off[c+1]).
std::vector<size_t> ChunkOffsets(size_t count, int size) {
  std::vector<size_t> off(size + 1);
  for (int c = 0; c <= size; ++c) off[c] = count * c / size;
  return off;
}

// Ring reduce-scatter over chunks [off[c], off[c+1]) of `in` (elements of `t`); chunk `rank`,
// reduced, goes to `out` in `t`. Uses steps 0 .. size - 2.
Status RingReduceScatter(Messenger& m, int rank, int size, const uint8_t* in,
                         const std::vector<size_t>& off, uint8_t* out, DType t, ReduceOp op) {
  const size_t es = DTypeSize(t), as = AccSize(t);
  const int right = Mod(rank + 1, size), left = Mod(rank - 1, size);
  auto len = [&](int c) { return off[c + 1] - off[c]; };
  size_t max_chunk = 0;
  for (int c = 0; c < size; ++c) max_chunk = std::max(max_chunk, len(c));
  // Receive into one buffer while sending the other; they swap after every step.
  uint8_t* a = m.workspace().Get(0, max_chunk * as);
  uint8_t* b = m.workspace().Get(1, max_chunk * as);
  // Step 0 sends this rank's own values of chunk rank - 1 (as f32 for f16/bf16).
  const int first = Mod(rank - 1, size);
  const uint8_t* send = in + off[first] * es;
  if (IsHalf(t)) {
    ToAcc(b, send, len(first), t);
    send = b;
  }
  size_t send_bytes = len(first) * as;
  uint8_t* recv = a;
  for (int s = 0; s < size - 1; ++s) {
    const int c = Mod(rank - s - 2, size);  // the chunk arriving at this step
    m.Recv(left, s, recv, len(c) * as);
    m.Send(right, s, send, send_bytes);
    MORPH_RETURN_IF_ERROR(m.WaitAll());
    Accumulate(recv, in + off[c] * es, len(c), t, op);  // partial first
    send = recv;
    send_bytes = len(c) * as;
    recv = recv == a ? b : a;
  }
  // After size - 1 steps the last chunk combined is `rank` itself.
  FromAcc(out, send, len(rank), t);
  return Status::Ok();
}

// Ring allgather of byte ranges [off[c] * es, off[c+1] * es) of `buf`; this rank's chunk is
// in place. Uses steps step0 .. step0 + size - 2.
Status RingAllgather(Messenger& m, int rank, int size, uint8_t* buf, const std::vector<size_t>& off,
                     size_t es, uint32_t step0) {
  const int right = Mod(rank + 1, size), left = Mod(rank - 1, size);
  for (int s = 0; s < size - 1; ++s) {
    const int out = Mod(rank - s, size), in = Mod(rank - s - 1, size);
    m.Recv(left, step0 + s, buf + off[in] * es, (off[in + 1] - off[in]) * es);
    m.Send(right, step0 + s, buf + off[out] * es, (off[out + 1] - off[out]) * es);
    MORPH_RETURN_IF_ERROR(m.WaitAll());
  }
  return Status::Ok();
}

}  // namespace

void ReduceInRankOrder(Workspace& ws, const std::vector<const uint8_t*>& pieces, size_t count,
                       DType t, ReduceOp op, void* out) {
  // Block by block through an accumulator that stays in the L1 cache: each piece is read once
  // and `out` written once (a whole-buffer accumulator costs two more passes through memory;
  // the staging path of shm_large.cc reduces 128 KiB pieces, 64 KiB of f16 as 128 KiB of f32).
  // The same operations on every element as a whole-buffer pass, in the same order.
  constexpr size_t kBlockBytes = size_t{8} << 10;
  const size_t es = DTypeSize(t), as = AccSize(t), block = kBlockBytes / as;
  uint8_t* acc = ws.Get(2, std::min(count, block) * as);
  uint8_t* o = static_cast<uint8_t*>(out);
  for (size_t i = 0; i < count; i += block) {
    const size_t n = std::min(block, count - i);
    ToAcc(acc, pieces[0] + i * es, n, t);
    for (size_t p = 1; p < pieces.size(); ++p) Accumulate(acc, pieces[p] + i * es, n, t, op);
    FromAcc(o + i * es, acc, n, t);
  }
}

void AbortableWaits::Add(gloo::transport::UnboundBuffer* b) {
  std::lock_guard<std::mutex> lock(mu_);
  bufs_.push_back(b);
  if (aborted_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

void AbortableWaits::Remove(gloo::transport::UnboundBuffer* b) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase(bufs_, b);
}

void AbortableWaits::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = true;
  for (gloo::transport::UnboundBuffer* b : bufs_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

void Messenger::Track(gloo::transport::UnboundBuffer* b) {
  if (waits_ != nullptr) waits_->Add(b);
}

void Messenger::Forget() {
  if (waits_ != nullptr) {
    for (Posted& p : posted_) waits_->Remove(p.buf.get());
  }
  posted_.clear();
}

uint64_t Messenger::Slot(uint32_t step) const {
  return kSlotBase | (uint64_t{tag_ & 0x7fffffffu} << 16) | (step & 0xffffu);
}

void Messenger::Recv(int peer, uint32_t step, void* data, size_t bytes) {
  RecvFromSlot(peer, Slot(step), data, bytes);
}

void Messenger::RecvFromSlot(int peer, uint64_t slot, void* data, size_t bytes) {
  if (bytes == 0) return;
  auto buf = ctx_->createUnboundBuffer(data, bytes);
  Track(buf.get());
  posted_.push_back({std::move(buf), false, peer});
  posted_.back().buf->recv(peer, slot);
}

void Messenger::Send(int peer, uint32_t step, const void* data, size_t bytes) {
  SendToSlot(peer, Slot(step), data, bytes);
}

void Messenger::SendToSlot(int peer, uint64_t slot, const void* data, size_t bytes) {
  if (bytes == 0) return;
  auto buf = ctx_->createUnboundBuffer(const_cast<void*>(data), bytes);
  Track(buf.get());
  posted_.push_back({std::move(buf), true, peer});
  posted_.back().buf->send(peer, slot);
}

Mailboxes::Mailboxes(gloo::Context* ctx, int rank, int size, size_t bytes)
    : ctx_(ctx),
      rank_(rank),
      size_(size),
      bytes_(bytes),
      storage_(bytes * size * kDepth),
      bufs_(static_cast<size_t>(size) * kDepth) {
  for (uint64_t r = 0; r < kDepth; ++r) Post(r);
}

uint64_t Mailboxes::SlotOf(uint64_t round) {
  return kMailboxSlotBase | (round & ((uint64_t{1} << 56) - 1));
}

uint64_t Mailboxes::slot() const { return SlotOf(round_); }

const uint8_t* Mailboxes::data(int peer) const {
  return storage_.data() + bytes_ * (static_cast<size_t>(size_) * (round_ % kDepth) + peer);
}

void Mailboxes::Post(uint64_t round) {
  const size_t set = static_cast<size_t>(size_) * (round % kDepth);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    auto buf = ctx_->createUnboundBuffer(storage_.data() + bytes_ * (set + p), bytes_);
    buf->recv(p, SlotOf(round));
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) buf->abortWaitRecv();
    bufs_[set + p] = std::move(buf);
  }
}

void Mailboxes::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = true;
  for (auto& b : bufs_) {
    if (b != nullptr) b->abortWaitRecv();
  }
}

void Mailboxes::Next() {
  // The set just consumed takes round + kDepth: a peer sends that round only after this
  // rank's contribution to round + 1, which it sends after this call.
  Post(round_ + kDepth);
  ++round_;
}

Status Mailboxes::WaitAll(Deadline deadline, const std::string& what) {
  const size_t set = static_cast<size_t>(size_) * (round_ % kDepth);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    milliseconds left =
        std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline.Remaining()));
    if (!bufs_[set + p]->waitRecv(left)) {
      return AbortedError(what + ": receive from peer " + std::to_string(p) + " aborted");
    }
  }
  return Status::Ok();
}

Status Messenger::WaitAll() {
  for (Posted& p : posted_) {
    milliseconds left =
        std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline_.Remaining()));
    bool ok = p.send ? p.buf->waitSend(left) : p.buf->waitRecv(left);
    if (!ok) {
      return AbortedError(what_ + ": " + (p.send ? "send to" : "receive from") + " peer " +
                          std::to_string(p.peer) + " aborted");
    }
  }
  Forget();
  return Status::Ok();
}

Status AllreduceOneShot(Messenger& m, Mailboxes& mb, int rank, int size, void* buf, size_t count,
                        DType dtype, ReduceOp op) {
  const size_t bytes = count * DTypeSize(dtype);
  for (int k = 1; k < size; ++k) m.SendToSlot(Mod(rank + k, size), mb.slot(), buf, bytes);
  MORPH_RETURN_IF_ERROR(mb.WaitAll(m.deadline(), m.what()));
  MORPH_RETURN_IF_ERROR(m.WaitAll());  // sends done: buf may be overwritten
  std::vector<const uint8_t*> pieces(size);
  for (int p = 0; p < size; ++p) {
    pieces[p] = p == rank ? static_cast<const uint8_t*>(buf) : mb.data(p);
  }
  ReduceInRankOrder(m.workspace(), pieces, count, dtype, op, buf);  // reads buf, then writes it
  mb.Next();
  return Status::Ok();
}

Status AllreduceRing(Messenger& m, int rank, int size, void* buf, size_t count, DType dtype,
                     ReduceOp op) {
  const std::vector<size_t> off = ChunkOffsets(count, size);
  const size_t es = DTypeSize(dtype);
  uint8_t* b = static_cast<uint8_t*>(buf);
  // The reduced chunk `rank` is written over this rank's input chunk only after the last
  // step has read it.
  MORPH_RETURN_IF_ERROR(RingReduceScatter(m, rank, size, b, off, b + off[rank] * es, dtype, op));
  return RingAllgather(m, rank, size, b, off, es, static_cast<uint32_t>(size - 1));
}

Status ReduceScatterDirect(Messenger& m, Mailboxes& mb, int rank, int size, const void* in,
                           void* out, size_t count, DType dtype, ReduceOp op) {
  const size_t bytes = count * DTypeSize(dtype);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  for (int k = 1; k < size; ++k) {
    const int p = Mod(rank + k, size);
    m.SendToSlot(p, mb.slot(), src + bytes * p, bytes);
  }
  MORPH_RETURN_IF_ERROR(mb.WaitAll(m.deadline(), m.what()));
  std::vector<const uint8_t*> pieces(size);
  for (int p = 0; p < size; ++p) pieces[p] = p == rank ? src + bytes * rank : mb.data(p);
  ReduceInRankOrder(m.workspace(), pieces, count, dtype, op, out);
  MORPH_RETURN_IF_ERROR(m.WaitAll());
  mb.Next();
  return Status::Ok();
}

Status ReduceScatterRing(Messenger& m, int rank, int size, const void* in, void* out, size_t count,
                         DType dtype, ReduceOp op) {
  std::vector<size_t> off(size + 1);
  for (int c = 0; c <= size; ++c) off[c] = count * c;
  return RingReduceScatter(m, rank, size, static_cast<const uint8_t*>(in), off,
                           static_cast<uint8_t*>(out), dtype, op);
}

}  // namespace morph::gloo_algorithms
