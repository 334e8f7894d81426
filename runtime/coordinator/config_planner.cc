#include "runtime/coordinator/config_planner.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

namespace morph {

StatusOr<ConfigPlanner> ConfigPlanner::Create(ModelConstraints model, ConfigPolicy policy) {
  if (model.num_layers < 1) {
    return InvalidArgumentError("num_layers: must be at least 1, got " +
                                std::to_string(model.num_layers));
  }
  if (model.num_heads < 0) {
    return InvalidArgumentError("num_heads: must not be negative");
  }
  if (model.global_batch < 1) {
    return InvalidArgumentError("global_batch: must be at least 1, got " +
                                std::to_string(model.global_batch));
  }
  if (model.micro_batches < 1) {
    return InvalidArgumentError("micro_batches: must be at least 1");
  }
  for (const char* field : {"tp_candidates", "pp_candidates"}) {
    const std::vector<int>& c =
        std::string(field) == "tp_candidates" ? model.tp_candidates : model.pp_candidates;
    if (c.empty()) return InvalidArgumentError(std::string(field) + ": empty");
    for (int v : c) {
      if (v < 1) {
        return InvalidArgumentError(std::string(field) + ": " + std::to_string(v) +
                                    " is not a positive size");
      }
    }
  }
  std::sort(model.tp_candidates.begin(), model.tp_candidates.end());
  std::sort(model.pp_candidates.begin(), model.pp_candidates.end());
  return ConfigPlanner(std::move(model), std::move(policy));
}

ConfigPlanner::ConfigPlanner(ModelConstraints model, ConfigPolicy policy)
    : model_(std::move(model)), policy_(std::move(policy)) {}

StatusOr<ParallelConfig> ConfigPlanner::Make(int dp, int tp, int pp) const {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  MORPH_ASSIGN_OR_RETURN(c.stage_of_layer, ParallelConfig::EvenStages(model_.num_layers, pp));
  c.zero_stage = model_.zero_stage;
  c.micro_batches = model_.micro_batches;
  MORPH_RETURN_IF_ERROR(c.Validate());
  return c;
}

std::string ConfigPlanner::Unfit(int dp, int tp, int pp) const {
  if (dp < 1) return "no DP rank left";
  if (model_.dp_multiple > 1 && dp % model_.dp_multiple != 0) {
    return "dp=" + std::to_string(dp) + " is not a multiple of " +
           std::to_string(model_.dp_multiple) + " (hybrid ZeRO groups)";
  }
  if (pp > model_.num_layers) {
    return "pp=" + std::to_string(pp) + " exceeds " + std::to_string(model_.num_layers) + " layers";
  }
  if (model_.num_heads > 0 && model_.num_heads % tp != 0) {
    return "tp=" + std::to_string(tp) + " does not divide " + std::to_string(model_.num_heads) +
           " heads";
  }
  if (dp > model_.global_batch) {
    return "dp=" + std::to_string(dp) + " exceeds the global batch " +
           std::to_string(model_.global_batch);
  }
  if (model_.memory_per_rank && model_.device_memory_bytes > 0) {
    auto c = Make(dp, tp, pp);
    if (!c.ok()) return std::string(c.status().message());
    int64_t need = model_.memory_per_rank(*c);
    if (need > model_.device_memory_bytes) {
      return "needs " + std::to_string(need) + " B per rank, the device has " +
             std::to_string(model_.device_memory_bytes);
    }
  }
  return "";
}

double ConfigPlanner::EstimatedThroughput(const ParallelConfig& c) const {
  // Every TP doubling costs ~10% (its allreduces are on the critical path); a pipeline of pp
  // stages idles (pp - 1) of (m + pp - 1) micro-batch slots (the 1F1B bubble).
  double tp_eff = std::pow(0.9, std::log2(static_cast<double>(c.tp)));
  double m = c.micro_batches;
  double pp_eff = m / (m + c.pp - 1);
  return static_cast<double>(c.world()) * tp_eff * pp_eff;
}

StatusOr<ConfigChoice> ConfigPlanner::Choose(int workers, const ParallelConfig* current) const {
  if (workers < 1) return FailedPreconditionError("no worker to place");
  auto explain = [&](const ParallelConfig& c, std::string why) {
    ConfigChoice out{.config = c, .spares = workers - c.world()};
    std::ostringstream os;
    os << why << ": dp=" << c.dp << " tp=" << c.tp << " pp=" << c.pp << " on " << workers
       << " workers";
    if (out.spares > 0) os << ", " << out.spares << " spare" << (out.spares > 1 ? "s" : "");
    out.explanation = os.str();
    return out;
  };
  if (policy_) {
    if (std::optional<ParallelConfig> c = policy_(workers, current, model_)) {
      MORPH_RETURN_IF_ERROR(c->Validate()) << "the user policy's config";
      if (c->world() > workers) {
        return InvalidArgumentError("the user policy's config " + c->ToString() + " needs " +
                                    std::to_string(c->world()) + " workers, " +
                                    std::to_string(workers) + " are available");
      }
      return explain(*c, "user policy");
    }
  }
  if (current) {
    int dp = workers / (current->tp * current->pp);
    dp = static_cast<int>(std::min<int64_t>(dp, model_.global_batch));
    if (model_.dp_multiple > 1) dp -= dp % model_.dp_multiple;
    if (Unfit(dp, current->tp, current->pp).empty()) {
      MORPH_ASSIGN_OR_RETURN(ParallelConfig c, Make(dp, current->tp, current->pp));
      return explain(c, "keep tp=" + std::to_string(c.tp) + " pp=" + std::to_string(c.pp));
    }
  }
  std::optional<ParallelConfig> best;
  double best_score = -1;
  std::vector<std::string> why_not;
  for (int tp : model_.tp_candidates) {
    for (int pp : model_.pp_candidates) {
      if (static_cast<int64_t>(tp) * pp > workers) {
        why_not.push_back("tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + ": needs " +
                          std::to_string(static_cast<int64_t>(tp) * pp) + " workers");
        continue;
      }
      int dp = static_cast<int>(std::min<int64_t>(workers / (tp * pp), model_.global_batch));
      if (model_.dp_multiple > 1) dp -= dp % model_.dp_multiple;
      std::string unfit = Unfit(dp, tp, pp);
      if (!unfit.empty()) {
        why_not.push_back("tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + ": " + unfit);
        continue;
      }
      auto c = Make(dp, tp, pp);
      if (!c.ok()) continue;
      double score = EstimatedThroughput(*c);
      // Ties: fewer spares, then smaller tp, then smaller pp (iteration order).
      if (score > best_score + 1e-9) {
        best_score = score;
        best = *c;
      }
    }
  }
  if (!best) {
    std::string msg = "no configuration fits " + std::to_string(workers) + " workers";
    for (size_t i = 0; i < why_not.size() && i < 4; ++i) msg += (i ? "; " : ": ") + why_not[i];
    return FailedPreconditionError(msg);
  }
  std::string why =
      current ? "tp=" + std::to_string(current->tp) + " pp=" + std::to_string(current->pp) +
                    " no longer fits (" +
                    Unfit(workers / (current->tp * current->pp), current->tp, current->pp) +
                    "); highest estimated throughput"
              : "highest estimated throughput";
  return explain(*best, why);
}

}  // namespace morph
