#include "collectives/fake_nccl.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace morph {

// ---------------------------------------------------------------------------------------------
// FakeDevice

StatusOr<Buffer> FakeDevice::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (capacity_ >= 0 && held_ + static_cast<int64_t>(bytes) > capacity_) {
      return ResourceExhaustedError("fake device: " + std::to_string(bytes) +
                                    " bytes do not fit (" + std::to_string(held_) + " of " +
                                    std::to_string(capacity_) + " held)");
    }
    held_ += static_cast<int64_t>(bytes);
    peak_ = std::max(peak_, held_);
  }
  char* p = new char[bytes];
  Register(p, bytes);
  std::weak_ptr<FakeDevice> self = weak_from_this();
  return Buffer::Adopt(p, bytes, MemoryKind::kHost, [self, bytes](void* q) {
    if (auto d = self.lock()) {
      d->Unregister(q);
      std::lock_guard<std::mutex> l(d->mu_);
      d->held_ -= static_cast<int64_t>(bytes);
    }
    delete[] static_cast<char*>(q);
  });
}

Allocator FakeDevice::allocator() {
  std::shared_ptr<FakeDevice> self = shared_from_this();
  return [self](size_t bytes) { return self->Allocate(bytes); };
}

void FakeDevice::Register(const void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return;
  if (node_) node_->Register(p, bytes);
  std::lock_guard<std::mutex> l(mu_);
  ranges_[reinterpret_cast<uintptr_t>(p)] = bytes;
}

void FakeDevice::Unregister(const void* p) {
  if (node_) node_->Unregister(p);
  std::lock_guard<std::mutex> l(mu_);
  ranges_.erase(reinterpret_cast<uintptr_t>(p));
}

bool FakeDevice::Contains(const void* p, size_t bytes) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> l(mu_);
  auto it = ranges_.upper_bound(a);
  if (it == ranges_.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second;
}

int64_t FakeDevice::held_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return held_;
}

void FakeDevice::ResetPeak() {
  std::lock_guard<std::mutex> l(mu_);
  peak_ = held_;
}

int64_t FakeDevice::peak_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return peak_;
}

namespace {

class FakeDeviceMemory final : public DeviceMemory {
 public:
  explicit FakeDeviceMemory(std::shared_ptr<FakeDevice> d) : d_(std::move(d)) {}
  std::string name() const override { return "fake device"; }
  void* stream() const override { return nullptr; }
  bool IsDevice(const void* p, size_t bytes) const override { return d_->Contains(p, bytes); }
  StatusOr<Buffer> Allocate(size_t bytes) override { return d_->Allocate(bytes); }
  Allocator StagingAllocator() override { return d_->allocator(); }
  Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (!d_->Contains(dst, bytes)) return InvalidArgumentError("fake device: copy to host memory");
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (!d_->Contains(src, bytes)) {
      return InvalidArgumentError("fake device: copy from host memory");
    }
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }

 private:
  std::shared_ptr<FakeDevice> d_;
};

}  // namespace

std::unique_ptr<DeviceMemory> FakeDevice::Memory() {
  return std::make_unique<FakeDeviceMemory>(shared_from_this());
}

// ---------------------------------------------------------------------------------------------
// FakeNcclHub

namespace {

struct WorkState {
  int pending = 0;
  bool failed = false;
  Status status;
};

struct Op {
  void* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<WorkState> work;
};

struct PairQueue {
  std::deque<Op> sends, recvs;  // of the pair (src, dst), in posting order
};

struct Group {
  uint64_t id = 0;
  std::string name;
  int64_t generation = 0;
  std::vector<int> members;  // group rank -> process (-1: not arrived yet)
  std::vector<bool> arrived;
  int arrived_count = 0;
  std::vector<Status> error;   // per rank: broken with this
  std::vector<bool> released;  // per rank: released by Shrink or destroyed
  std::map<std::pair<int, int>, PairQueue> pairs;
  std::map<std::vector<int>, std::shared_ptr<Group>> shrinks;  // exclude list -> child

  int size() const { return static_cast<int>(members.size()); }
  std::string Describe(int rank) const {
    return "fake nccl communicator '" + name + "' generation " + std::to_string(generation) +
           " rank " + std::to_string(rank) + "/" + std::to_string(size());
  }
};

}  // namespace

