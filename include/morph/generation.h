// A generation: one committed membership and parallel configuration of the job (docs/design.md
// §1). Every change makes the next one; Runtime::generation() is the current one, and a
// Reconfiguration says which a change went from and to.
#ifndef MORPH_GENERATION_H_
#define MORPH_GENERATION_H_

#include <cstdint>
#include <vector>

#include "morph/api.h"
#include "morph/parallel_config.h"

namespace morph {

// A worker's identity for the whole job, assigned by the coordinator at registration and never
// reused. Ranks change with generations; worker ids do not.
using WorkerId = int64_t;

// One committed membership and configuration. Once committed, never changes.
struct MORPH_API Generation {
  int64_t id = 0;
  // The first step trained in this generation (the switch step S).
  int64_t start_step = 0;
  ParallelConfig config;
  // ranks[r] = the worker that holds rank r; size config.world().
  std::vector<WorkerId> ranks;
  // Digest of everything that shapes the state exchange into this generation (plan inputs and
  // options); every participant checks it before the first byte moves.
  uint64_t plan_digest = 0;

  int RankOf(WorkerId w) const;  // -1 when `w` holds no rank
  friend bool operator==(const Generation&, const Generation&) = default;
};

// Where a recovery took the state from (docs/design.md §4 "Failure").
enum class RecoverySource : uint8_t {
  kReplicas = 0,    // live state of the survivors at one step (replicas of lost pieces)
  kSnapshot = 1,    // every rank's buddy snapshot at snapshot step (all roll back to it)
  kCheckpoint = 2,  // the latest complete checkpoint (all roll back to it)
};

}  // namespace morph

#endif  // MORPH_GENERATION_H_
