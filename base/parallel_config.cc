#include "morph/parallel_config.h"

#include <climits>

namespace morph {

std::vector<int> ParallelConfig::DpGroup(int rank) const {
  Coords c = CoordsOf(rank);
  std::vector<int> g;
  for (int d = 0; d < dp; ++d) g.push_back(RankOf({c.p, d, c.t}));
  return g;
}

std::vector<int> ParallelConfig::TpGroup(int rank) const {
  Coords c = CoordsOf(rank);
  std::vector<int> g;
  for (int t = 0; t < tp; ++t) g.push_back(RankOf({c.p, c.d, t}));
  return g;
}

std::vector<int> ParallelConfig::PpGroup(int rank) const {
  Coords c = CoordsOf(rank);
  std::vector<int> g;
  for (int p = 0; p < pp; ++p) g.push_back(RankOf({p, c.d, c.t}));
  return g;
}

Status ParallelConfig::Validate() const {
  auto bad = [](const std::string& m) { return InvalidArgumentError("parallel config: " + m); };
  if (dp < 1) return bad("dp=" + std::to_string(dp) + " must be >= 1");
  if (tp < 1) return bad("tp=" + std::to_string(tp) + " must be >= 1");
  if (pp < 1) return bad("pp=" + std::to_string(pp) + " must be >= 1");
  // In two steps: dp*tp*pp of three 31-bit values overflows 64 bits (UB, seen with a decoded
  // frame); dp*tp cannot, and once at most 2^24 neither can its product with pp.
  long long w = 1LL * dp * tp;
  if (w <= (1 << 24)) w *= pp;
  if (w > (1 << 24)) {
    return bad("world dp*tp*pp=" + (w == 1LL * dp * tp ? std::to_string(w) + "*" + std::to_string(pp)
                                                       : std::to_string(w)) +
               " is too large");
  }
  if (zero_stage < 0 || zero_stage > 3) {
    return bad("zero_stage=" + std::to_string(zero_stage) + " must be 0, 1, 2 or 3");
  }
  if (micro_batches < 1) return bad("micro_batches=" + std::to_string(micro_batches) + " must be >= 1");
  if (stage_of_layer.empty()) {
    if (pp != 1) return bad("pp=" + std::to_string(pp) + " but stage_of_layer is empty");
    return Status();
  }
  int prev = 0;
  std::vector<bool> used(static_cast<size_t>(pp), false);
  for (size_t l = 0; l < stage_of_layer.size(); ++l) {
    int s = stage_of_layer[l];
    if (s < 0 || s >= pp) {
      return bad("stage_of_layer[" + std::to_string(l) + "]=" + std::to_string(s) +
                 " is not in [0, pp=" + std::to_string(pp) + ")");
    }
    if (s < prev) {
      return bad("stage_of_layer[" + std::to_string(l) + "]=" + std::to_string(s) +
                 " is smaller than the previous layer's stage " + std::to_string(prev));
    }
    prev = s;
    used[static_cast<size_t>(s)] = true;
  }
  for (int s = 0; s < pp; ++s) {
    if (!used[static_cast<size_t>(s)]) return bad("stage " + std::to_string(s) + " has no layer");
  }
  return Status();
}

StatusOr<std::vector<int>> ParallelConfig::EvenStages(int num_layers, int pp) {
  if (pp < 1) return InvalidArgumentError("pp=" + std::to_string(pp) + " must be >= 1");
  if (num_layers < pp) {
    return InvalidArgumentError("cannot split " + std::to_string(num_layers) + " layers into pp=" +
                                std::to_string(pp) + " stages");
  }
  std::vector<int> s;
  s.reserve(static_cast<size_t>(num_layers));
  int base = num_layers / pp, extra = num_layers % pp;
  for (int p = 0; p < pp; ++p) {
    for (int i = 0; i < base + (p < extra ? 1 : 0); ++i) s.push_back(p);
  }
  return s;
}

std::string ParallelConfig::ToString() const {
  return "dp=" + std::to_string(dp) + " tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) +
         " zero=" + std::to_string(zero_stage) + " layers=" + std::to_string(stage_of_layer.size());
}

}  // namespace morph