struct FakeNcclHub::State {
  explicit State(int n, std::shared_ptr<FakeDevice> d)
      : processes(n), device(std::move(d)), dead(static_cast<size_t>(n), false) {}

  std::mutex mu;
  std::condition_variable cv;
  const int processes;
  const std::shared_ptr<FakeDevice> device;
  std::vector<bool> dead;
  std::map<std::pair<int64_t, std::string>, std::shared_ptr<Group>> inits;
  std::vector<std::weak_ptr<Group>> groups;
  uint64_t next_id = 1;
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> groups_started{0};
  int kill_process = -1;  // KillWhenDelivered
  int64_t kill_at = 0;
  int64_t pause_at = -1;  // PauseDeliveryAt

  // Process `process` dies: every communicator it is in fails for it and its peers. Under mu.
  void KillLocked(int process) {
    dead[static_cast<size_t>(process)] = true;
    for (const std::weak_ptr<Group>& w : groups) {
      std::shared_ptr<Group> g = w.lock();
      if (g == nullptr) continue;
      for (int r = 0; r < g->size(); ++r) {
        if (g->members[static_cast<size_t>(r)] == process) {
          FailRank(*g, r, AbortedError(g->Describe(r) + ": process " + std::to_string(process) +
                                       " killed"));
        }
      }
    }
    cv.notify_all();
  }

  std::shared_ptr<Group> NewGroup(std::string name, int64_t generation, int size) {
    auto g = std::make_shared<Group>();
    g->id = next_id++;
    g->name = std::move(name);
    g->generation = generation;
    g->members.assign(static_cast<size_t>(size), -1);
    g->arrived.assign(static_cast<size_t>(size), false);
    g->error.assign(static_cast<size_t>(size), Status::Ok());
    g->released.assign(static_cast<size_t>(size), false);
    groups.push_back(g);
    return g;
  }

  static void FailWork(const std::shared_ptr<WorkState>& w, const Status& s) {
    if (w->failed) return;
    w->failed = true;
    w->status = s;
  }

  // Breaks `rank` of `g` with `why`: its pending operations fail with it; every peer that has
  // an operation pending with it fails (and breaks) with kUnavailable naming it. Under mu.
  void FailRank(Group& g, int rank, const Status& why) {
    std::vector<std::pair<int, Status>> work{{rank, why}};
    while (!work.empty()) {
      auto [r, s] = work.back();
      work.pop_back();
      if (!g.error[static_cast<size_t>(r)].ok()) continue;
      g.error[static_cast<size_t>(r)] = s;
      const Status to_peer =
          UnavailableError(g.Describe(r) + " failed: " + std::string(s.message()))
              .WithCollectiveFailure({CollectiveFailure::Kind::kRemoteError, {r}, g.name});
      for (auto& [key, q] : g.pairs) {
        const auto [src, dst] = key;
        if (src != r && dst != r) continue;
        const int peer = src == r ? dst : src;
        // This rank's side of the pair fails with its own reason, the peer's with to_peer.
        std::deque<Op>& mine = src == r ? q.sends : q.recvs;
        std::deque<Op>& theirs = src == r ? q.recvs : q.sends;
        for (Op& op : mine) FailWork(op.work, s);
        if (!theirs.empty()) {
          for (Op& op : theirs) FailWork(op.work, to_peer);
          work.push_back({peer, to_peer});
        }
        q.sends.clear();
        q.recvs.clear();
      }
    }
    cv.notify_all();
  }

  // Matches the heads of the pair's queues and copies them. Under mu.
  void Match(Group& g, int src, int dst) {
    PairQueue& q = g.pairs[{src, dst}];
    while (!q.sends.empty() && !q.recvs.empty()) {
      if (pause_at >= 0 && bytes >= pause_at) break;
      Op s = std::move(q.sends.front());
      Op r = std::move(q.recvs.front());
      q.sends.pop_front();
      q.recvs.pop_front();
      if (s.bytes != r.bytes) {
        const Status e = InternalError(g.Describe(dst) + ": rank " + std::to_string(src) +
                                       " sends " + std::to_string(s.bytes) +
                                       " bytes, the receive expects " + std::to_string(r.bytes));
        FailWork(s.work, e);
        FailWork(r.work, e);
        FailRank(g, src, e);
        FailRank(g, dst, e);
        return;
      }
      if (s.bytes > 0) std::memcpy(r.data, s.data, s.bytes);
      bytes += static_cast<int64_t>(s.bytes);
      --s.work->pending;
      --r.work->pending;
      if (kill_process >= 0 && bytes >= kill_at) {
        const int p = kill_process;
        kill_process = -1;
        KillLocked(p);
        return;
      }
    }
    cv.notify_all();
  }

