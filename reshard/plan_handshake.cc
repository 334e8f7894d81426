#include "reshard/plan_handshake.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>

namespace morph {
namespace {

// One Hello in each direction per pair: a fixed-size, little-endian record. A participant that
// failed before the exchange sends its reason instead (kHelloFailed).
constexpr uint64_t kHelloMagic = 0x3148534850524f4dull;  // "MORPHSH1"
constexpr uint64_t kHelloTag = 0x6d6f727068656c6full;    // handshake messages' transport tag
constexpr uint64_t kHelloFailed = 1;
// The sender's messages to (from) the receiver need no staging on the sender's side.
constexpr uint64_t kHelloSendsInPlace = 2;
constexpr uint64_t kHelloRecvsInPlace = 4;
constexpr size_t kHelloBytes = 512;
constexpr size_t kHelloReasonAt = 32 + 8 * PlanDigest::kNumParts + 48;
static_assert(kHelloReasonAt < kHelloBytes);

struct Hello {
  uint64_t flags = 0;
  int64_t participant = 0;
  int64_t num_participants = 0;
  PlanDigest digest;
  uint64_t sends_hash = 0;  // the pieces the sender sends to the receiver
  uint64_t recvs_hash = 0;  // the pieces the sender receives from the receiver
  uint64_t sends_count = 0;
  uint64_t recvs_count = 0;
  // Fresh per execution: the pair's message tags depend on both sides' nonces, so a message left
  // over from an earlier execution of the same plan on the same transport fails too.
  uint64_t nonce = 0;
  std::string reason;  // when kHelloFailed

  void Encode(char* out) const {
    std::memset(out, 0, kHelloBytes);
    size_t at = 0;
    auto put = [&](uint64_t v) {
      for (int i = 0; i < 8; ++i) out[at++] = static_cast<char>((v >> (8 * i)) & 0xff);
    };
    put(kHelloMagic);
    put(flags);
    put(static_cast<uint64_t>(participant));
    put(static_cast<uint64_t>(num_participants));
    for (uint64_t p : digest.parts) put(p);
    put(sends_hash);
    put(recvs_hash);
    put(sends_count);
    put(recvs_count);
    put(nonce);
    const size_t n = std::min(reason.size(), kHelloBytes - kHelloReasonAt - 1);
    put(n);
    std::memcpy(out + at, reason.data(), n);
  }
  // False if the record is not a Hello (a stray or corrupt message).
  bool Decode(const char* in) {
    size_t at = 0;
    auto get = [&] {
      uint64_t v = 0;
      for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<unsigned char>(in[at++])} << (8 * i);
      return v;
    };
    if (get() != kHelloMagic) return false;
    flags = get();
    participant = static_cast<int64_t>(get());
    num_participants = static_cast<int64_t>(get());
    for (uint64_t& p : digest.parts) p = get();
    sends_hash = get();
    recvs_hash = get();
    sends_count = get();
    recvs_count = get();
    nonce = get();
    const uint64_t n = get();
    if (n > kHelloBytes - kHelloReasonAt - 1) return false;
    reason.assign(in + at, static_cast<size_t>(n));
    return true;
  }
};

// Hash of the pieces one side lists for one direction of a pair, in plan order.
class PairHasher {
 public:
  void Add(const LocalPlan& plan, const PieceMove& m) {
    const TensorInfo& t = plan.tensors[static_cast<size_t>(m.tensor)];
    h_.Add(std::string_view(t.name)).Add(static_cast<int>(t.dtype));
    h_.Add(m.box.rank());
    for (const Interval& d : m.box.dims()) h_.Add(d.begin).Add(d.end);
    ++count_;
  }
  uint64_t value() const { return h_.value(); }
  uint64_t count() const { return count_; }

