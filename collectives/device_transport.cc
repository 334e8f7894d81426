#include "collectives/device_transport.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <utility>

#include "collectives/tag_record.h"

namespace morph {

// Device buffers that host-memory messages bounce through, kept for reuse across groups (a
// reshard posts a handshake group and then one small tag record per peer and group).
struct DeviceTransport::Pool {
  explicit Pool(std::shared_ptr<DeviceMemory> m) : memory(std::move(m)) {}
  StatusOr<Buffer> Get(size_t bytes) {
    {
      std::lock_guard<std::mutex> l(mu);
      for (size_t i = 0; i < free.size(); ++i) {
        if (free[i].size() < bytes) continue;
        Buffer b = std::move(free[i]);
        free.erase(free.begin() + static_cast<std::ptrdiff_t>(i));
        return b;
      }
    }
    // Rounded up so that a few sizes serve every group.
    size_t round = 256;
    while (round < bytes) round *= 2;
    StatusOr<Buffer> b = memory->Allocate(round);
    if (b.ok()) allocated.fetch_add(static_cast<int64_t>(round));
    return b;
  }
  void Put(Buffer b) {
    if (b.size() == 0) return;
    std::lock_guard<std::mutex> l(mu);
    if (free.size() < 8) free.push_back(std::move(b));
  }
  std::shared_ptr<DeviceMemory> memory;
  std::mutex mu;
  std::vector<Buffer> free;
  std::atomic<int64_t> allocated{0};  // every bounce byte ever allocated: >= what is held
};

int64_t DeviceTransport::bounce_allocated_bytes() const { return pool_->allocated.load(); }

namespace {

// A host-memory receive that lands in bounce memory first.
struct HostRecv {
  void* host;
  size_t offset;
  size_t bytes;
};

class DeviceTransportWork final : public TransportWork {
 public:
  DeviceTransportWork(std::shared_ptr<DeviceTransport::Pool> pool,
                      const std::vector<int>* participant_of)
      : pool_(std::move(pool)), participant_of_(participant_of) {}
  ~DeviceTransportWork() override { pool_->Put(std::move(bounce_)); }

  Status Wait(Deadline deadline) override {
    if (done_) return status_;
    done_ = true;
    status_ = work_->Wait(deadline);
    if (!status_.ok()) {
      status_ = ToParticipants(status_);
      return status_;
    }
    for (const HostRecv& r : host_recvs_) {
      status_ = pool_->memory->CopyToHost(
          r.host, static_cast<const char*>(bounce_.data()) + r.offset, r.bytes);
      if (!status_.ok()) return status_ = status_.WithContext("copying a received message back");
    }
    for (size_t i = 0; i < tags_from_.size(); ++i) {
      const TagRecord got = TagRecord::Load(tags_in_.data() + i * TagRecord::kBytes);
      if (!(got == tags_expected_[i])) {
        return status_ = FailedPreconditionError(TagMismatch(tags_from_[i], got, tags_expected_[i]));
      }
    }
    return status_;
  }

  // The communicator's failed peers, as participants.
  Status ToParticipants(const Status& s) const {
    const CollectiveFailure* f = s.collective_failure();
    if (f == nullptr) return s;
    CollectiveFailure mapped = *f;
    mapped.peers.clear();
    for (int r : f->peers) {
      if (r >= 0 && r < static_cast<int>(participant_of_->size()) &&
          (*participant_of_)[static_cast<size_t>(r)] >= 0) {
        mapped.peers.push_back((*participant_of_)[static_cast<size_t>(r)]);
      }
    }
    return s.WithCollectiveFailure(std::move(mapped));
  }

  std::unique_ptr<Work> work_;
  Buffer bounce_;
  std::vector<HostRecv> host_recvs_;
  // Tag records (host): what this group sends, what it receives, from whom, what it expects.
  std::vector<unsigned char> tags_out_, tags_in_;
  std::vector<int> tags_from_;  // participants
  std::vector<TagRecord> tags_expected_;