  // Waits under `l` until `done()` or the deadline (false then).
  template <typename Pred>
  bool WaitUntil(std::unique_lock<std::mutex>& l, Deadline d, Pred done) {
    while (!done()) {
      if (d.Expired()) return false;
      cv.wait_for(l, std::min<Deadline::Clock::duration>(d.Remaining(),
                                                         std::chrono::milliseconds(50)));
    }
    return true;
  }

  // Collective creation: `rank` of `g` arrived as `process`; waits for the others.
  Status Arrive(std::unique_lock<std::mutex>& l, Group& g, int rank, int process, Deadline d,
                const BuildCancel* cancel = nullptr) {
    g.members[static_cast<size_t>(rank)] = process;
    g.arrived[static_cast<size_t>(rank)] = true;
    ++g.arrived_count;
    cv.notify_all();
    const bool ok = WaitUntil(l, d, [&] {
      return g.arrived_count == g.size() || dead[static_cast<size_t>(process)] ||
             (cancel != nullptr && cancel->cancelled());
    });
    if (dead[static_cast<size_t>(process)]) return AbortedError(g.Describe(rank) + ": killed");
    if (g.arrived_count != g.size() && cancel != nullptr && cancel->cancelled()) {
      g.arrived[static_cast<size_t>(rank)] = false;
      --g.arrived_count;
      return AbortedError(g.Describe(rank) + ": creation cancelled (BuildCancel)");
    }
    if (!ok) {
      return DeadlineExceededError(g.Describe(rank) + ": creation did not finish in time (" +
                                   std::to_string(g.arrived_count) + " of " +
                                   std::to_string(g.size()) + " ranks arrived)")
          .WithCollectiveFailure({CollectiveFailure::Kind::kTimeout, {}, g.name});
    }
    return Status::Ok();
  }
};

namespace {

using HubState = FakeNcclHub::State;

class FakeWork final : public Work {
 public:
  FakeWork(std::shared_ptr<HubState> hub, std::shared_ptr<Group> g, int rank,
           std::shared_ptr<WorkState> w)
      : hub_(std::move(hub)), g_(std::move(g)), rank_(rank), w_(std::move(w)) {}

  Status Wait(Deadline deadline) override {
    std::unique_lock<std::mutex> l(hub_->mu);
    const bool ok = hub_->WaitUntil(l, deadline, [&] { return w_->failed || w_->pending == 0; });
    if (!ok) {
      hub_->FailRank(*g_, rank_,
                     DeadlineExceededError(g_->Describe(rank_) + ": operation did not finish in time")
                         .WithCollectiveFailure({CollectiveFailure::Kind::kTimeout, {}, g_->name}));
    }
    return w_->failed ? w_->status : Status::Ok();
  }

  bool Done() const override {
    std::lock_guard<std::mutex> l(hub_->mu);
    return w_->failed || w_->pending == 0;
  }

