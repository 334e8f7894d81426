#include "collectives/testing/collective_checks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

namespace morph {
namespace {

constexpr DType kTypes[] = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                            DType::kI32, DType::kI64, DType::kU8, DType::kI8};
constexpr size_t kCounts[] = {0, 1, 7, 1001, 20001};

// Small integers: exact in every type, sums included (|sum| <= 252 for 8 ranks; for i8 the
// values are -1, 0, 1, so |sum| <= 8).
double Value(DType t, int rank, size_t i) {
  if (t == DType::kI8) return static_cast<double>((static_cast<size_t>(rank) + i) % 3) - 1;
  double v = (rank + 1) * static_cast<double>(i % 7 + 1);
  if (t != DType::kU8 && i % 2 == 1) v = -v;
  return v;
}

void Put(DType t, void* buf, size_t i, double v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(buf)[i] = static_cast<float>(v);
      break;
    case DType::kF64:
      static_cast<double*>(buf)[i] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(buf)[i] = FloatToHalf(static_cast<float>(v));
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(buf)[i] = FloatToBFloat16(static_cast<float>(v));
      break;
    case DType::kI32:
      static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v);
      break;
    case DType::kI64:
      static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v);
      break;
    case DType::kU8:
      static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(v);
      break;
    case DType::kI8:
      static_cast<int8_t*>(buf)[i] = static_cast<int8_t>(v);
      break;
  }
}

double Get(DType t, const void* buf, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(buf)[i];
    case DType::kF64:
      return static_cast<const double*>(buf)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::kBF16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case DType::kI32:
      return static_cast<const int32_t*>(buf)[i];
    case DType::kI64:
      return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
    case DType::kU8:
      return static_cast<const uint8_t*>(buf)[i];
    case DType::kI8:
      return static_cast<const int8_t*>(buf)[i];
  }
  return 0;
}

double Reduce(DType t, ReduceOp op, int world, size_t i) {
  double acc = Value(t, 0, i);
  for (int r = 1; r < world; ++r) {
    double v = Value(t, r, i);
    acc = op == ReduceOp::kSum   ? acc + v
          : op == ReduceOp::kMax ? std::max(acc, v)
                                 : std::min(acc, v);
  }
  return acc;
}

Status Mismatch(std::string_view what, DType t, size_t count, size_t i, double got,
                double want) {
  std::ostringstream m;
  m << what << " " << DTypeName(t) << " count " << count << ": element " << i << " is " << got
    << ", expected " << want;
  return InternalError(m.str());
}

// Values whose sum depends on the order of the additions: mixed signs, magnitudes 2^-8..2^8.
double OrderSensitiveValue(int rank, size_t i) {
  uint64_t h = (static_cast<uint64_t>(rank) * 1000003u + i) * 0x9E3779B97F4A7C15ull;
  h ^= h >> 29;
  double mant = static_cast<double>(static_cast<int64_t>(h % 20001) - 10000) / 1000.0;
  return std::ldexp(mant, static_cast<int>((h >> 32) % 17) - 8);
}

// Element j of rank r's input, as stored in type t (rounded), in the accumulation type
// (double for f64, float otherwise: f16/bf16 are summed in f32).
double Stored(DType t, int rank, size_t j) {
  uint8_t tmp[8];
  Put(t, tmp, 0, OrderSensitiveValue(rank, j));
  return Get(t, tmp, 0);
}

// The sum over ranks `order` of element j, accumulated like the backend, written into
// element i of `out` (type t).
void ReferenceSum(DType t, const std::vector<int>& order, size_t j, void* out, size_t i) {
  if (t == DType::kF64) {
    double acc = Stored(t, order[0], j);
    for (size_t k = 1; k < order.size(); ++k) acc = acc + Stored(t, order[k], j);
    Put(t, out, i, acc);
    return;
  }
  float acc = static_cast<float>(Stored(t, order[0], j));
  for (size_t k = 1; k < order.size(); ++k) acc = acc + static_cast<float>(Stored(t, order[k], j));
  Put(t, out, i, acc);  // f16/bf16: the one rounding
}

std::vector<int> RankOrder(int world) {
  std::vector<int> o(world);
  for (int r = 0; r < world; ++r) o[r] = r;
  return o;
}

// Ring order of chunk c: c+1, c+2, ..., c (mod world).
std::vector<int> RingOrder(int world, int c) {
  std::vector<int> o(world);
  for (int k = 0; k < world; ++k) o[k] = (c + 1 + k) % world;
  return o;
}

