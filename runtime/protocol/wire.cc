#include "runtime/protocol/wire.h"

#include <cstring>
#include <type_traits>
#include <utility>

namespace morph {
namespace {

// An id list item meaning "a run follows" (zigzag of +1: a single id one above the previous is
// always written as a run).
constexpr uint64_t kRunItem = 2;

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  // Each id as the zigzag LEB128 varint of its difference from the previous one (wrapping):
  // worker ids are small and mostly ascending, so a 4,096-rank list takes ~1 byte per id.
  // Items: varint(zigzag(id - previous)), except that a difference of +1 (zigzag 2) means a run:
  // varint(k >= 1) follows, and the k ids from the previous + 1 ascend by one (wire.h).
  void Ids(const std::vector<int64_t>& v) {
    U32(static_cast<uint32_t>(v.size()));
    uint64_t prev = 0;
    for (size_t i = 0; i < v.size();) {
      const uint64_t x = static_cast<uint64_t>(v[i]);
      if (x == prev + 1) {
        uint64_t k = 1;
        while (i + k < v.size() && static_cast<uint64_t>(v[i + k]) == x + k) ++k;
        Varint(kRunItem);
        Varint(k);
        prev = x + k - 1;
        i += k;
        continue;
      }
      const int64_t d = static_cast<int64_t>(x - prev);
      Varint((static_cast<uint64_t>(d) << 1) ^ static_cast<uint64_t>(d >> 63));
      prev = x;
      ++i;
    }
  }
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  std::string& out() { return out_; }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class Reader {
 public:
  Reader(std::string_view in, std::string_view what) : in_(in), what_(what) {}

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  void Fail(std::string_view field, std::string_view why) {
    if (status_.ok()) {
      status_ = InvalidArgumentError(std::string(what_) + "." + std::string(field) + ": " +
                                     std::string(why));
    }
  }
  uint64_t Le(int n, std::string_view field) {
    if (!ok()) return 0;
    if (in_.size() - pos_ < static_cast<size_t>(n)) {
      Fail(field, "truncated");
      return 0;
    }
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in_[pos_ + i])} << (8 * i);
    pos_ += n;
    return v;
  }
  uint8_t U8(std::string_view f) { return static_cast<uint8_t>(Le(1, f)); }
  uint32_t U32(std::string_view f) { return static_cast<uint32_t>(Le(4, f)); }
  uint64_t U64(std::string_view f) { return Le(8, f); }
  int32_t I32(std::string_view f) { return static_cast<int32_t>(U32(f)); }
  int64_t I64(std::string_view f) { return static_cast<int64_t>(U64(f)); }
  // A count of items of `item_bytes` each: never more than the bytes left can hold.
  uint32_t Count(std::string_view field, size_t item_bytes) {
    uint32_t n = U32(field);
    if (ok() && static_cast<uint64_t>(n) * item_bytes > in_.size() - pos_) {
      Fail(field, "count " + std::to_string(n) + " exceeds the " +
                      std::to_string(in_.size() - pos_) + " bytes left");
      return 0;
    }
    return ok() ? n : 0;
  }
  std::string Str(std::string_view field) {
    uint32_t n = Count(field, 1);
    if (!ok()) return {};
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::vector<int64_t> Ids(std::string_view field) {
    const uint32_t n = U32(field);
    if (!ok()) return {};
    if (n > kMaxIdList) {
      Fail(field, "count " + std::to_string(n) + " exceeds the limit of " +
                      std::to_string(kMaxIdList) + " ids");
      return {};
    }
    if (n > ids_left_) {
      Fail(field, "count " + std::to_string(n) + " takes the frame past " +
                      std::to_string(kMaxIdsPerFrame) + " ids in all");
      return {};
    }
    ids_left_ -= n;
    std::vector<int64_t> v;
    v.reserve(n);
    uint64_t prev = 0;
    bool after_run = false;
    while (v.size() < n && ok()) {
      const uint64_t z = Varint(field);
      if (!ok()) break;
      if (z == kRunItem) {
        // Two runs in a row are one run (not the shortest form).
        if (after_run) {
          Fail(field, "a run right after a run");
          break;
        }
        const uint64_t k = Varint(field);
        if (!ok()) break;
        if (k == 0 || k > n - v.size()) {
          Fail(field, "a run of " + std::to_string(k) + " ids with " +
                          std::to_string(n - v.size()) + " of the count left");
          break;
        }
        for (uint64_t j = 0; j < k; ++j) v.push_back(static_cast<int64_t>(++prev));
        after_run = true;
        continue;
      }
      prev += static_cast<uint64_t>(static_cast<int64_t>(z >> 1) ^ -static_cast<int64_t>(z & 1));
      v.push_back(static_cast<int64_t>(prev));
      after_run = false;
    }
    if (!ok()) return {};
    return v;
  }
  // Only the shortest encoding is accepted (so every accepted frame re-encodes to itself).
  uint64_t Varint(std::string_view field) {
    uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      if (!ok()) return 0;
      if (pos_ == in_.size()) {
        Fail(field, "truncated");
        return 0;
      }
      uint8_t b = static_cast<uint8_t>(in_[pos_++]);
      if (i == 9 && b > 1) {
        Fail(field, "varint overflows 64 bits");
        return 0;
      }
      v |= uint64_t{b & 0x7fu} << (7 * i);
      if (!(b & 0x80)) {
        if (b == 0 && i > 0) Fail(field, "varint not in its shortest form");
        return v;
      }
    }
    Fail(field, "varint longer than 10 bytes");
    return 0;
  }
  void End() {
    if (ok() && pos_ != in_.size()) {
      Fail("end", std::to_string(in_.size() - pos_) + " trailing bytes");
    }
  }

