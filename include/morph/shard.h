// Shard: exactly which elements of a tensor one rank stores, and where each element sits in
// that rank's contiguous local buffer.
//
// Every layout in morph reduces to this one form: the elements of `frame` (a box of the global
// tensor, row-major order) whose linear index within the frame lies in [flat_begin, flat_end).
//   - replicated or TP-split pieces: frame = the rank's box, flat range = the whole frame;
//   - ZeRO flat-sharded pieces: frame = the TP-local box, flat range = this DP rank's range.
// Local storage holds those elements contiguously, in order: the element with linear index l
// (within the frame) is at local offset l - flat_begin.
//
//   Shard s{Box::FromShape({4, 6}), 5, 17};       // elements 5..16 of a 4x6 frame
//   std::vector<Box> boxes = ShardBoxes(s);       // [0,1)x[5,6), [1,2)x[0,6), [2,3)x[0,5)
//   StridedView v = *ViewOf(s, boxes[1]);         // offset 1, shape {1,6}, strides {6,1}
#ifndef MORPH_SHARD_H_
#define MORPH_SHARD_H_

#include "morph/api.h"

#include <cstdint>
#include <string>
#include <vector>

#include "morph/status.h"
#include "morph/box.h"

namespace morph {

struct MORPH_API Shard {
  Box frame;
  int64_t flat_begin = 0;
  int64_t flat_end = 0;

  // A shard holding the whole of `frame`.
  static StatusOr<Shard> Whole(Box frame);

  int64_t NumElements() const { return flat_end > flat_begin ? flat_end - flat_begin : 0; }
  bool empty() const { return NumElements() == 0; }
  // "[0,4)x[0,6) flat [5,17)"
  std::string ToString() const;
  friend bool operator==(const Shard& a, const Shard& b) {
    return a.frame == b.frame && a.flat_begin == b.flat_begin && a.flat_end == b.flat_end;
  }
};

// The shard's elements as disjoint boxes in storage order: at most 2*rank-1 of them (a partial
// leading row, whole blocks, a partial trailing row, recursively per dimension).
MORPH_API std::vector<Box> ShardBoxes(const Shard& shard);

// Elements of `box` that the shard holds, as disjoint boxes in storage order.
MORPH_API std::vector<Box> IntersectShard(const Shard& shard, const Box& box);

// How a box lies in a shard's local buffer, in elements.
struct MORPH_API StridedView {
  int64_t offset = 0;             // of the box's first element
  std::vector<int64_t> shape;     // the box's shape
  std::vector<int64_t> strides;   // the frame's row-major strides
};

// kInvalidArgument unless every element of `box` is held by the shard.
MORPH_API StatusOr<StridedView> ViewOf(const Shard& shard, const Box& box);

}  // namespace morph

#endif  // MORPH_SHARD_H_
