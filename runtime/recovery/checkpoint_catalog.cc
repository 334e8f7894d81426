#include "runtime/recovery/checkpoint_catalog.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

namespace morph {
namespace {

namespace fs = std::filesystem;

struct Entry {
  int64_t step = 0;
  int64_t generation = 0;
  std::string path;
  bool operator<(const Entry& o) const {
    return std::tie(step, generation) < std::tie(o.step, o.generation);
  }
};

// A decimal number as CheckpointPath writes one: digits only (no sign, no blank), no leading
// zero. kOther for anything else; kTooBig for such digits beyond int64.
enum class Number { kOk, kTooBig, kOther };

Number ParseDecimal(std::string_view s, int64_t* v) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return Number::kOther;
  for (char c : s) {
    if (c < '0' || c > '9') return Number::kOther;
  }
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *v);
  if (ec == std::errc::result_out_of_range) return Number::kTooBig;
  return ec == std::errc() && end == s.data() + s.size() ? Number::kOk : Number::kOther;
}

// Checkpoint folders under `dir`, oldest first (empty when `dir` does not exist), and those named
// like one whose numbers are out of range (a step beyond int64, a generation beyond
// kMaxCheckpointGeneration). Any other name is not a checkpoint folder: not listed.
struct Listing {
  std::vector<Entry> folders;
  std::vector<std::string> out_of_range;
};

Listing ListCheckpoints(const std::string& dir) {
  Listing out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const size_t g = name.find("-g", 5);
    if (!name.starts_with("step-") || g == std::string::npos || !e.is_directory(ec)) continue;
    int64_t step = 0, gen = 0;
    const Number s = ParseDecimal(std::string_view(name).substr(5, g - 5), &step);
    const Number n = ParseDecimal(std::string_view(name).substr(g + 2), &gen);
    if (s == Number::kOther || n == Number::kOther) continue;
    if (s == Number::kTooBig || n == Number::kTooBig || gen > kMaxCheckpointGeneration) {
      out.out_of_range.push_back(e.path().string());
    } else {
      out.folders.push_back({step, gen, e.path().string()});
    }
  }
  std::sort(out.folders.begin(), out.folders.end());
  std::sort(out.out_of_range.begin(), out.out_of_range.end());
  return out;
}

// Whether nothing in `path` (the folder, its rank and temporary folders, their files) was
// modified in the last `ms` milliseconds. False when anything cannot be read.
bool UnchangedFor(const std::string& path, int64_t ms) {
  const auto since = fs::file_time_type::clock::now() - std::chrono::milliseconds(ms);
  std::error_code ec;
  if (fs::last_write_time(path, ec) > since || ec) return false;
  for (auto it = fs::recursive_directory_iterator(path, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (it->last_write_time(ec) > since || ec) return false;
  }
  return !ec;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::string CheckpointPath(const std::string& dir, int64_t step, int64_t generation) {
  return dir + "/step-" + std::to_string(step) + "-g" + std::to_string(generation);
}

StatusOr<CheckpointRef> LatestCompleteCheckpoint(const std::string& dir, int64_t min_generation) {
  std::vector<Entry> all = ListCheckpoints(dir).folders;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->generation < min_generation) continue;
    StatusOr<CheckpointReader> r = CheckpointReader::Open(it->path);
    if (r.ok() && r->step() == it->step) return CheckpointRef{it->step, it->generation, it->path};
  }
  return NotFoundError(
      "no complete checkpoint in " + dir +
      (min_generation > 0 ? " of generation " + std::to_string(min_generation) + " or later" : "") +
      (all.empty() ? "" : " (" + std::to_string(all.size()) + " folders)"));
}

StatusOr<CheckpointRef> NewestIntactCheckpoint(
    const std::string& dir,
    const std::function<Status(const CheckpointReader&, const std::string& path)>& check,
    std::vector<SkippedCheckpoint>* skipped) {
  const std::vector<Entry> all = ListCheckpoints(dir).folders;
  std::vector<SkippedCheckpoint> passed;
  std::optional<CheckpointRef> found;
  for (auto it = all.rbegin(); it != all.rend() && !found; ++it) {
    const CheckpointRef ref{it->step, it->generation, it->path};
    StatusOr<CheckpointReader> r = CheckpointReader::Open(it->path);
    if (r.status().code() == StatusCode::kFailedPrecondition ||
        r.status().code() == StatusCode::kNotFound) {
      continue;  // incomplete (a save cut short, or still being written), or gone
    }
    if (!r.ok()) {
      passed.push_back({ref, r.status()});
    } else if (r->step() != it->step) {
      passed.push_back({ref, DataLossError("it holds step " + std::to_string(r->step()) +
                                           ", its name says " + std::to_string(it->step))});
    } else {
      if (check) {
        MORPH_RETURN_IF_ERROR(check(*r, it->path));
      }
      Status intact = r->Verify();
      if (intact.ok()) {
        found = ref;
      } else {
        passed.push_back({ref, std::move(intact)});
      }
    }
  }
  if (skipped) skipped->insert(skipped->end(), passed.begin(), passed.end());
  if (found) return *found;
  if (!passed.empty()) {
    return DataLossError(
        "no complete checkpoint in " + dir + " is intact: the newest, " + passed.front().ref.path +
        ": " + std::string(passed.front().why.message()) +
        (passed.size() > 1 ? " (and " + std::to_string(passed.size() - 1) + " older ones)" : ""));
  }
  return NotFoundError("no complete checkpoint in " + dir);
}