 private:
  uint32_t ids_left_ = kMaxIdsPerFrame;  // ids the frame's lists may still hold
  std::string_view in_;
  std::string_view what_;
  size_t pos_ = 0;
  Status status_;
};

void Put(Writer& w, const ParallelConfig& c) {
  w.I32(c.dp);
  w.I32(c.tp);
  w.I32(c.pp);
  w.I32(c.zero_stage);
  w.I32(c.micro_batches);
  w.U32(static_cast<uint32_t>(c.stage_of_layer.size()));
  for (int s : c.stage_of_layer) w.I32(s);
}
void Get(Reader& r, ParallelConfig& c) {
  c.dp = r.I32("config.dp");
  c.tp = r.I32("config.tp");
  c.pp = r.I32("config.pp");
  c.zero_stage = r.I32("config.zero_stage");
  c.micro_batches = r.I32("config.micro_batches");
  uint32_t n = r.Count("config.stage_of_layer", 4);
  c.stage_of_layer.clear();
  c.stage_of_layer.reserve(n);
  for (uint32_t i = 0; i < n && r.ok(); ++i) c.stage_of_layer.push_back(r.I32("config.stage"));
  if (r.ok()) {
    Status s = c.Validate();
    if (!s.ok()) r.Fail("config", s.message());
  }
}

void Put(Writer& w, const Generation& g) {
  w.I64(g.id);
  w.I64(g.start_step);
  Put(w, g.config);
  w.Ids(g.ranks);
  w.U64(g.plan_digest);
}
void Get(Reader& r, Generation& g) {
  g.id = r.I64("generation.id");
  g.start_step = r.I64("generation.start_step");
  Get(r, g.config);
  g.ranks = r.Ids("generation.ranks");
  g.plan_digest = r.U64("generation.plan_digest");
  // Generation 0 (none yet: a change from nothing) has no ranks.
  if (r.ok() && !(g.id == 0 && g.ranks.empty()) &&
      static_cast<int64_t>(g.ranks.size()) != g.config.world()) {
    r.Fail("generation.ranks", std::to_string(g.ranks.size()) + " ranks for a world of " +
                                   std::to_string(g.config.world()));
  }
}

void Put(Writer& w, const ChangeParticipants& c) {
  w.Ids(c.participants);
  w.Ids(c.leavers);
  w.Ids(c.exiting);
  w.Ids(c.lost);
  w.U8(c.recovery ? 1 : 0);
  w.Ids(c.stale);
}
uint8_t GetBool(Reader& r, std::string_view field);
void Get(Reader& r, ChangeParticipants& c) {
  c.participants = r.Ids("change.participants");
  c.leavers = r.Ids("change.leavers");
  c.exiting = r.Ids("change.exiting");
  c.lost = r.Ids("change.lost");
  c.recovery = GetBool(r, "change.recovery") == 1;
  c.stale = r.Ids("change.stale");
}

