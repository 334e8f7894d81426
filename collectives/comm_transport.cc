#include "collectives/comm_transport.h"

#include <string>
#include <vector>

#include "base/params.h"
#include "collectives/tag_record.h"
#include "reshard/strided_copy.h"

namespace morph {
namespace {

constexpr size_t kTagRecordBytes = TagRecord::kBytes;

// A strided op over the communicator: its bytes go through `buf`.
struct Bounce {
  std::unique_ptr<char[]> buf;
  size_t bytes = 0;
  void* recv = nullptr;  // receives: scatter into this buffer after the group
  StridedLayout layout;
  CopyGeometry geometry;
};

class CommTransportWork : public TransportWork {
 public:
  CommTransportWork(CommTransport::Pool* pool, ShmChannel* shm, Communicator* comm)
      : pool_(pool), shm_(shm), comm_(comm) {}
  ~CommTransportWork() override {
    for (Bounce& b : bounces_) pool_->Put(std::move(b.buf), b.bytes);
  }

  Status Wait(Deadline deadline) override {
    if (done_) return status_;
    done_ = true;
    // Shared memory first: this rank's reads are what same-host senders wait for, and they must
    // not wait behind this rank's TCP traffic (which progresses on the backend's thread anyway).
    if (shm_ != nullptr && (!shm_sends_.empty() || !shm_recvs_.empty())) {
      status_ = shm_->Wait(shm_sends_, shm_recvs_, deadline);
      if (!status_.ok()) {
        // The backend may still be using this group's buffers (the bounce buffers freed with
        // this object among them): fail it and let it let go before returning.
        if (work_ != nullptr) {
          comm_->Abort();
          (void)work_->Wait(Deadline::AfterMs(5000));
        }
        return status_;
      }
    }
    if (work_ != nullptr) {
      status_ = work_->Wait(deadline);
      if (!status_.ok()) return status_;
      status_ = CheckTags();
      if (!status_.ok()) return status_;
    }
    for (Bounce& b : bounces_) {
      if (b.recv == nullptr) continue;
      CopyGeometry g = WithDenseSource(b.geometry);
      g.src_offset -= b.layout.begin;  // the message's first element is at buf[0]
      HostStridedCopy(g, b.recv, b.buf.get(), b.layout.elem_size, b.layout.begin, b.layout.end);
    }
    return status_;
  }

  std::unique_ptr<Work> work_;
  std::vector<Bounce> bounces_;
  std::vector<ShmHandle> shm_sends_, shm_recvs_;
  // Tag records of the TCP part (see TagRecord); must outlive work_'s Wait.
  std::vector<unsigned char> tags_out_, tags_in_;
  std::vector<int> tags_from_;
  std::vector<TagRecord> tags_expected_;

 private:
  Status CheckTags() const {
    for (size_t i = 0; i < tags_from_.size(); ++i) {
      const TagRecord got = TagRecord::Load(tags_in_.data() + i * kTagRecordBytes);
      const TagRecord& want = tags_expected_[i];
      if (!(got == want)) {
        return FailedPreconditionError(TagMismatch(tags_from_[i], got, want));
      }
    }
    return Status();
  }

  CommTransport::Pool* pool_;
  ShmChannel* shm_;
  Communicator* comm_;
  bool done_ = false;
  Status status_;
};

Status CheckLayout(const StridedLayout& l, size_t bytes, const char* what, size_t i) {
  const std::string op = std::string(what) + " op " + std::to_string(i);
  if (l.geometry == nullptr || l.elem_size <= 0) {
    return InvalidArgumentError(op + ": strided layout without geometry or element size");
  }
  if (l.begin < 0 || l.begin > l.end || l.end > l.geometry->num_elements) {
    return InvalidArgumentError(op + ": elements [" + std::to_string(l.begin) + ", " +
                                std::to_string(l.end) + ") outside the geometry's " +
                                std::to_string(l.geometry->num_elements));
  }
  if (static_cast<size_t>(l.end - l.begin) * static_cast<size_t>(l.elem_size) != bytes) {
    return InvalidArgumentError(op + ": " + std::to_string(bytes) + " bytes but the layout holds " +
                                std::to_string((l.end - l.begin) * l.elem_size));
  }
  return Status::Ok();
}

MessageRegion Region(const void* data, size_t bytes, const StridedLayout* l, uint64_t tag) {
  MessageRegion r;
  r.tag = tag;
  r.base = static_cast<char*>(const_cast<void*>(data));
  r.bytes = bytes;
  if (l != nullptr) {
    r.strided = true;
    r.geometry = *l->geometry;
    r.elem_size = l->elem_size;
    r.begin = l->begin;
    r.end = l->end;
  }
  return r;
}

}  // namespace

StatusOr<CommTransportOptions> CommTransportOptions::FromEnv() {
  CommTransportOptions o;
  MORPH_ASSIGN_OR_RETURN(o.shared_memory, params::ReshardShm());
  return o;
}

CommTransport::CommTransport(Communicator* comm, std::chrono::milliseconds timeout)
    : comm_(comm), timeout_(timeout) {}

CommTransport::~CommTransport() = default;

StatusOr<std::unique_ptr<CommTransport>> CommTransport::Create(Communicator* comm,
                                                               std::chrono::milliseconds timeout,
                                                               const CommTransportOptions& options,
                                                               Deadline deadline) {
  auto t = std::make_unique<CommTransport>(comm, timeout);
  MORPH_ASSIGN_OR_RETURN(
      t->shm_, ShmChannel::Create(*comm, options.shared_memory && comm->capabilities().host_memory,
                                  deadline, options.arena));
  return t;
}

void CommTransport::Abort() {
  if (shm_ != nullptr) shm_->Abort();
  comm_->Abort();
}

std::unique_ptr<char[]> CommTransport::Pool::Get(size_t bytes) {
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i].first != bytes) continue;
    std::unique_ptr<char[]> b = std::move(free_[i].second);
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
    return b;
  }
  // Not value-initialized: every byte is written by the gather or the receive.
  return std::unique_ptr<char[]>(new char[bytes]);
}

