// The JSON side of morph-plan --project (reshard/projection.h): the topology file it reads and
// the projection it prints.
//
//   {"name": "H200 nodes of 8", "gpus_per_node": 8,
//    "nvlink_GBps": 450, "nic_Gbps": 400, "hbm_GBps": 4800,        // per GPU and direction
//    "efficiency": 1.0, "comm_build_seconds": 2.0, "build_in_background": true,
//    "node_of_participant": [0, 0, ..., 1]}                         // optional: packed by default
//
// Errors are kInvalidArgument with the JSON path first ("$.nic_Gbps: must be > 0"). Any thread.
#ifndef MORPH_RESHARD_TOOLS_PROJECTION_JSON_H_
#define MORPH_RESHARD_TOOLS_PROJECTION_JSON_H_

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "morph/status.h"
#include "reshard/projection.h"

namespace morph {

StatusOr<Topology> ParseTopology(std::string_view text);

// Text lines for people; `names`: participant -> worker name (may be empty).
std::string FormatProjection(const Topology& t, const Projection& p,
                             const std::vector<std::string>& names);
// The projection as JSON: totals, the bottleneck, and per participant its five byte counts.
nlohmann::json ProjectionToJson(const Topology& t, const Projection& p,
                                const std::vector<std::string>& names);

}  // namespace morph

#endif  // MORPH_RESHARD_TOOLS_PROJECTION_JSON_H_