 private:
  std::shared_ptr<HubState> hub_;
  std::shared_ptr<Group> g_;
  const int rank_;
  std::shared_ptr<WorkState> w_;
};

class FakeNcclComm final : public Communicator {
 public:
  FakeNcclComm(std::shared_ptr<HubState> hub, std::shared_ptr<Group> g, int rank)
      : hub_(std::move(hub)), g_(std::move(g)), rank_(rank) {}
  ~FakeNcclComm() override {
    std::lock_guard<std::mutex> l(hub_->mu);
    if (!g_->released[static_cast<size_t>(rank_)]) {
      g_->released[static_cast<size_t>(rank_)] = true;
      hub_->FailRank(*g_, rank_, FailedPreconditionError(g_->Describe(rank_) + ": destroyed"));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }
  int64_t generation() const override { return g_->generation; }
  Capabilities capabilities() const override {
    Capabilities c;
    c.backend = "fake-nccl";
    c.device_memory = true;
    c.point_to_point = true;
    c.shrink = true;
    return c;
  }

  StatusOr<std::unique_ptr<Work>> Start(CollectiveOp op) override {
    MORPH_RETURN_IF_ERROR(ValidateOp(op, capabilities())) << g_->Describe(rank_);
    if (op.kind != CollectiveOp::Kind::kSendRecv) {
      return UnimplementedError(g_->Describe(rank_) + ": only send/recv groups");
    }
    for (const P2POp& p : op.p2p) {
      if (p.bytes > 0 && !hub_->device->Contains(p.data, p.bytes)) {
        return InvalidArgumentError(g_->Describe(rank_) + ": a " +
                                    (p.kind == P2POp::Kind::kSend ? "send" : "receive") +
                                    " buffer is host memory; the NCCL backend needs device memory");
      }
    }
    std::lock_guard<std::mutex> l(hub_->mu);
    if (g_->released[static_cast<size_t>(rank_)]) {
      return FailedPreconditionError(g_->Describe(rank_) + ": released (shrunk or destroyed)");
    }
    MORPH_RETURN_IF_ERROR(g_->error[static_cast<size_t>(rank_)]);
    ++hub_->groups_started;
    auto w = std::make_shared<WorkState>();
    std::vector<std::pair<int, int>> touched;
    for (const P2POp& p : op.p2p) {
      const bool send = p.kind == P2POp::Kind::kSend;
      const std::pair<int, int> key = send ? std::pair{rank_, p.peer} : std::pair{p.peer, rank_};
      PairQueue& q = g_->pairs[key];
      (send ? q.sends : q.recvs).push_back({p.data, p.bytes, w});
      ++w->pending;
      touched.push_back(key);
    }
    for (const auto& [src, dst] : touched) {
      const int peer = src == rank_ ? dst : src;
      const Status& pe = g_->error[static_cast<size_t>(peer)];
      if (!pe.ok() || g_->released[static_cast<size_t>(peer)]) {
        hub_->FailRank(*g_, rank_,
                       UnavailableError(g_->Describe(rank_) + ": peer " + std::to_string(peer) +
                                        " failed: " +
                                        (pe.ok() ? std::string("released") : std::string(pe.message())))
                           .WithCollectiveFailure(
                               {CollectiveFailure::Kind::kRemoteError, {peer}, g_->name}));
        break;
      }
      hub_->Match(*g_, src, dst);
    }
    return std::unique_ptr<Work>(new FakeWork(hub_, g_, rank_, std::move(w)));
  }

  StatusOr<std::unique_ptr<Communicator>> Shrink(std::span<const int> exclude, ShrinkMode mode,
                                                 int64_t generation, Deadline deadline) override {
    const std::string what = g_->Describe(rank_) + ": shrink";
    std::vector<int> list(exclude.begin(), exclude.end());
    std::sort(list.begin(), list.end());
    if (list.empty()) return InvalidArgumentError(what + ": no rank to exclude");
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i] < 0 || list[i] >= size()) {
        return InvalidArgumentError(what + ": excluded rank " + std::to_string(list[i]) +
                                    " out of range");
      }
      if (list[i] == rank_) return InvalidArgumentError(what + ": this rank is excluded");
      if (i > 0 && list[i] == list[i - 1]) {
        return InvalidArgumentError(what + ": rank " + std::to_string(list[i]) +
                                    " excluded twice");
      }
    }
    std::unique_lock<std::mutex> l(hub_->mu);
    if (g_->released[static_cast<size_t>(rank_)]) {
      return FailedPreconditionError(what + ": the communicator was already released");
    }
    const Status& err = g_->error[static_cast<size_t>(rank_)];
    if (mode == ShrinkMode::kPlanned && !err.ok()) {
      return FailedPreconditionError(what + ": a planned shrink needs a healthy communicator (" +
                                     std::string(err.message()) + "); use ShrinkMode::kFailure");
    }
    if (mode == ShrinkMode::kFailure && err.ok()) {
      hub_->FailRank(*g_, rank_, AbortedError(g_->Describe(rank_) + ": shrunk (abort mode)"));
    }
    std::shared_ptr<Group>& child = g_->shrinks[list];
    if (child == nullptr) {
      child = hub_->NewGroup(g_->name, generation, size() - static_cast<int>(list.size()));
    }
    const int new_rank =
        rank_ - static_cast<int>(std::lower_bound(list.begin(), list.end(), rank_) - list.begin());
    g_->released[static_cast<size_t>(rank_)] = true;
    std::shared_ptr<Group> c = child;
    const int process = g_->members[static_cast<size_t>(rank_)];
    MORPH_RETURN_IF_ERROR(hub_->Arrive(l, *c, new_rank, process, deadline)) << what;
    return std::unique_ptr<Communicator>(new FakeNcclComm(hub_, c, new_rank));
  }

  void Abort() override {
    std::lock_guard<std::mutex> l(hub_->mu);
    hub_->FailRank(*g_, rank_,
                   AbortedError(g_->Describe(rank_) + ": aborted (Abort() called)")
                       .WithCollectiveFailure({CollectiveFailure::Kind::kAborted, {}, g_->name}));
  }

  bool broken() const override {
    std::lock_guard<std::mutex> l(hub_->mu);
    return !g_->error[static_cast<size_t>(rank_)].ok();
  }

 private:
  std::shared_ptr<HubState> hub_;
  std::shared_ptr<Group> g_;
  const int rank_;
};

}  // namespace

