#include "runtime/protocol/messages.h"

namespace morph {

int Generation::RankOf(WorkerId w) const {
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r] == w) return static_cast<int>(r);
  }
  return -1;
}

}  // namespace morph