StatusOr<int64_t> NewestCheckpointGeneration(const std::string& dir) {
  const Listing listing = ListCheckpoints(dir);
  if (!listing.out_of_range.empty()) {
    return FailedPreconditionError(
        "checkpoint folder " + listing.out_of_range.front() +
        " names a step beyond 2^63 - 1 or a generation beyond " +
        std::to_string(kMaxCheckpointGeneration) +
        ": a job numbers its generations after the newest one there and cannot count past it "
        "(rename or remove the folder)");
  }
  int64_t newest = 0;
  for (const Entry& e : listing.folders) newest = std::max(newest, e.generation);
  return newest;
}

StatusOr<int> PruneCheckpoints(const std::string& dir, int keep, int64_t min_generation,
                               int64_t idle_ms) {
  keep = std::max(1, keep);
  std::vector<Entry> own;  // oldest first
  for (Entry& e : ListCheckpoints(dir).folders) {
    if (e.generation >= min_generation) own.push_back(std::move(e));
  }
  std::vector<bool> complete(own.size());
  std::map<int64_t, int64_t> newest_complete_step;  // by generation
  int64_t newest_complete_generation = -1;
  for (size_t i = 0; i < own.size(); ++i) {
    complete[i] = CheckpointReader::Open(own[i].path).ok();
    if (!complete[i]) continue;
    int64_t& newest =
        newest_complete_step.try_emplace(own[i].generation, own[i].step).first->second;
    newest = std::max(newest, own[i].step);
    newest_complete_generation = std::max(newest_complete_generation, own[i].generation);
  }
  // Newest first: the first `keep` complete ones stay; the oldest of them bounds the rest.
  int kept = 0;
  size_t oldest_kept = own.size();
  for (size_t j = own.size(); j-- > 0 && kept < keep;) {
    if (!complete[j]) continue;
    ++kept;
    oldest_kept = j;
  }
  // An incomplete save nobody can still be writing (see the header).
  auto abandoned = [&](const Entry& e) {
    auto it = newest_complete_step.find(e.generation);
    if (it != newest_complete_step.end() && it->second > e.step) return true;
    return newest_complete_generation > e.generation && UnchangedFor(e.path, idle_ms);
  };
  int deleted = 0;
  if (oldest_kept == own.size()) return deleted;  // no complete one: nothing may go
  for (size_t j = 0; j < oldest_kept; ++j) {
    if (!complete[j] && !abandoned(own[j])) continue;
    std::error_code ec;
    fs::remove_all(own[j].path, ec);
    if (ec) {
      return InternalError("deleting old checkpoint " + own[j].path + ": " + ec.message());
    }
    ++deleted;
  }
  return deleted;
}

Status CheckCheckpointMatches(const CheckpointReader& reader, const std::string& path,
                              const std::vector<TensorSpec>& tensors,
                              const std::vector<ScalarSpec>& scalars) {
  std::map<std::string, const TensorInfo*, std::less<>> saved;
  for (const TensorInfo& t : reader.tensors()) saved.emplace(t.name, &t);
  const auto differ = [&](const std::string& what) {
    return FailedPreconditionError("checkpoint " + path +
                                   " does not match the registered state: " + what);
  };
  size_t expected = 0;
  for (const TensorSpec& spec : tensors) {
    ++expected;
    // Planning coordinates: the shape the checkpoint format saw (InfoFor without padding).
    const TensorSpec want = PlanningSpec(spec);
    auto it = saved.find(spec.name);
    if (it == saved.end()) return differ("tensor '" + spec.name + "' is not in it");
    if (it->second->dtype != spec.dtype) {
      return differ("tensor '" + spec.name + "' is " + std::string(DTypeName(spec.dtype)) +
                    ", saved as " + std::string(DTypeName(it->second->dtype)));
    }
    if (it->second->shape != want.shape) {
      return differ("tensor '" + spec.name + "' has shape " + ShapeString(want.shape) +
                    ", saved as " + ShapeString(it->second->shape));
    }
  }
  for (const ScalarSpec& sc : scalars) {
    ++expected;
    const std::string name = std::string(kScalarTensorPrefix) + sc.name;
    auto it = saved.find(name);
    if (it == saved.end()) return differ("scalar '" + sc.name + "' is not in it");
    const std::vector<int64_t> want{sc.bytes};
    if (it->second->dtype != DType::kU8 || it->second->shape != want) {
      return differ("scalar '" + sc.name + "' has " + std::to_string(sc.bytes) +
                    " bytes, saved as " + ShapeString(it->second->shape) + " " +
                    std::string(DTypeName(it->second->dtype)));
    }
  }
  if (saved.size() != expected) {
    for (const TensorInfo& t : reader.tensors()) {
      bool known = false;
      for (const TensorSpec& spec : tensors) known = known || spec.name == t.name;
      for (const ScalarSpec& sc : scalars) {
        known = known || t.name == std::string(kScalarTensorPrefix) + sc.name;
      }
      if (!known) return differ("it holds '" + t.name + "', which is not registered");
    }
  }
  return Status::Ok();
}

}  // namespace morph