void Put(Writer& w, const HelloMsg& m) {
  w.Str(m.token);
  w.Str(m.host);
  w.I64(m.pid);
  w.U64(m.capabilities);
  w.I64(m.resume_id);
}
void Get(Reader& r, HelloMsg& m) {
  m.token = r.Str("token");
  m.host = r.Str("host");
  m.pid = r.I64("pid");
  m.capabilities = r.U64("capabilities");
  m.resume_id = r.I64("resume_id");
}
void Put(Writer& w, const WelcomeMsg& m) {
  w.I64(m.worker);
  w.I64(m.generation);
  w.Str(m.store_address);
  Put(w, m.current);
  w.I64(m.first_generation);
}
void Get(Reader& r, WelcomeMsg& m) {
  m.worker = r.I64("worker");
  m.generation = r.I64("generation");
  m.store_address = r.Str("store_address");
  Get(r, m.current);
  m.first_generation = r.I64("first_generation");
  if (r.ok() && m.current.id != m.generation) {
    r.Fail("current", "generation " + std::to_string(m.current.id) + " is not generation " +
                          std::to_string(m.generation));
  }
}

void PutInts(Writer& w, const std::vector<int>& v) {
  w.U32(static_cast<uint32_t>(v.size()));
  for (int x : v) w.I32(x);
}
std::vector<int> GetInts(Reader& r, std::string_view field) {
  uint32_t n = r.Count(field, 4);
  std::vector<int> v;
  v.reserve(n);
  for (uint32_t i = 0; i < n && r.ok(); ++i) v.push_back(r.I32(field));
  return v;
}
uint8_t GetBool(Reader& r, std::string_view field) {
  uint8_t b = r.U8(field);
  if (r.ok() && b > 1) r.Fail(field, "not a boolean");
  return b;
}

// The smallest encodings of a tensor (empty name and shape) and a scalar (empty name): the
// bounds for their counts.
constexpr size_t kMinTensorBytes = 4 + 1 + 4 + 4 + 4 + 1 + 4 + 4 + 4 + 4;
constexpr size_t kMinScalarBytes = 4 + 8;

