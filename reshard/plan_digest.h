// PlanDigest: a fingerprint of everything that shapes a reshard's exchange, so that
// participants prove they run the same plan before the first byte moves (docs/design.md §6.3).
//
// Each part hashes one input on its own (64-bit FNV-1a over a canonical little-endian encoding,
// identical on every machine), so a mismatch names what differs:
//
//   PlanDigest d = planner.digest();                    // planner inputs; set in every LocalPlan
//   d = WithMessageLayout(d, executor_options, n);      // + what cuts messages (executor.h)
//   commit.plan_digest = d.combined();                  // a value the runtime can ship
//   if (d != theirs) return FailedPreconditionError("plans differ in " + d.Differences(theirs));
//
// A part that is 0 is unknown (e.g. a LocalPlan built by hand rather than by the Planner);
// comparisons treat an unknown part as differing only from a known one.
// Pure values and functions; any thread.
#ifndef MORPH_RESHARD_PLAN_DIGEST_H_
#define MORPH_RESHARD_PLAN_DIGEST_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace morph {

struct PlanInput;    // reshard/plan.h
struct PlanOptions;  // reshard/plan.h

// 64-bit FNV-1a over a canonical encoding: integers as 8 little-endian bytes, strings as length
// then bytes. Stable across machines, compilers and releases (changing it is a wire change).
class DigestHasher {
 public:
  DigestHasher& Add(uint64_t v);
  DigestHasher& Add(int64_t v) { return Add(static_cast<uint64_t>(v)); }
  DigestHasher& Add(int v) { return Add(static_cast<uint64_t>(static_cast<int64_t>(v))); }
  DigestHasher& Add(std::string_view s);
  // Never 0 (0 means "unknown" in a PlanDigest).
  uint64_t value() const { return h_ == 0 ? 1 : h_; }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

struct PlanDigest {
  enum Part : int {
    kTensors = 0,      // names, dtypes, shapes, layouts, in order
    kOldConfig,        // old ParallelConfig
    kOldParticipants,  // old rank -> participant
    kNewConfig,        // new ParallelConfig
    kParticipants,     // available participants (sorted) and num_participants
    kAssignment,       // new rank -> participant (the planner's, or the one it was given)
    kPlanOptions,      // PlanOptions
    kMessageLayout,    // executor options that cut messages (WithMessageLayout)
    kNumParts
  };
  std::array<uint64_t, kNumParts> parts{};

  static std::string_view PartName(int part);
  // One 64-bit value of all parts (what a coordinator puts in its commit). 0 if no part is known.
  uint64_t combined() const;
  bool known() const { return combined() != 0; }
  // Names of the parts that differ ("old config, assignment"); "" if none. An unknown part
  // differs from a known one, two unknown parts do not.
  std::string Differences(const PlanDigest& other) const;
  // "3f2a9c0d11e04b7a" (combined, 16 hex digits).
  std::string ToString() const;
  friend bool operator==(const PlanDigest&, const PlanDigest&) = default;
};

// Digest of the planner's input and options, with the assignment given as participant of each
// new rank. kMessageLayout is left 0.
PlanDigest DigestPlanInput(const PlanInput& input, const PlanOptions& options,
                           std::span<const int32_t> participant_of_new_rank);

// 16 hex digits of `v`.
std::string DigestHex(uint64_t v);

}  // namespace morph

#endif  // MORPH_RESHARD_PLAN_DIGEST_H_