 private:
  DigestHasher h_;
  uint64_t count_ = 0;
};

// The transport tag of message `index` from `src` to `dst` of the reshard `session`, whose
// executions on the two sides drew the nonces `src_nonce` and `dst_nonce`.
uint64_t MessageTag(uint64_t session, int src, int dst, uint64_t src_nonce, uint64_t dst_nonce,
                    int64_t index) {
  DigestHasher h;
  h.Add(session).Add(src).Add(dst).Add(src_nonce).Add(dst_nonce).Add(index);
  return h.value();
}

uint64_t FreshNonce() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  DigestHasher h;
  h.Add((uint64_t{rd()} << 32) ^ rd()).Add(++counter);
  h.Add(static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  return h.value();
}

// The peers `plan` exchanges pieces with (ignoring invalid ones), in increasing order.
std::vector<int> PlanPeers(const LocalPlan& plan) {
  std::vector<int> peers;
  for (const auto* list : {&plan.sends, &plan.recvs}) {
    for (const PieceMove& m : *list) {
      if (m.peer >= 0 && m.peer < plan.num_participants && m.peer != plan.participant)
        peers.push_back(m.peer);
    }
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

// Swaps Hellos with `peers`: ours (`mine[i]` to peers[i]) out, theirs into `theirs`.
Status SwapHellos(Transport& transport, const std::vector<int>& peers,
                  const std::vector<Hello>& mine, std::vector<Hello>& theirs, Deadline deadline) {
  std::vector<char> out(peers.size() * kHelloBytes), in(peers.size() * kHelloBytes);
  std::vector<SendOp> sops;
  std::vector<RecvOp> rops;
  for (size_t i = 0; i < peers.size(); ++i) {
    mine[i].Encode(out.data() + i * kHelloBytes);
    sops.push_back({peers[i], out.data() + i * kHelloBytes, kHelloBytes, nullptr, kHelloTag});
    rops.push_back({peers[i], in.data() + i * kHelloBytes, kHelloBytes, nullptr, kHelloTag});
  }
  MORPH_ASSIGN_OR_RETURN(auto work, transport.Start(sops, rops), "starting the handshake");
  MORPH_RETURN_IF_ERROR(work->Wait(deadline)) << "plan handshake";
  theirs.resize(peers.size());
  for (size_t i = 0; i < peers.size(); ++i) {
    if (!theirs[i].Decode(in.data() + i * kHelloBytes)) {
      return FailedPreconditionError("plan handshake: participant " + std::to_string(peers[i]) +
                                     " sent something that is not a reshard handshake");
    }
  }
  return Status();
}

}  // namespace

void PlanHandshake::NotifyFailure(const LocalPlan& plan, Transport& transport, const Status& why,
                                  Deadline deadline) {
  const std::vector<int> peers = PlanPeers(plan);
  if (peers.empty()) return;
  Hello h;
  h.flags = kHelloFailed;
  h.participant = plan.participant;
  h.num_participants = plan.num_participants;
  h.reason = why.ToString();
  std::vector<Hello> mine(peers.size(), h), theirs;
  (void)SwapHellos(transport, peers, mine, theirs, deadline);
}

StatusOr<PlanHandshake> PlanHandshake::Run(const LocalPlan& plan, const PlanDigest& digest,
                                           Transport& transport, Deadline deadline,
                                           const std::vector<uint8_t>& in_place) {
  PlanHandshake hs;
  hs.me_ = plan.participant;
  hs.session_ = digest.combined();
  const std::vector<int> peers = PlanPeers(plan);
  if (peers.empty()) return hs;
  const int n = plan.num_participants;
  hs.nonce_ = FreshNonce();
  hs.peer_nonce_.assign(static_cast<size_t>(n), 0);
  hs.in_place_.assign(static_cast<size_t>(n), 0);
  std::vector<PairHasher> to(static_cast<size_t>(n)), from(static_cast<size_t>(n));
  for (const PieceMove& m : plan.sends) to[static_cast<size_t>(m.peer)].Add(plan, m);
  for (const PieceMove& m : plan.recvs) from[static_cast<size_t>(m.peer)].Add(plan, m);
  std::vector<Hello> mine(peers.size()), theirs;
  for (size_t i = 0; i < peers.size(); ++i) {
    Hello& h = mine[i];
    h.participant = plan.participant;
    h.num_participants = n;
    h.digest = digest;
    h.nonce = hs.nonce_;
    const uint8_t bits =
        static_cast<size_t>(peers[i]) < in_place.size() ? in_place[static_cast<size_t>(peers[i])] : 0;
    if (bits & kSendsInPlace) h.flags |= kHelloSendsInPlace;
    if (bits & kRecvsInPlace) h.flags |= kHelloRecvsInPlace;
    const auto& t = to[static_cast<size_t>(peers[i])];
    const auto& f = from[static_cast<size_t>(peers[i])];
    h.sends_hash = t.value();
    h.sends_count = t.count();
    h.recvs_hash = f.value();
    h.recvs_count = f.count();
  }
  MORPH_RETURN_IF_ERROR(SwapHellos(transport, peers, mine, theirs, deadline));
  for (size_t i = 0; i < peers.size(); ++i) {
    const Hello& h = theirs[i];
    const std::string who = "participant " + std::to_string(peers[i]);
    if (h.flags & kHelloFailed) {
      return AbortedError(who + " failed before the exchange: " + h.reason);
    }
    if (h.participant != peers[i] || h.num_participants != n) {
      return FailedPreconditionError(
          "plan handshake: the peer at transport rank " + std::to_string(peers[i]) +
          " runs the plan of participant " + std::to_string(h.participant) + " of " +
          std::to_string(h.num_participants) + ", this one is participant " +
          std::to_string(plan.participant) + " of " + std::to_string(n));
    }
    if (h.digest != digest) {
      return FailedPreconditionError(
          who + " runs a different plan: they differ in " + digest.Differences(h.digest) +
          " (plan digest " + digest.ToString() + " here, " + h.digest.ToString() + " there)");
    }
    hs.peer_nonce_[static_cast<size_t>(peers[i])] = h.nonce;
    const Hello& m = mine[i];
    // Our sends are its receives and the other way round.
    uint8_t pair = 0;
    if ((m.flags & kHelloSendsInPlace) && (h.flags & kHelloRecvsInPlace)) pair |= kSendsInPlace;
    if ((m.flags & kHelloRecvsInPlace) && (h.flags & kHelloSendsInPlace)) pair |= kRecvsInPlace;
    hs.in_place_[static_cast<size_t>(peers[i])] = pair;
    if (h.sends_hash != m.recvs_hash || h.sends_count != m.recvs_count) {
      return FailedPreconditionError(
          "plans disagree: the " + std::to_string(h.sends_count) + " pieces " + who +
          " sends to participant " + std::to_string(plan.participant) + " are not the " +
          std::to_string(m.recvs_count) + " pieces (in that order) this participant expects");
    }
    if (h.recvs_hash != m.sends_hash || h.recvs_count != m.sends_count) {
      return FailedPreconditionError(
          "plans disagree: the " + std::to_string(m.sends_count) + " pieces participant " +
          std::to_string(plan.participant) + " sends to " + who + " are not the " +
          std::to_string(h.recvs_count) + " pieces (in that order) it expects");
    }
  }
  return hs;
}

uint64_t PlanHandshake::SendTag(int peer, int64_t index) const {
  return MessageTag(session_, me_, peer, nonce_, peer_nonce_[static_cast<size_t>(peer)], index);
}

bool PlanHandshake::InPlace(int peer, bool send) const {
  if (peer < 0 || static_cast<size_t>(peer) >= in_place_.size()) return false;
  return (in_place_[static_cast<size_t>(peer)] & (send ? kSendsInPlace : kRecvsInPlace)) != 0;
}

uint64_t PlanHandshake::RecvTag(int peer, int64_t index) const {
  return MessageTag(session_, peer, me_, peer_nonce_[static_cast<size_t>(peer)], nonce_, index);
}

}  // namespace morph