Status CompareBits(std::string_view what, DType t, size_t count, const void* got,
                   const void* want) {
  const size_t es = DTypeSize(t);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const uint8_t*>(got) + i * es,
                    static_cast<const uint8_t*>(want) + i * es, es) != 0) {
      return Mismatch(what, t, count, i, Get(t, got, i), Get(t, want, i));
    }
  }
  return Status::Ok();
}

}  // namespace

Status CheckReductionOrder(Communicator& comm, size_t one_shot_max_bytes,
                           std::chrono::milliseconds timeout) {
  const int rank = comm.rank(), world = comm.size();
  // Integer sums and max/min do not depend on the order (CheckAllCollectives covers them).
  for (DType t : {DType::kF32, DType::kF64, DType::kF16, DType::kBF16}) {
    const size_t es = DTypeSize(t);
    for (size_t count : kCounts) {
      // Allreduce.
      std::vector<uint8_t> buf(std::max<size_t>(1, count * es)), want(buf.size());
      for (size_t j = 0; j < count; ++j) Put(t, buf.data(), j, OrderSensitiveValue(rank, j));
      const bool one_shot = count * es <= one_shot_max_bytes;
      // Above the one-round size f32/f64 take Gloo's own ring: its order is Gloo's, so only
      // check that every rank holds the same bits.
      const bool gloo_order = !one_shot && (t == DType::kF32 || t == DType::kF64);
      for (int c = 0; c < world; ++c) {
        const size_t lo = count * c / world, hi = count * (c + 1) / world;
        std::vector<int> order = one_shot ? RankOrder(world) : RingOrder(world, c);
        for (size_t j = lo; j < hi; ++j) ReferenceSum(t, order, j, want.data(), j);
      }
      MORPH_RETURN_IF_ERROR(comm.Allreduce(buf.data(), count, t, ReduceOp::kSum, timeout))
          << "allreduce " << DTypeName(t) << " count " << count;
      if (gloo_order) {
        std::vector<uint8_t> all(std::max<size_t>(1, count * es * world));
        MORPH_RETURN_IF_ERROR(
            comm.Allgather(buf.data(), all.data(), count * es, DType::kU8, timeout));
        for (int r = 1; r < world; ++r) {
          MORPH_RETURN_IF_ERROR(
              CompareBits("allreduce sum (rank " + std::to_string(r) + " against rank 0)", t, count,
                          all.data() + r * count * es, all.data()));
        }
      } else {
        MORPH_RETURN_IF_ERROR(
            CompareBits(std::string("allreduce sum (") + (one_shot ? "rank" : "ring") + " order)",
                        t, count, buf.data(), want.data()));
      }
      // Reduce-scatter: this rank's piece of count elements out of count * world.
      std::vector<uint8_t> in(std::max<size_t>(1, count * es * world));
      for (size_t j = 0; j < count * world; ++j) Put(t, in.data(), j, OrderSensitiveValue(rank, j));
      const bool direct = count * es * world <= one_shot_max_bytes;
      std::vector<int> order = direct ? RankOrder(world) : RingOrder(world, rank);
      std::vector<uint8_t> out(std::max<size_t>(1, count * es)), want_out(out.size());
      for (size_t i = 0; i < count; ++i)
        ReferenceSum(t, order, rank * count + i, want_out.data(), i);
      MORPH_RETURN_IF_ERROR(
          comm.ReduceScatter(in.data(), out.data(), count, t, ReduceOp::kSum, timeout))
          << "reduce_scatter " << DTypeName(t) << " count " << count;
      MORPH_RETURN_IF_ERROR(
          CompareBits(std::string("reduce_scatter sum (") + (direct ? "rank" : "ring") + " order)",
                      t, count, out.data(), want_out.data()));
    }
  }
  return Status::Ok();
}