void Put(Writer& w, const RegisterMsg& msg) {
  const JobManifest& m = msg.manifest;
  w.I32(m.model.num_layers);
  w.I32(m.model.num_heads);
  PutInts(w, m.model.tp_candidates);
  PutInts(w, m.model.pp_candidates);
  w.I64(m.model.global_batch);
  w.I32(m.model.micro_batches);
  w.I32(m.model.zero_stage);
  w.I64(m.model.device_memory_bytes);
  w.U32(static_cast<uint32_t>(m.tensors.size()));
  for (const TensorSpec& t : m.tensors) {
    w.Str(t.name);
    w.U8(static_cast<uint8_t>(t.dtype));
    w.Ids(t.shape);
    w.I32(t.layout.layer());
    w.I32(t.layout.tp_dim());
    w.U8(t.layout.zero_sharded() ? 1 : 0);
    PutInts(w, t.layout.extra_layers());
    w.I32(t.layout.tp_blocks());
    w.I32(t.layout.pad_multiple());
    w.I32(t.layout.zero_group());
  }
  w.U32(static_cast<uint32_t>(m.scalars.size()));
  for (const ScalarSpec& s : m.scalars) {
    w.Str(s.name);
    w.I64(s.bytes);
  }
  w.Str(m.backend);
  w.I64(m.dataset_samples);
  w.U64(m.dataset_seed);
  w.U8(m.dataset_shuffle ? 1 : 0);
  w.U64(m.chunk_bytes);
  w.U64(m.staging_bytes);
}
// Only the encoding is checked here (counts, enum values, booleans); what the values mean is
// ValidateManifest's, on the coordinator.
void Get(Reader& r, RegisterMsg& msg) {
  JobManifest& m = msg.manifest;
  m.model.num_layers = r.I32("model.num_layers");
  m.model.num_heads = r.I32("model.num_heads");
  m.model.tp_candidates = GetInts(r, "model.tp_candidates");
  m.model.pp_candidates = GetInts(r, "model.pp_candidates");
  m.model.global_batch = r.I64("model.global_batch");
  m.model.micro_batches = r.I32("model.micro_batches");
  m.model.zero_stage = r.I32("model.zero_stage");
  m.model.device_memory_bytes = r.I64("model.device_memory_bytes");
  uint32_t nt = r.Count("tensors", kMinTensorBytes);
  m.tensors.clear();
  m.tensors.reserve(nt);
  for (uint32_t i = 0; i < nt && r.ok(); ++i) {
    TensorSpec t;
    t.name = r.Str("tensor.name");
    uint8_t dtype = r.U8("tensor.dtype");
    if (r.ok() && dtype > static_cast<uint8_t>(DType::kU8)) {
      r.Fail("tensor.dtype", "not a dtype: " + std::to_string(dtype));
    }
    t.dtype = static_cast<DType>(dtype);
    t.shape = r.Ids("tensor.shape");
    int layer = r.I32("tensor.layer");
    int tp_dim = r.I32("tensor.tp_dim");
    uint8_t zero = GetBool(r, "tensor.zero");
    std::vector<int> extra = GetInts(r, "tensor.extra_layers");
    int blocks = r.I32("tensor.tp_blocks");
    int pad = r.I32("tensor.pad_multiple");
    int group = r.I32("tensor.zero_group");
    // The builders in the order that reproduces every field (SplitTPBlocks sets tp_dim too;
    // ZeroShard(group) sets zero).
    Layout l = Layout::Layer(layer);
    for (int x : extra) l = l.AlsoOnLayer(x);
    l = blocks != 1 ? l.SplitTPBlocks(tp_dim, blocks) : l.SplitTP(tp_dim);
    if (pad != 0) l = l.PadToMultiple(pad);
    if (zero == 1) l = group != 0 ? l.ZeroShard(group) : l.ZeroShard(true);
    else if (r.ok() && group != 0) r.Fail("tensor.zero_group", "set without ZeRO");
    t.layout = l;
    m.tensors.push_back(std::move(t));
  }
  uint32_t ns = r.Count("scalars", kMinScalarBytes);
  m.scalars.clear();
  m.scalars.reserve(ns);
  for (uint32_t i = 0; i < ns && r.ok(); ++i) {
    ScalarSpec s;
    s.name = r.Str("scalar.name");
    s.bytes = r.I64("scalar.bytes");
    m.scalars.push_back(std::move(s));
  }
  m.backend = r.Str("backend");
  m.dataset_samples = r.I64("dataset_samples");
  m.dataset_seed = r.U64("dataset_seed");
  m.dataset_shuffle = GetBool(r, "dataset_shuffle") == 1;
  m.chunk_bytes = r.U64("chunk_bytes");
  m.staging_bytes = r.U64("staging_bytes");
}
void Put(Writer&, const DoneMsg&) {}
void Get(Reader&, DoneMsg&) {}
void Put(Writer& w, const HeartbeatMsg& m) { w.I64(m.step); }
void Get(Reader& r, HeartbeatMsg& m) { m.step = r.I64("step"); }
void Put(Writer& w, const LeaveMsg& m) { w.Str(m.reason); }
void Get(Reader& r, LeaveMsg& m) { m.reason = r.Str("reason"); }
void Put(Writer& w, const ErrorMsg& m) {
  w.I32(m.code);
  w.Str(m.message);
}
void Get(Reader& r, ErrorMsg& m) {
  m.code = r.I32("code");
  m.message = r.Str("message");
  if (r.ok() && (m.code <= 0 || m.code > static_cast<int32_t>(StatusCode::kUnauthenticated))) {
    r.Fail("code", "not a status code: " + std::to_string(m.code));
  }
}
// Prepare and Commit carry the same fields (a commit's start step is set).
template <typename M>
requires std::is_same_v<M, PrepareMsg> || std::is_same_v<M, CommitMsg>
void Put(Writer& w, const M& m) {
  Put(w, m.next);
  w.I64(m.from_generation);
  Put(w, m.from);
  Put(w, m.change);
  if constexpr (std::is_same_v<M, CommitMsg>) {
    w.U8(static_cast<uint8_t>(m.recovery.source));
    w.I64(m.recovery.newest_step);
    w.Str(m.recovery.checkpoint);
    w.Ids(m.recovery.snapshot_holders);
  }
}
template <typename M>
requires std::is_same_v<M, PrepareMsg> || std::is_same_v<M, CommitMsg>
void Get(Reader& r, M& m) {
  Get(r, m.next);
  m.from_generation = r.I64("from_generation");
  Get(r, m.from);
  if (r.ok() && m.from.id != m.from_generation) {
    r.Fail("from", "generation " + std::to_string(m.from.id) + " is not from_generation " +
                       std::to_string(m.from_generation));
  }
  Get(r, m.change);
  if constexpr (std::is_same_v<M, CommitMsg>) {
    uint8_t source = r.U8("recovery.source");
    if (r.ok() && source > static_cast<uint8_t>(RecoveryDecision::Source::kCheckpoint)) {
      r.Fail("recovery.source", "not a source: " + std::to_string(source));
    }
    m.recovery.source = static_cast<RecoveryDecision::Source>(source);
    m.recovery.newest_step = r.I64("recovery.newest_step");
    m.recovery.checkpoint = r.Str("recovery.checkpoint");
    m.recovery.snapshot_holders = r.Ids("recovery.snapshot_holders");
  }
}
void Put(Writer& w, const StepReportMsg& m) {
  w.I64(m.worker);
  w.I64(m.generation);
  w.I64(m.last_free_step);
  w.I64(m.state_step);
  w.U8(m.state_ok ? 1 : 0);
  w.I64(m.snapshots.local_step);
  w.I64(m.snapshots.local_prev_step);
  w.I64(m.snapshots.held_step);
  w.I64(m.snapshots.held_prev_step);
  w.I64(m.snapshots.held_rank);
  w.Ids(m.snapshots.held_tensors);
  w.I64(m.undo_step);
  w.I64(m.vote_step);
  w.I64(m.committed_step);
}
void Get(Reader& r, StepReportMsg& m) {
  m.worker = r.I64("worker");
  m.generation = r.I64("generation");
  m.last_free_step = r.I64("last_free_step");
  m.state_step = r.I64("state_step");
  m.state_ok = GetBool(r, "state_ok") == 1;
  m.snapshots.local_step = r.I64("snapshots.local_step");
  m.snapshots.local_prev_step = r.I64("snapshots.local_prev_step");
  m.snapshots.held_step = r.I64("snapshots.held_step");
  m.snapshots.held_prev_step = r.I64("snapshots.held_prev_step");
  m.snapshots.held_rank = r.I64("snapshots.held_rank");
  m.snapshots.held_tensors = r.Ids("snapshots.held_tensors");
  m.undo_step = r.I64("undo_step");
  m.vote_step = r.I64("vote_step");
  m.committed_step = r.I64("committed_step");
}
void Put(Writer& w, const AbortMsg& m) {
  w.I64(m.generation);
  w.Str(m.reason);
}
void Get(Reader& r, AbortMsg& m) {
  m.generation = r.I64("generation");
  m.reason = r.Str("reason");
}
void Put(Writer& w, const FailureReportMsg& m) {
  w.I64(m.generation);
  w.I64(m.step);
  w.Ids(m.peers);
  w.Str(m.error);
}
void Get(Reader& r, FailureReportMsg& m) {
  m.generation = r.I64("generation");
  m.step = r.I64("step");
  m.peers = r.Ids("peers");
  m.error = r.Str("error");
}
void Put(Writer& w, const AbandonMsg& m) { w.I64(m.generation); }
void Get(Reader& r, AbandonMsg& m) { m.generation = r.I64("generation"); }
void Put(Writer& w, const AppliedMsg& m) {
  w.I64(m.worker);
  w.I64(m.generation);
  w.U8(m.ok ? 1 : 0);
  w.Str(m.error);
  for (int64_t v : {m.phases.communicators_us, m.phases.plan_us, m.phases.transfer_us,
                    m.phases.resume_us, m.phases.stall_us}) {
    w.I64(v);
  }
}
void Get(Reader& r, AppliedMsg& m) {
  m.worker = r.I64("worker");
  m.generation = r.I64("generation");
  uint8_t ok = r.U8("ok");
  if (r.ok() && ok > 1) r.Fail("ok", "not a boolean");
  m.ok = ok == 1;
  m.error = r.Str("error");
  for (auto [field, v] : {std::pair{"phases.communicators_us", &m.phases.communicators_us},
                          std::pair{"phases.plan_us", &m.phases.plan_us},
                          std::pair{"phases.transfer_us", &m.phases.transfer_us},
                          std::pair{"phases.resume_us", &m.phases.resume_us},
                          std::pair{"phases.stall_us", &m.phases.stall_us}}) {
    *v = r.I64(field);
    if (r.ok() && *v < 0) r.Fail(field, "negative duration");
  }
}
void Put(Writer& w, const OutcomeMsg& m) {
  w.I64(m.generation);
  w.U8(m.applied ? 1 : 0);
}
void Get(Reader& r, OutcomeMsg& m) {
  m.generation = r.I64("generation");
  uint8_t a = r.U8("applied");
  if (r.ok() && a > 1) r.Fail("applied", "not a boolean");
  m.applied = a == 1;
}
void Put(Writer& w, const ReleaseMsg& m) { w.I64(m.generation); }
void Get(Reader& r, ReleaseMsg& m) { m.generation = r.I64("generation"); }

