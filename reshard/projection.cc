#include "reshard/projection.h"

#include <algorithm>
#include <cstdio>

#include "reshard/plan.h"

namespace morph {
namespace {

std::string Rate(double bytes_per_second) {
  char buf[48];
  if (bytes_per_second >= 1e12) {
    std::snprintf(buf, sizeof(buf), "%.1f TB/s", bytes_per_second / 1e12);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f GB/s", bytes_per_second / 1e9);
  }
  return buf;
}

}  // namespace

int Topology::NodeOf(int participant) const {
  if (participant >= 0 && participant < static_cast<int>(node_of_participant.size())) {
    return node_of_participant[static_cast<size_t>(participant)];
  }
  return participant / std::max(1, gpus_per_node);
}

Status Topology::Validate() const {
  if (gpus_per_node < 1) return InvalidArgumentError("topology: gpus_per_node must be >= 1");
  for (auto [what, v] : {std::pair{"nvlink", nvlink_bytes_per_second},
                         {"nic", nic_bytes_per_second},
                         {"hbm", hbm_bytes_per_second}}) {
    if (!(v > 0)) return InvalidArgumentError(std::string("topology: ") + what + " bandwidth must be > 0");
  }
  if (!(efficiency > 0 && efficiency <= 1)) {
    return InvalidArgumentError("topology: efficiency must be in (0, 1]");
  }
  if (comm_build_seconds < 0) {
    return InvalidArgumentError("topology: comm_build_seconds must be >= 0");
  }
  for (size_t p = 0; p < node_of_participant.size(); ++p) {
    if (node_of_participant[p] < 0) {
      return InvalidArgumentError("topology: node_of_participant[" + std::to_string(p) +
                                  "] is negative");
    }
  }
  return Status::Ok();
}

std::string Topology::ToString() const {
  std::string s = name + ": " + std::to_string(gpus_per_node) + " GPUs per node, NVLink " +
                  Rate(nvlink_bytes_per_second) + " and NIC " + Rate(nic_bytes_per_second) +
                  " per GPU and direction, HBM " + Rate(hbm_bytes_per_second);
  if (efficiency < 1) s += ", at " + std::to_string(static_cast<int>(efficiency * 100)) + " %";
  s += node_of_participant.empty() ? ", ranks packed onto nodes" : ", explicit placement";
  return s;
}

std::string Projection::Bottleneck(const Topology& t) const {
  if (bottleneck < 0) return "nothing moves";
  const RankTraffic& r = participants[static_cast<size_t>(bottleneck)];
  int64_t bytes = 0;
  double rate = 0;
  if (r.limit == "NVLink out") bytes = r.intra_sent, rate = t.nvlink_bytes_per_second;
  if (r.limit == "NVLink in") bytes = r.intra_recv, rate = t.nvlink_bytes_per_second;
  if (r.limit == "NIC out") bytes = r.inter_sent, rate = t.nic_bytes_per_second;
  if (r.limit == "NIC in") bytes = r.inter_recv, rate = t.nic_bytes_per_second;
  if (r.limit == "HBM") {
    bytes = r.intra_sent + r.inter_sent + r.intra_recv + r.inter_recv + 2 * r.copied;
    rate = t.hbm_bytes_per_second;
  }
  char buf[160];
  std::snprintf(buf, sizeof(buf), "participant %d (node %d): %s, %.2f GB at %s", bottleneck,
                t.NodeOf(bottleneck), r.limit.c_str(), static_cast<double>(bytes) / 1e9,
                Rate(rate * t.efficiency).c_str());
  return buf;
}

ProjectionBuilder::ProjectionBuilder(Topology topology, int num_participants)
    : topo_(std::move(topology)),
      ranks_(static_cast<size_t>(std::max(0, num_participants))),
      added_(ranks_.size(), 0) {}

Status ProjectionBuilder::Add(const LocalPlan& plan) {
  const int me = plan.participant;
  if (me < 0 || me >= static_cast<int>(ranks_.size())) {
    return InvalidArgumentError("projection: participant " + std::to_string(me) +
                                " out of range [0, " + std::to_string(ranks_.size()) + ")");
  }
  if (added_[static_cast<size_t>(me)]) {
    return InvalidArgumentError("projection: participant " + std::to_string(me) +
                                " added twice");
  }
  added_[static_cast<size_t>(me)] = 1;
  RankTraffic& r = ranks_[static_cast<size_t>(me)];
  const int node = topo_.NodeOf(me);
  for (const PieceMove& m : plan.sends) {
    (topo_.NodeOf(m.peer) == node ? r.intra_sent : r.inter_sent) += PieceBytes(plan, m);
  }
  for (const PieceMove& m : plan.recvs) {
    (topo_.NodeOf(m.peer) == node ? r.intra_recv : r.inter_recv) += PieceBytes(plan, m);
  }
  for (const PieceMove& m : plan.local_copies) r.copied += PieceBytes(plan, m);
  return Status::Ok();
}

Projection ProjectionBuilder::Finish() const {
  Projection pr;
  pr.participants = ranks_;
  const double nvl = topo_.nvlink_bytes_per_second * topo_.efficiency;
  const double nic = topo_.nic_bytes_per_second * topo_.efficiency;
  const double hbm = topo_.hbm_bytes_per_second * topo_.efficiency;
  for (size_t p = 0; p < pr.participants.size(); ++p) {
    RankTraffic& r = pr.participants[p];
    const double hbm_bytes = static_cast<double>(r.intra_sent + r.inter_sent + r.intra_recv +
                                                 r.inter_recv + 2 * r.copied);
    const std::pair<double, const char*> terms[] = {
        {static_cast<double>(r.intra_sent) / nvl, "NVLink out"},
        {static_cast<double>(r.intra_recv) / nvl, "NVLink in"},
        {static_cast<double>(r.inter_sent) / nic, "NIC out"},
        {static_cast<double>(r.inter_recv) / nic, "NIC in"},
        {hbm_bytes / hbm, "HBM"}};
    r.seconds = 0;
    r.limit = "nothing";
    for (const auto& [t, what] : terms) {
      if (t > r.seconds) {
        r.seconds = t;
        r.limit = what;
      }
    }
    pr.intra_bytes += r.intra_sent;
    pr.inter_bytes += r.inter_sent;
    pr.copied_bytes += r.copied;
    pr.max_intra_recv = std::max(pr.max_intra_recv, r.intra_recv);
    pr.max_inter_recv = std::max(pr.max_inter_recv, r.inter_recv);
    if (r.seconds > pr.transfer_seconds) {
      pr.transfer_seconds = r.seconds;
      pr.bottleneck = static_cast<int>(p);
    }
  }
  pr.build_seconds = topo_.build_in_background ? 0 : topo_.comm_build_seconds;
  pr.stall_seconds = pr.transfer_seconds + pr.build_seconds;
  return pr;
}

}  // namespace morph