Status CheckAllCollectives(Communicator& comm, std::chrono::milliseconds timeout) {
  const int rank = comm.rank(), world = comm.size();
  for (DType t : kTypes) {
    const size_t es = DTypeSize(t);
    for (size_t count : kCounts) {
      std::vector<uint8_t> buf(std::max<size_t>(1, count * es));
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        for (size_t i = 0; i < count; ++i) Put(t, buf.data(), i, Value(t, rank, i));
        MORPH_RETURN_IF_ERROR(comm.Allreduce(buf.data(), count, t, op, timeout))
            << "allreduce " << ReduceOpName(op) << " " << DTypeName(t) << " count " << count;
        for (size_t i = 0; i < count; ++i) {
          double want = Reduce(t, op, world, i), got = Get(t, buf.data(), i);
          if (got != want) {
            return Mismatch("allreduce " + std::string(ReduceOpName(op)), t, count, i, got, want);
          }
        }
      }
      for (int root : {0, world - 1}) {
        for (size_t i = 0; i < count; ++i) Put(t, buf.data(), i, Value(t, rank, i));
        MORPH_RETURN_IF_ERROR(comm.Broadcast(buf.data(), count, t, root, timeout))
            << "broadcast " << DTypeName(t) << " count " << count;
        for (size_t i = 0; i < count; ++i) {
          double want = Value(t, root, i), got = Get(t, buf.data(), i);
          if (got != want) return Mismatch("broadcast", t, count, i, got, want);
        }
      }
      {
        std::vector<uint8_t> out(std::max<size_t>(1, count * es * world));
        for (size_t i = 0; i < count; ++i) Put(t, buf.data(), i, Value(t, rank, i));
        MORPH_RETURN_IF_ERROR(comm.Allgather(buf.data(), out.data(), count, t, timeout))
            << "allgather " << DTypeName(t) << " count " << count;
        for (int r = 0; r < world; ++r) {
          for (size_t i = 0; i < count; ++i) {
            double want = Value(t, r, i), got = Get(t, out.data(), r * count + i);
            if (got != want) return Mismatch("allgather", t, count, r * count + i, got, want);
          }
        }
      }
      {
        // Rank r contributes Value(t, r, j) for j over the whole input of count * world.
        std::vector<uint8_t> in(std::max<size_t>(1, count * es * world));
        for (size_t j = 0; j < count * world; ++j) Put(t, in.data(), j, Value(t, rank, j));
        std::vector<uint8_t> out(std::max<size_t>(1, count * es));
        MORPH_RETURN_IF_ERROR(
            comm.ReduceScatter(in.data(), out.data(), count, t, ReduceOp::kSum, timeout))
            << "reduce_scatter " << DTypeName(t) << " count " << count;
        for (size_t i = 0; i < count; ++i) {
          double want = Reduce(t, ReduceOp::kSum, world, rank * count + i);
          double got = Get(t, out.data(), i);
          if (got != want) return Mismatch("reduce_scatter sum", t, count, i, got, want);
        }
      }
    }
  }
  MORPH_RETURN_IF_ERROR(comm.Barrier(timeout)) << "barrier";
  return CheckSendRecv(comm, timeout);
}

Status CheckSendRecv(Communicator& comm, std::chrono::milliseconds timeout) {
  const int rank = comm.rank(), world = comm.size();
  if (world == 1) return Status::Ok();
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  // Three messages to the next rank in one group, sizes 1, 0 and 4099 bytes, then a second
  // group: order between a pair must hold across and within groups.
  for (int round = 0; round < 2; ++round) {
    const size_t sizes[] = {1, 0, 4099};
    std::vector<std::vector<uint8_t>> out(3), in(3);
    std::vector<P2POp> ops;
    for (int m = 0; m < 3; ++m) {
      out[m].resize(sizes[m]);
      for (size_t i = 0; i < sizes[m]; ++i) {
        out[m][i] = static_cast<uint8_t>(rank * 31 + m * 7 + round * 3 + i);
      }
      in[m].assign(sizes[m], 0xEE);
      ops.push_back({P2POp::Kind::kSend, next, out[m].data(), sizes[m]});
      ops.push_back({P2POp::Kind::kRecv, prev, in[m].data(), sizes[m]});
    }
    MORPH_RETURN_IF_ERROR(comm.SendRecv(ops, timeout)) << "send/recv round " << round;
    for (int m = 0; m < 3; ++m) {
      for (size_t i = 0; i < sizes[m]; ++i) {
        auto want = static_cast<uint8_t>(prev * 31 + m * 7 + round * 3 + i);
        if (in[m][i] != want) {
          return InternalError("send/recv round " + std::to_string(round) + " message " +
                               std::to_string(m) + " byte " + std::to_string(i) + " is " +
                               std::to_string(in[m][i]) + ", expected " + std::to_string(want));
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace morph
