#include "runtime/tools/config_pins.h"

#include <cstdio>
#include <optional>

namespace morph {

ConfigPolicy ConfigPins::Policy() const {
  return [pins = by_world](int workers, const ParallelConfig*,
                           const ModelConstraints& model) -> std::optional<ParallelConfig> {
    auto it = pins.find(workers);
    if (it == pins.end()) return std::nullopt;
    const ConfigPin& p = it->second;
    ParallelConfig c{.dp = p.dp, .tp = p.tp, .pp = p.pp};
    StatusOr<std::vector<int>> stages = ParallelConfig::EvenStages(model.num_layers, p.pp);
    if (!stages.ok()) return std::nullopt;  // more stages than layers: the planner decides
    c.stage_of_layer = *stages;
    c.zero_stage = model.zero_stage;
    c.micro_batches = model.micro_batches;
    return c;
  };
}

StatusOr<ConfigPins> ParseConfigPins(const std::vector<std::string>& items) {
  ConfigPins out;
  for (const std::string& item : items) {
    int n = 0, dp = 0, tp = 0, pp = 0, used = 0;
    const auto bad = [&](const std::string& why) {
      return InvalidArgumentError("config pin '" + item + "': " + why +
                                  " (want N=dpAtpBppC, e.g. 4=dp2tp2pp1)");
    };
    if (std::sscanf(item.c_str(), "%d=dp%dtp%dpp%d%n", &n, &dp, &tp, &pp, &used) != 4 ||
        used != static_cast<int>(item.size())) {
      return bad("not of the form");
    }
    if (n < 1 || dp < 1 || tp < 1 || pp < 1) return bad("every count must be >= 1");
    if (static_cast<int64_t>(dp) * tp * pp > n) {
      return bad("dp*tp*pp = " + std::to_string(static_cast<int64_t>(dp) * tp * pp) +
                 " exceeds the " + std::to_string(n) + " workers");
    }
    if (!out.by_world.emplace(n, ConfigPin{dp, tp, pp}).second) {
      return bad("a second pin for " + std::to_string(n) + " workers");
    }
  }
  return out;
}

}  // namespace morph