template <size_t I = 0>
StatusOr<WireMessage> DecodeAs(size_t index, std::string_view body) {
  if constexpr (I < std::variant_size_v<WireMessage>) {
    if (index == I) {
      std::variant_alternative_t<I, WireMessage> m;
      Reader r(body, WireTypeName(static_cast<uint16_t>(I + 1)));
      Get(r, m);
      r.End();
      if (!r.ok()) return r.status();
      return WireMessage(std::move(m));
    }
    return DecodeAs<I + 1>(index, body);
  } else {
    return InvalidArgumentError("frame: unknown type");
  }
}

}  // namespace

std::string_view WireTypeName(uint16_t type) {
  static constexpr std::string_view kNames[] = {
      "?",           "hello",  "welcome", "heartbeat", "leave",   "error",  "prepare",
      "step_report", "commit", "abandon", "applied",   "outcome", "release", "register",
      "done",        "failure_report", "abort"};
  return type < std::size(kNames) ? kNames[type] : "?";
}

std::string EncodeFrame(const WireMessage& m) {
  Writer body;
  std::visit([&](const auto& msg) { Put(body, msg); }, m);
  Writer w;
  w.U32(kWireMagic);
  w.U16(kWireVersion);
  w.U16(static_cast<uint16_t>(m.index() + 1));
  w.U32(static_cast<uint32_t>(body.out().size()));
  w.out().append(body.out());
  return std::move(w.out());
}

