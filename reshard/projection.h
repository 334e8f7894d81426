// Projection of a reshard's transfer time on a described GPU cluster, from the real plan (every
// participant's LocalPlan): what morph-plan --project and bench/projection_bench print.
//
// Model. Each participant is one GPU on a node (Topology::NodeOf). Its sends and receives are
// split into intra-node bytes (NVLink through the node's switch) and inter-node bytes (the GPU's
// own NIC, rail-optimised fabric assumed non-blocking), and its local copies read and write its
// HBM. Every GPU has four independent directions (NVLink out, NVLink in, NIC out, NIC in) and its
// HBM, which carries everything it sends, receives and copies:
//   t(p) = max(intra_sent / nvlink, intra_recv / nvlink, inter_sent / nic, inter_recv / nic,
//              (sent + received + 2 * copied) / hbm)
//   transfer = max over participants of t(p)                        (all links run at once)
//   stall    = transfer + build, build = comm_build_seconds unless the communicators are built
//              in the background (morph's design: then 0 at the switch step).
// Not modelled: latency per message (4 MiB messages: ~10 us against ~90 us of NVLink time),
// packing of strided pieces (an extra HBM read + write of those bytes), congestion in the
// fabric's core, NCCL's efficiency below line rate (Topology::efficiency scales every link).
//
//   ProjectionBuilder b(topology, num_participants);
//   for (int p = 0; p < n; ++p) b.Add(*planner.PlanFor(p));   // plans may be dropped after Add
//   Projection pr = b.Finish();
//
// Pure computation. Add for distinct participants may run on several threads at once; Finish
// after they are done.
#ifndef MORPH_RESHARD_PROJECTION_H_
#define MORPH_RESHARD_PROJECTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "morph/status.h"
#include "reshard/local_plan.h"

namespace morph {

struct Topology {
  std::string name = "H200 nodes of 8";
  int gpus_per_node = 8;
  // Per GPU and direction, bytes per second. H200: NVLink 4 = 900 GB/s per GPU both ways
  // together; ConnectX-7 = 400 Gb/s per GPU; HBM3e = 4.8 TB/s.
  double nvlink_bytes_per_second = 450e9;
  double nic_bytes_per_second = 50e9;
  double hbm_bytes_per_second = 4.8e12;
  // Fraction of line rate the transfers reach (1: line rate).
  double efficiency = 1.0;
  // Building the change's communicators (union + next generation's step groups), seconds, and
  // whether that happens in the background while the old generation trains (morph: yes).
  double comm_build_seconds = 0;
  bool build_in_background = true;
  // Node of each participant; empty: participant p on node p / gpus_per_node (participants are
  // numbered old ranks first, in rank order, then joiners: "packed" placement).
  std::vector<int> node_of_participant;

  int NodeOf(int participant) const;
  // kInvalidArgument naming the field: non-positive sizes or bandwidths, efficiency outside
  // (0, 1], a negative build time or node.
  Status Validate() const;
  std::string ToString() const;  // "H200 nodes of 8: NVLink 450 GB/s, NIC 50 GB/s, ..."
};

struct RankTraffic {
  int64_t intra_sent = 0, intra_recv = 0;
  int64_t inter_sent = 0, inter_recv = 0;
  int64_t copied = 0;  // local copies (old shard -> new shard on the same GPU)
  double seconds = 0;  // t(p) above
  std::string limit;   // which of the five terms gives t(p): "NIC in", ...
};

struct Projection {
  std::vector<RankTraffic> participants;
  int64_t intra_bytes = 0, inter_bytes = 0, copied_bytes = 0;  // sums of sent / copied bytes
  int64_t max_intra_recv = 0, max_inter_recv = 0;  // over participants
  double transfer_seconds = 0;
  int bottleneck = -1;  // the participant whose t(p) is the transfer time
  double build_seconds = 0;  // what the stall pays for communicators
  double stall_seconds = 0;
  // "participant 17 (node 2): NIC in, 3.20 GB at 50 GB/s"
  std::string Bottleneck(const Topology& t) const;
};

class ProjectionBuilder {
 public:
  ProjectionBuilder(Topology topology, int num_participants);
  // Adds one participant's plan (its sends, receives and local copies; piece bytes from the
  // plan's tensors). kInvalidArgument for a participant out of range or added twice.
  Status Add(const LocalPlan& plan);
  Projection Finish() const;

 private:
  Topology topo_;
  std::vector<RankTraffic> ranks_;
  std::vector<char> added_;  // not vector<bool>: distinct participants from several threads
};

}  // namespace morph

#endif  // MORPH_RESHARD_PROJECTION_H_
