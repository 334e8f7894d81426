// Configurations pinned per world size (`morphrun --config N=dpAtpBppC`): a ConfigPolicy that
// answers the pinned config for exactly N workers, and leaves every other size to the planner.
// For operators who know the config they want at a size, and for tests that need a change the
// planner's "keep tp and pp while they fit" would not make (tp 2 -> 1, pp 2 -> 1).
//
//   MORPH_ASSIGN_OR_RETURN(ConfigPins pins, ParseConfigPins({"4=dp2tp2pp1", "3=dp3tp1pp1"}));
//   coordinator_options.policy = pins.Policy();
//
// Pure values; the policy runs on the coordinator's thread.
#ifndef MORPH_RUNTIME_TOOLS_CONFIG_PINS_H_
#define MORPH_RUNTIME_TOOLS_CONFIG_PINS_H_

#include <map>
#include <string>
#include <vector>

#include "morph/options.h"
#include "morph/status.h"

namespace morph {

struct ConfigPin {
  int dp = 1, tp = 1, pp = 1;
};

struct ConfigPins {
  std::map<int, ConfigPin> by_world;  // workers -> pinned (dp, tp, pp)
  // The policy: for a pinned size, that (dp, tp, pp) with the model's stages (layers split
  // evenly over pp), ZeRO stage and micro-batches; otherwise nullopt (the planner decides).
  ConfigPolicy Policy() const;
};

// Parses "N=dpAtpBppC" items (dp*tp*pp <= N, each >= 1, one item per N). kInvalidArgument
// naming the item otherwise.
StatusOr<ConfigPins> ParseConfigPins(const std::vector<std::string>& items);

}  // namespace morph

#endif  // MORPH_RUNTIME_TOOLS_CONFIG_PINS_H_