StatusOr<FrameHeader> DecodeHeader(std::string_view header) {
  if (header.size() < kFrameHeaderBytes) {
    return InvalidArgumentError("frame: header of " + std::to_string(header.size()) +
                                " bytes, expected 12");
  }
  Reader r(header.substr(0, kFrameHeaderBytes), "frame");
  uint32_t magic = r.U32("magic");
  FrameHeader h;
  h.version = static_cast<uint16_t>(r.Le(2, "version"));
  h.type = static_cast<uint16_t>(r.Le(2, "type"));
  h.length = r.U32("length");
  if (magic != kWireMagic) return InvalidArgumentError("frame: bad magic (not a morph peer)");
  if (h.version != kWireVersion) {
    return FailedPreconditionError("frame: wire version " + std::to_string(h.version) +
                                   ", this side speaks " + std::to_string(kWireVersion));
  }
  if (h.type == 0 || h.type > std::variant_size_v<WireMessage>) {
    return InvalidArgumentError("frame: unknown type " + std::to_string(h.type));
  }
  uint32_t limit =
      h.type == static_cast<uint16_t>(WireType::kHello) ? kMaxHelloBody : kMaxFrameBody;
  if (h.length > limit) {
    return InvalidArgumentError("frame: " + std::string(WireTypeName(h.type)) + " body of " +
                                std::to_string(h.length) + " bytes exceeds " +
                                std::to_string(limit));
  }
  return h;
}

StatusOr<WireMessage> DecodeBody(const FrameHeader& header, std::string_view body) {
  if (body.size() != header.length) {
    return InvalidArgumentError("frame: body of " + std::to_string(body.size()) +
                                " bytes, header says " + std::to_string(header.length));
  }
  return DecodeAs(header.type - 1, body);
}

StatusOr<WireMessage> DecodeFrame(std::string_view frame) {
  MORPH_ASSIGN_OR_RETURN(FrameHeader h, DecodeHeader(frame));
  return DecodeBody(h, frame.substr(kFrameHeaderBytes));
}

}  // namespace morph