void CommTransport::Pool::Put(std::unique_ptr<char[]> buf, size_t bytes) {
  if (buf != nullptr) free_.emplace_back(bytes, std::move(buf));
}

StatusOr<std::unique_ptr<TransportWork>> CommTransport::Start(std::span<const SendOp> sends,
                                                              std::span<const RecvOp> recvs) {
  const bool strided_ok = SupportsStridedOps();
  for (size_t i = 0; i < sends.size(); ++i) {
    if (sends[i].strided == nullptr) continue;
    if (!strided_ok) return InvalidArgumentError("strided send op to a device-memory transport");
    MORPH_RETURN_IF_ERROR(CheckLayout(*sends[i].strided, sends[i].bytes, "send", i));
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (recvs[i].strided == nullptr) continue;
    if (!strided_ok) return InvalidArgumentError("strided receive op to a device-memory transport");
    MORPH_RETURN_IF_ERROR(CheckLayout(*recvs[i].strided, recvs[i].bytes, "receive", i));
  }
  auto bad_peer = [&](int peer) { return peer < 0 || peer >= size() || peer == rank(); };
  for (size_t i = 0; i < sends.size(); ++i) {
    if (bad_peer(sends[i].peer)) {
      return InvalidArgumentError("send op " + std::to_string(i) + ": peer " +
                                  std::to_string(sends[i].peer) + " out of range for rank " +
                                  std::to_string(rank()) + " of " + std::to_string(size()));
    }
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    if (bad_peer(recvs[i].peer)) {
      return InvalidArgumentError("receive op " + std::to_string(i) + ": peer " +
                                  std::to_string(recvs[i].peer) + " out of range for rank " +
                                  std::to_string(rank()) + " of " + std::to_string(size()));
    }
  }

  auto work = std::make_unique<CommTransportWork>(&pool_, shm_.get(), comm_);
  std::vector<P2POp> ops;
  for (const SendOp& s : sends) {
    if (IsSharedMemoryPeer(s.peer)) {
      work->shm_sends_.push_back(
          shm_->PostSend(s.peer, Region(s.data, s.bytes, s.strided, s.tag)));
      continue;
    }
    void* data = const_cast<void*>(s.data);
    if (s.strided != nullptr && s.bytes > 0) {
      Bounce b;
      b.bytes = s.bytes;
      b.buf = pool_.Get(s.bytes);
      CopyGeometry g = WithDenseDestination(*s.strided->geometry);
      g.dst_offset -= s.strided->begin;
      HostStridedCopy(g, b.buf.get(), s.data, s.strided->elem_size, s.strided->begin,
                      s.strided->end);
      data = b.buf.get();
      work->bounces_.push_back(std::move(b));
    }
    ops.push_back({P2POp::Kind::kSend, s.peer, data, s.bytes});
  }
  for (const RecvOp& r : recvs) {
    if (IsSharedMemoryPeer(r.peer)) {
      work->shm_recvs_.push_back(
          shm_->PostRecv(r.peer, Region(r.data, r.bytes, r.strided, r.tag)));
      continue;
    }
    void* data = r.data;
    if (r.strided != nullptr && r.bytes > 0) {
      Bounce b;
      b.bytes = r.bytes;
      b.buf = pool_.Get(r.bytes);
      b.recv = r.data;
      b.layout = *r.strided;
      b.geometry = *r.strided->geometry;
      data = b.buf.get();
      work->bounces_.push_back(std::move(b));
    }
    ops.push_back({P2POp::Kind::kRecv, r.peer, data, r.bytes});
  }
  // Tag records lead the TCP part: per peer, one record of the tags of this group's messages.
  TagRecords t =
      MakeTagRecords(size(), sends, recvs, [this](int peer) { return IsSharedMemoryPeer(peer); });
  const std::vector<int>& out_peers = t.out_peers;
  work->tags_from_ = std::move(t.in_peers);
  work->tags_expected_ = std::move(t.expected);
  work->tags_out_ = std::move(t.out);
  work->tags_in_ = std::move(t.in);
  std::vector<P2POp> all;
  all.reserve(ops.size() + out_peers.size() + work->tags_from_.size());
  for (size_t i = 0; i < out_peers.size(); ++i) {
    unsigned char* rec = work->tags_out_.data() + i * kTagRecordBytes;
    all.push_back({P2POp::Kind::kSend, out_peers[i], rec, kTagRecordBytes});
  }
  for (size_t i = 0; i < work->tags_from_.size(); ++i) {
    all.push_back({P2POp::Kind::kRecv, work->tags_from_[i],
                   work->tags_in_.data() + i * kTagRecordBytes, kTagRecordBytes});
  }
  all.insert(all.end(), ops.begin(), ops.end());
  // An empty group still goes through the communicator, which reports a broken one.
  if (!all.empty() || (work->shm_sends_.empty() && work->shm_recvs_.empty())) {
    MORPH_ASSIGN_OR_RETURN(
        work->work_, comm_->Start(CollectiveOp::SendRecv(std::move(all), timeout_)), "transport");
  }
  return std::unique_ptr<TransportWork>(std::move(work));
}

}  // namespace morph