 private:
  std::shared_ptr<DeviceTransport::Pool> pool_;
  const std::vector<int>* participant_of_;
  bool done_ = false;
  Status status_;
};

// One op of a group before it is posted: where its bytes are (host or device) and its peer.
struct Pending {
  P2POp::Kind kind;
  int peer;  // communicator rank
  void* data;
  size_t bytes;
  bool host = false;
  size_t offset = 0;  // in the bounce buffer, for host ops
};

}  // namespace

DeviceTransport::DeviceTransport(Communicator* comm, std::vector<int> comm_rank, int participant,
                                 std::unique_ptr<DeviceMemory> memory,
                                 std::chrono::milliseconds timeout)
    : comm_(comm),
      comm_rank_(std::move(comm_rank)),
      participant_of_(static_cast<size_t>(comm->size()), -1),
      participant_(participant),
      memory_(std::move(memory)),
      timeout_(timeout),
      pool_(std::make_shared<Pool>(memory_)) {
  for (size_t p = 0; p < comm_rank_.size(); ++p) {
    participant_of_[static_cast<size_t>(comm_rank_[p])] = static_cast<int>(p);
  }
}

DeviceTransport::~DeviceTransport() = default;

StatusOr<std::unique_ptr<DeviceTransport>> DeviceTransport::Create(
    Communicator* comm, std::vector<int> comm_rank_of_participant,
    std::unique_ptr<DeviceMemory> memory, std::chrono::milliseconds timeout) {
  if (comm == nullptr || memory == nullptr) {
    return InvalidArgumentError("device transport: no communicator or no device memory");
  }
  const Capabilities caps = comm->capabilities();
  if (!caps.device_memory || !caps.point_to_point) {
    return InvalidArgumentError("device transport: the " + caps.backend +
                                " communicator has no point-to-point on device memory");
  }
  if (comm_rank_of_participant.empty()) {
    return InvalidArgumentError("device transport: no participant");
  }
  std::vector<bool> seen(static_cast<size_t>(comm->size()), false);
  int me = -1;
  for (size_t p = 0; p < comm_rank_of_participant.size(); ++p) {
    const int r = comm_rank_of_participant[p];
    if (r < 0 || r >= comm->size() || seen[static_cast<size_t>(r)]) {
      return InvalidArgumentError("device transport: participant " + std::to_string(p) +
                                  " maps to communicator rank " + std::to_string(r) +
                                  (r >= 0 && r < comm->size() ? ", which another participant has"
                                                              : ", out of range [0, " +
                                                                    std::to_string(comm->size()) +
                                                                    ")"));
    }
    seen[static_cast<size_t>(r)] = true;
    if (r == comm->rank()) me = static_cast<int>(p);
  }
  if (me < 0) {
    return InvalidArgumentError("device transport: communicator rank " +
                                std::to_string(comm->rank()) + " is no participant");
  }
  return std::unique_ptr<DeviceTransport>(new DeviceTransport(
      comm, std::move(comm_rank_of_participant), me, std::move(memory), timeout));
}

Allocator DeviceTransport::StagingAllocator() { return memory_->StagingAllocator(); }

void DeviceTransport::Abort() { comm_->Abort(); }

StatusOr<std::unique_ptr<TransportWork>> DeviceTransport::Start(std::span<const SendOp> sends,
                                                                std::span<const RecvOp> recvs) {
  const int n = size();
  auto check = [&](int peer, bool strided, const char* what, size_t i) -> Status {
    const std::string op = std::string(what) + " op " + std::to_string(i);
    if (strided) return InvalidArgumentError(op + ": strided op to a device transport");
    if (peer < 0 || peer >= n || peer == participant_) {
      return InvalidArgumentError(op + ": peer " + std::to_string(peer) +
                                  " out of range for participant " + std::to_string(participant_) +
                                  " of " + std::to_string(n));
    }
    return Status::Ok();
  };
  for (size_t i = 0; i < sends.size(); ++i) {
    MORPH_RETURN_IF_ERROR(check(sends[i].peer, sends[i].strided != nullptr, "send", i));
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    MORPH_RETURN_IF_ERROR(check(recvs[i].peer, recvs[i].strided != nullptr, "receive", i));
  }
  auto work = std::make_unique<DeviceTransportWork>(pool_, &participant_of_);

  // Tag records lead each pair's messages of the group (tag_record.h).
  TagRecords t = MakeTagRecords(n, sends, recvs, [](int) { return false; });
  const std::vector<int>& out_peers = t.out_peers;
  work->tags_from_ = std::move(t.in_peers);
  work->tags_expected_ = std::move(t.expected);
  work->tags_out_ = std::move(t.out);
  work->tags_in_ = std::move(t.in);

  std::vector<Pending> ops;
  ops.reserve(out_peers.size() + work->tags_from_.size() + sends.size() + recvs.size());
  for (size_t i = 0; i < out_peers.size(); ++i) {
    unsigned char* rec = work->tags_out_.data() + i * TagRecord::kBytes;
    ops.push_back({P2POp::Kind::kSend, comm_rank(out_peers[i]), rec, TagRecord::kBytes});
  }
  for (size_t i = 0; i < work->tags_from_.size(); ++i) {
    ops.push_back({P2POp::Kind::kRecv, comm_rank(work->tags_from_[i]),
                   work->tags_in_.data() + i * TagRecord::kBytes, TagRecord::kBytes});
  }
  for (const SendOp& s : sends) {
    ops.push_back({P2POp::Kind::kSend, comm_rank(s.peer), const_cast<void*>(s.data), s.bytes});
  }
  for (const RecvOp& r : recvs) {
    ops.push_back({P2POp::Kind::kRecv, comm_rank(r.peer), r.data, r.bytes});
  }

  // Host messages go through one bounce buffer (256-byte aligned slots).
  size_t host_bytes = 0;
  for (Pending& p : ops) {
    if (p.bytes == 0 || memory_->IsDevice(p.data, p.bytes)) continue;
    p.host = true;
    p.offset = host_bytes;
    host_bytes += (p.bytes + 255) / 256 * 256;
  }
  if (host_bytes > 0) {
    MORPH_ASSIGN_OR_RETURN(work->bounce_, pool_->Get(host_bytes),
                           "device transport: bounce memory for " << host_bytes << " bytes");
    bounced_bytes_ += static_cast<int64_t>(host_bytes);
  }
  std::vector<P2POp> p2p;
  p2p.reserve(ops.size());
  char* bounce = static_cast<char*>(work->bounce_.data());
  for (const Pending& p : ops) {
    void* data = p.data;
    if (p.host) {
      data = bounce + p.offset;
      if (p.kind == P2POp::Kind::kSend) {
        MORPH_RETURN_IF_ERROR(memory_->CopyToDevice(data, p.data, p.bytes))
            << "device transport: staging a host message on " << memory_->name();
      } else {
        work->host_recvs_.push_back({p.data, p.offset, p.bytes});
      }
    }
    p2p.push_back({p.kind, p.peer, data, p.bytes});
  }
  CollectiveOp op = CollectiveOp::SendRecv(std::move(p2p), timeout_);
  op.stream = memory_->stream();
  auto started = comm_->Start(std::move(op));
  if (!started.ok()) return work->ToParticipants(started.status()).WithContext("device transport");
  work->work_ = std::move(started).value();
  return std::unique_ptr<TransportWork>(std::move(work));
}

}  // namespace morph
