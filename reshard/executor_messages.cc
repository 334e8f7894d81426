#include "reshard/executor_messages.h"

#include <algorithm>
#include <map>
#include <utility>

namespace morph::executor_internal {

std::vector<std::vector<Message>> CutMessages(const std::vector<Piece>& pieces, int n,
                                              size_t chunk) {
  std::vector<std::vector<Message>> by_peer(static_cast<size_t>(n));
  for (int i = 0; i < static_cast<int>(pieces.size()); ++i) {
    const Piece& p = pieces[static_cast<size_t>(i)];
    auto& msgs = by_peer[static_cast<size_t>(p.peer)];
    // Large pieces get messages of their own (so contiguous ones can go zero-copy); small ones
    // share messages. Both sides see the same sizes, so they cut alike.
    const bool large = static_cast<size_t>(p.elements * p.elem_size) >= chunk / 8;
    bool fresh = large;
    int64_t done = 0;
    while (done < p.elements) {
      if (msgs.empty() || fresh || msgs.back().bytes + static_cast<size_t>(p.elem_size) > chunk) {
        fresh = false;
        msgs.emplace_back();
        msgs.back().peer = p.peer;
      }
      Message& m = msgs.back();
      const int64_t fit =
          static_cast<int64_t>((chunk - m.bytes) / static_cast<size_t>(p.elem_size));
      const int64_t take = std::min(fit, p.elements - done);
      m.segments.push_back({i, done, done + take, m.bytes});
      m.bytes += static_cast<size_t>(take * p.elem_size);
      done += take;
    }
    if (large && p.elements > 0) {
      msgs.emplace_back();  // closes the piece's last message; dropped below if left empty
      msgs.back().peer = p.peer;
    }
  }
  for (auto& msgs : by_peer) {
    std::erase_if(msgs, [](const Message& m) { return m.segments.empty(); });
    for (size_t k = 0; k < msgs.size(); ++k) msgs[k].index = static_cast<int64_t>(k);
    for (Message& m : msgs) {
      if (m.segments.size() != 1) continue;
      const Segment& s = m.segments[0];
      const Piece& p = pieces[static_cast<size_t>(s.piece)];
      if (auto off = ContiguousOffset(p.view, s.begin, s.end))
        m.direct = p.base + *off * p.elem_size;
    }
  }
  return by_peer;
}

std::vector<Group> GroupMessages(const std::vector<std::vector<Message>>& send_msgs,
                                 const std::vector<std::vector<Message>>& recv_msgs, int me, int n,
                                 int peers_per_group, int messages_per_group, size_t chunk,
                                 const PlanHandshake& agreed) {
  std::map<std::pair<int64_t, int>, Group> by_key;
  for (int dir = 0; dir < 2; ++dir) {
    const auto& lists = dir == 0 ? send_msgs : recv_msgs;
    for (size_t peer = 0; peer < lists.size(); ++peer) {
      const int p = static_cast<int>(peer);
      const int offset = dir == 0 ? (p - me + n) % n : (me - p + n) % n;
      const int64_t per = agreed.InPlace(p, dir == 0) ? kInPlaceMessagesPerGroup
                                                      : messages_per_group;
      for (const Message& m : lists[peer]) {
        Group& g = by_key[{m.index / per, (offset - 1) / peers_per_group}];
        (dir == 0 ? g.sends : g.recvs).push_back(&m);
        if (m.direct == nullptr && !m.strided) g.staged += chunk;
      }
    }
  }
  std::vector<Group> groups;
  groups.reserve(by_key.size());
  for (auto& [key, g] : by_key) groups.push_back(std::move(g));
  return groups;
}

}  // namespace morph::executor_internal
