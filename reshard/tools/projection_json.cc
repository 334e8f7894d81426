#include "reshard/tools/projection_json.h"

#include <cstdio>

namespace morph {
namespace {

using nlohmann::json;

Status Bad(const std::string& path, const std::string& what) {
  return InvalidArgumentError(path + ": " + what);
}

StatusOr<double> Positive(const json& j, const std::string& key) {
  const std::string path = "$." + key;
  if (!j[key].is_number()) return Bad(path, "must be a number, got " + j[key].dump());
  const double v = j[key].get<double>();
  if (!(v > 0)) return Bad(path, "must be > 0");
  return v;
}

std::string Name(const std::vector<std::string>& names, int p) {
  if (p >= 0 && p < static_cast<int>(names.size())) return names[static_cast<size_t>(p)];
  return "participant " + std::to_string(p);
}

}  // namespace

StatusOr<Topology> ParseTopology(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("topology: not valid JSON");
  if (!j.is_object()) return Bad("$", "must be an object");
  static const char* kKeys[] = {"name", "gpus_per_node", "nvlink_GBps", "nic_Gbps", "hbm_GBps",
                                "efficiency", "comm_build_seconds", "build_in_background",
                                "node_of_participant"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : kKeys) known |= it.key() == k;
    if (!known) return Bad("$." + it.key(), "unknown field");
  }
  Topology t;
  if (j.contains("name")) {
    if (!j["name"].is_string()) return Bad("$.name", "must be a string");
    t.name = j["name"].get<std::string>();
  }
  if (j.contains("gpus_per_node")) {
    if (!j["gpus_per_node"].is_number_integer() || j["gpus_per_node"].get<int64_t>() < 1 ||
        j["gpus_per_node"].get<int64_t>() > 1 << 20) {
      return Bad("$.gpus_per_node", "must be an integer in [1, 1048576]");
    }
    t.gpus_per_node = j["gpus_per_node"].get<int>();
  }
  if (j.contains("nvlink_GBps")) {
    MORPH_ASSIGN_OR_RETURN(double v, Positive(j, "nvlink_GBps"));
    t.nvlink_bytes_per_second = v * 1e9;
  }
  if (j.contains("nic_Gbps")) {
    MORPH_ASSIGN_OR_RETURN(double v, Positive(j, "nic_Gbps"));
    t.nic_bytes_per_second = v * 1e9 / 8;
  }
  if (j.contains("hbm_GBps")) {
    MORPH_ASSIGN_OR_RETURN(double v, Positive(j, "hbm_GBps"));
    t.hbm_bytes_per_second = v * 1e9;
  }
  if (j.contains("efficiency")) {
    MORPH_ASSIGN_OR_RETURN(t.efficiency, Positive(j, "efficiency"));
    if (t.efficiency > 1) return Bad("$.efficiency", "must be in (0, 1]");
  }
  if (j.contains("comm_build_seconds")) {
    if (!j["comm_build_seconds"].is_number() || j["comm_build_seconds"].get<double>() < 0) {
      return Bad("$.comm_build_seconds", "must be a number >= 0");
    }
    t.comm_build_seconds = j["comm_build_seconds"].get<double>();
  }
  if (j.contains("build_in_background")) {
    if (!j["build_in_background"].is_boolean()) {
      return Bad("$.build_in_background", "must be true or false");
    }
    t.build_in_background = j["build_in_background"].get<bool>();
  }
  if (j.contains("node_of_participant")) {
    const json& n = j["node_of_participant"];
    if (!n.is_array()) return Bad("$.node_of_participant", "must be an array of node indices");
    for (size_t i = 0; i < n.size(); ++i) {
      if (!n[i].is_number_integer() || n[i].get<int64_t>() < 0 ||
          n[i].get<int64_t>() > 1 << 30) {
        return Bad("$.node_of_participant[" + std::to_string(i) + "]",
                   "must be a node index >= 0");
      }
      t.node_of_participant.push_back(n[i].get<int>());
    }
  }
  MORPH_RETURN_IF_ERROR(t.Validate());
  return t;
}

std::string FormatProjection(const Topology& t, const Projection& p,
                             const std::vector<std::string>& names) {
  char buf[512];
  std::string out = "projection on " + t.ToString() + "\n";
  std::snprintf(buf, sizeof(buf),
                "  transfer:          %.3f s (%s)\n"
                "  communicators:     %.3f s at the switch step (%s)\n"
                "  stall:             %.3f s\n"
                "  bytes intra-node:  %.3f GB (NVLink), largest receive %.3f GB\n"
                "  bytes inter-node:  %.3f GB (NIC), largest receive %.3f GB\n"
                "  bytes copied:      %.3f GB (HBM)\n",
                p.transfer_seconds, p.Bottleneck(t).c_str(), p.build_seconds,
                t.build_in_background ? "built while the old generation trains"
                                      : "built at the switch step",
                p.stall_seconds, p.intra_bytes / 1e9, p.max_intra_recv / 1e9, p.inter_bytes / 1e9,
                p.max_inter_recv / 1e9, p.copied_bytes / 1e9);
  out += buf;
  if (p.bottleneck >= 0) {
    out += "  slowest:           " + Name(names, p.bottleneck) + "\n";
  }
  return out;
}

nlohmann::json ProjectionToJson(const Topology& t, const Projection& p,
                                const std::vector<std::string>& names) {
  json per = json::array();
  for (size_t i = 0; i < p.participants.size(); ++i) {
    const RankTraffic& r = p.participants[i];
    per.push_back({{"worker", Name(names, static_cast<int>(i))},
                   {"node", t.NodeOf(static_cast<int>(i))},
                   {"intra_sent", r.intra_sent},
                   {"intra_recv", r.intra_recv},
                   {"inter_sent", r.inter_sent},
                   {"inter_recv", r.inter_recv},
                   {"copied", r.copied},
                   {"seconds", r.seconds},
                   {"limit", r.limit}});
  }
  return {{"topology", t.ToString()},
          {"transfer_seconds", p.transfer_seconds},
          {"build_seconds", p.build_seconds},
          {"stall_seconds", p.stall_seconds},
          {"bottleneck", p.Bottleneck(t)},
          {"bytes_intra_node", p.intra_bytes},
          {"bytes_inter_node", p.inter_bytes},
          {"bytes_copied", p.copied_bytes},
          {"max_intra_recv", p.max_intra_recv},
          {"max_inter_recv", p.max_inter_recv},
          {"per_worker", per}};
}

}  // namespace morph
