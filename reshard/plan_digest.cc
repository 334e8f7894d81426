#include "reshard/plan_digest.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "reshard/plan.h"

namespace morph {

DigestHasher& DigestHasher::Add(uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h_ = (h_ ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  }
  return *this;
}

DigestHasher& DigestHasher::Add(std::string_view s) {
  Add(static_cast<uint64_t>(s.size()));
  for (unsigned char c : s) h_ = (h_ ^ c) * 1099511628211ull;
  return *this;
}

std::string_view PlanDigest::PartName(int part) {
  switch (part) {
    case kTensors:
      return "tensors";
    case kOldConfig:
      return "old config";
    case kOldParticipants:
      return "old participant map";
    case kNewConfig:
      return "new config";
    case kParticipants:
      return "available participants";
    case kAssignment:
      return "assignment";
    case kPlanOptions:
      return "plan options";
    case kMessageLayout:
      return "executor message layout (chunk/staging bytes)";
    default:
      return "unknown part";
  }
}

uint64_t PlanDigest::combined() const {
  if (std::all_of(parts.begin(), parts.end(), [](uint64_t p) { return p == 0; })) return 0;
  DigestHasher h;
  h.Add(std::string_view("morph plan digest v1"));
  for (uint64_t p : parts) h.Add(p);
  return h.value();
}

std::string PlanDigest::Differences(const PlanDigest& other) const {
  std::string out;
  for (int i = 0; i < kNumParts; ++i) {
    if (parts[static_cast<size_t>(i)] == other.parts[static_cast<size_t>(i)]) continue;
    if (!out.empty()) out += ", ";
    out += PartName(i);
  }
  return out;
}

std::string DigestHex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string PlanDigest::ToString() const { return DigestHex(combined()); }

namespace {

void AddConfig(DigestHasher& h, const ParallelConfig& c) {
  h.Add(c.dp).Add(c.tp).Add(c.pp).Add(c.zero_stage).Add(c.micro_batches);
  h.Add(static_cast<uint64_t>(c.stage_of_layer.size()));
  for (int s : c.stage_of_layer) h.Add(s);
}

}  // namespace

PlanDigest DigestPlanInput(const PlanInput& in, const PlanOptions& options,
                           std::span<const int32_t> participant_of_new_rank) {
  PlanDigest d;
  auto& p = d.parts;
  {
    DigestHasher h;
    h.Add(static_cast<uint64_t>(in.tensors.size()));
    for (const TensorSpec& t : in.tensors) {
      h.Add(std::string_view(t.name)).Add(static_cast<int>(t.dtype));
      h.Add(static_cast<uint64_t>(t.shape.size()));
      for (int64_t s : t.shape) h.Add(s);
      h.Add(t.layout.layer()).Add(t.layout.tp_dim()).Add(t.layout.zero_sharded() ? 1 : 0);
      // Fields added with the real-model layouts; hashed only when set, so the digest of a
      // layout without them is what it was before they existed.
      if (t.layout.extended()) {
        h.Add(std::string_view("layout v2"));
        h.Add(static_cast<uint64_t>(t.layout.extra_layers().size()));
        for (int l : t.layout.extra_layers()) h.Add(l);
        h.Add(t.layout.tp_blocks()).Add(t.layout.pad_multiple()).Add(t.layout.zero_group());
      }
      // The torch.chunk layouts (ChunkTP, ChunkDP), likewise only when set.
      if (t.layout.chunked()) {
        h.Add(std::string_view("layout v3"));
        h.Add(t.layout.tp_chunked() ? 1 : 0).Add(t.layout.dp_chunked() ? 1 : 0);
      }
    }
    p[PlanDigest::kTensors] = h.value();
  }
  {
    DigestHasher h;
    AddConfig(h, in.old_config);
    p[PlanDigest::kOldConfig] = h.value();
  }
  {
    DigestHasher h;
    h.Add(static_cast<uint64_t>(in.old_participant_of_rank.size()));
    for (int32_t q : in.old_participant_of_rank) h.Add(q);
    p[PlanDigest::kOldParticipants] = h.value();
  }
  {
    DigestHasher h;
    AddConfig(h, in.new_config);
    p[PlanDigest::kNewConfig] = h.value();
  }
  {
    std::vector<int32_t> avail = in.available;  // any order: the set matters
    std::sort(avail.begin(), avail.end());
    DigestHasher h;
    h.Add(in.num_participants).Add(static_cast<uint64_t>(avail.size()));
    for (int32_t q : avail) h.Add(q);
    p[PlanDigest::kParticipants] = h.value();
  }
  {
    DigestHasher h;
    h.Add(static_cast<uint64_t>(participant_of_new_rank.size()));
    for (int32_t q : participant_of_new_rank) h.Add(q);
    p[PlanDigest::kAssignment] = h.value();
  }
  {
    DigestHasher h;
    h.Add(options.max_world);
    h.Add(options.max_tensors);
    p[PlanDigest::kPlanOptions] = h.value();
  }
  return d;
}

}  // namespace morph