FakeNcclHub::FakeNcclHub(int processes, std::shared_ptr<FakeDevice> device)
    : state_(std::make_shared<State>(processes, std::move(device))) {}

FakeNcclHub::~FakeNcclHub() = default;

CommunicatorFactory FakeNcclHub::Factory(int process, std::shared_ptr<const BuildCancel> cancel) {
  std::shared_ptr<State> s = state_;
  return [s, process, cancel](Store& store, std::string_view name, int rank, int size,
                              Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    const std::string what = "fake nccl communicator '" + std::string(name) + "' generation " +
                             std::to_string(store.generation());
    if (cancel && cancel->cancelled()) return AbortedError(what + ": cancelled (BuildCancel)");
    if (process < 0 || process >= s->processes) {
      return InvalidArgumentError(what + ": no process " + std::to_string(process));
    }
    if (size < 1 || rank < 0 || rank >= size) {
      return InvalidArgumentError(what + ": rank " + std::to_string(rank) + " of size " +
                                  std::to_string(size) + " out of range");
    }
    std::unique_lock<std::mutex> l(s->mu);
    if (s->dead[static_cast<size_t>(process)]) return AbortedError(what + ": killed");
    std::shared_ptr<Group>& g = s->inits[{store.generation(), std::string(name)}];
    if (g == nullptr) g = s->NewGroup(std::string(name), store.generation(), size);
    std::shared_ptr<Group> group = g;
    if (group->size() != size || group->arrived[static_cast<size_t>(rank)]) {
      return InvalidArgumentError(what + ": rank " + std::to_string(rank) + " of size " +
                                  std::to_string(size) + " does not fit its members (size " +
                                  std::to_string(group->size()) + ")");
    }
    MORPH_RETURN_IF_ERROR(s->Arrive(l, *group, rank, process, deadline, cancel.get()));
    return std::unique_ptr<Communicator>(new FakeNcclComm(s, group, rank));
  };
}

void FakeNcclHub::Kill(int process) {
  std::lock_guard<std::mutex> l(state_->mu);
  if (process < 0 || process >= state_->processes) return;
  state_->KillLocked(process);
}

void FakeNcclHub::KillWhenDelivered(int process, int64_t bytes) {
  std::lock_guard<std::mutex> l(state_->mu);
  if (process < 0 || process >= state_->processes) return;
  state_->kill_process = process;
  state_->kill_at = bytes;
}

void FakeNcclHub::PauseDeliveryAt(int64_t bytes) {
  std::lock_guard<std::mutex> l(state_->mu);
  state_->pause_at = bytes;
}

bool FakeNcclHub::delivery_paused() const {
  std::lock_guard<std::mutex> l(state_->mu);
  return state_->pause_at >= 0 && state_->bytes >= state_->pause_at;
}

void FakeNcclHub::ResumeDelivery() {
  std::lock_guard<std::mutex> l(state_->mu);
  state_->pause_at = -1;
  for (const std::weak_ptr<Group>& w : state_->groups) {
    std::shared_ptr<Group> g = w.lock();
    if (g == nullptr) continue;
    std::vector<std::pair<int, int>> keys;
    for (const auto& [key, q] : g->pairs) keys.push_back(key);
    for (const auto& [src, dst] : keys) state_->Match(*g, src, dst);
  }
}

int64_t FakeNcclHub::bytes_delivered() const { return state_->bytes.load(); }
int64_t FakeNcclHub::groups_started() const { return state_->groups_started.load(); }
const std::shared_ptr<FakeDevice>& FakeNcclHub::device() const { return state_->device; }

}  // namespace morph
