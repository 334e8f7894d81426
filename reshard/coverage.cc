#include "reshard/coverage.h"

#include <algorithm>
#include <vector>

namespace morph {
namespace {

// Finds two overlapping boxes among `idx`, all of which are known to share a common region in
// the dimensions before `dim` (so two overlap iff their dimensions from `dim` on overlap).
// Sweeps dimension `dim` in begin order; boxes whose intervals chain into one cluster are split
// at the cluster's breakpoints, and the boxes over each elementary slab recurse on dim + 1. A
// cluster whose boxes share one interval (the usual case for grid-aligned pieces) recurses once.
std::pair<int, int> Recurse(std::span<const Box> boxes, std::vector<int> idx, int dim) {
  if (idx.size() < 2) return {-1, -1};
  if (dim == boxes[static_cast<size_t>(idx[0])].rank()) return {idx[0], idx[1]};
  auto iv = [&](int i) -> const Interval& { return boxes[static_cast<size_t>(i)].dim(dim); };
  std::sort(idx.begin(), idx.end(), [&](int a, int b) {
    return iv(a).begin != iv(b).begin ? iv(a).begin < iv(b).begin : a < b;
  });
  size_t start = 0;
  while (start < idx.size()) {
    size_t stop = start + 1;
    int64_t reach = iv(idx[start]).end;
    while (stop < idx.size() && iv(idx[stop]).begin < reach) {
      reach = std::max(reach, iv(idx[stop]).end);
      ++stop;
    }
    if (stop - start >= 2) {
      std::vector<int> cluster(idx.begin() + static_cast<std::ptrdiff_t>(start),
                               idx.begin() + static_cast<std::ptrdiff_t>(stop));
      const Interval first = iv(cluster[0]);
      const bool same = std::all_of(cluster.begin(), cluster.end(), [&](int i) {
        return iv(i).begin == first.begin && iv(i).end == first.end;
      });
      if (same) {
        auto r = Recurse(boxes, std::move(cluster), dim + 1);
        if (r.first >= 0) return r;
      } else {
        std::vector<int64_t> cuts;
        for (int i : cluster) {
          cuts.push_back(iv(i).begin);
          cuts.push_back(iv(i).end);
        }
        std::sort(cuts.begin(), cuts.end());
        cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
          std::vector<int> over;
          for (int i : cluster) {
            if (iv(i).begin <= cuts[c] && iv(i).end >= cuts[c + 1]) over.push_back(i);
          }
          auto r = Recurse(boxes, std::move(over), dim + 1);
          if (r.first >= 0) return r;
        }
      }
    }
    start = stop;
  }
  return {-1, -1};
}

StatusOr<int64_t> Elements(const Box& b) { return b.NumElements(); }

}  // namespace

std::pair<int, int> FindOverlap(std::span<const Box> boxes) {
  std::vector<int> idx;
  for (size_t i = 0; i < boxes.size(); ++i) {
    if (!boxes[i].empty()) idx.push_back(static_cast<int>(i));
  }
  auto r = Recurse(boxes, std::move(idx), 0);
  if (r.first > r.second) std::swap(r.first, r.second);
  return r;
}

Status ValidateCoverage(std::string_view tensor, const Shard& shard,
                        std::span<const CoveragePiece> pieces, const Box* state) {
  const std::string where = "tensor '" + std::string(tensor) + "'";
  const std::vector<Box> shard_boxes = state ? IntersectShard(shard, *state) : ShardBoxes(shard);
  int64_t shard_total = 0;
  for (const Box& sb : shard_boxes) {
    MORPH_ASSIGN_OR_RETURN(int64_t k, Elements(sb), where);
    shard_total += k;
  }
  std::vector<Box> boxes;
  std::vector<size_t> origin;  // index into `pieces` of boxes[i]
  int64_t total = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Box& b = pieces[i].box;
    if (b.rank() != shard.frame.rank()) {
      return InvalidArgumentError(where + ": " + pieces[i].label + " box " + b.ToString() +
                                  " has rank " + std::to_string(b.rank()) + ", the shard " +
                                  std::to_string(shard.frame.rank()));
    }
    if (b.empty()) continue;
    MORPH_ASSIGN_OR_RETURN(int64_t n, Elements(b), where << ": " << pieces[i].label);
    int64_t inside = 0;
    for (const Box& sb : shard_boxes) {
      MORPH_ASSIGN_OR_RETURN(int64_t k, Elements(Intersect(b, sb)), where);
      inside += k;  // <= n: the shard boxes are disjoint
    }
    if (inside != n) {
      return InvalidArgumentError(where + ": " + pieces[i].label + " box " + b.ToString() +
                                  " is not inside the new shard " + shard.ToString() +
                                  (state ? " within the state " + state->ToString() : "") + " (" +
                                  std::to_string(n - inside) + " of its " + std::to_string(n) +
                                  " elements are outside)");
    }
    MORPH_ASSIGN_OR_RETURN(total, CheckedAdd(total, n, "piece element total"), where);
    boxes.push_back(b);
    origin.push_back(i);
  }
  if (auto [a, b] = FindOverlap(boxes); a >= 0) {
    const CoveragePiece& pa = pieces[origin[static_cast<size_t>(a)]];
    const CoveragePiece& pb = pieces[origin[static_cast<size_t>(b)]];
    return InvalidArgumentError(where + ": " + pa.label + " box " + pa.box.ToString() + " and " +
                                pb.label + " box " + pb.box.ToString() + " overlap in box " +
                                Intersect(pa.box, pb.box).ToString() +
                                " (an element would be written twice)");
  }
  if (total == shard_total) return Status();
  // Disjoint and inside, so the shortfall is in some shard box: name the first one.
  for (const Box& sb : shard_boxes) {
    MORPH_ASSIGN_OR_RETURN(int64_t want, Elements(sb), where);
    int64_t got = 0;
    for (const Box& b : boxes) {
      MORPH_ASSIGN_OR_RETURN(int64_t k, Elements(Intersect(b, sb)), where);
      got += k;
    }
    if (got != want) {
      return InvalidArgumentError(where + ": " + std::to_string(want - got) + " of the " +
                                  std::to_string(want) + " elements of box " + sb.ToString() +
                                  " of the new shard " + shard.ToString() +
                                  " are not covered by any piece (they would never be written)");
    }
  }
  return InternalError(where + ": coverage count " + std::to_string(total) +
                       " != " + std::to_string(shard_total) + " but every shard box is covered");
}

}  // namespace morph
