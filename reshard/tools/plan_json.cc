#include "reshard/tools/plan_json.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <sstream>

namespace morph {
namespace {

using nlohmann::json;

Status Bad(const std::string& path, const std::string& what) {
  return InvalidArgumentError(path + ": " + what);
}

Status OnlyKeys(const json& j, const std::string& path, std::initializer_list<const char*> keys) {
  if (!j.is_object()) return Bad(path, "must be an object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::none_of(keys.begin(), keys.end(), [&](const char* k) { return it.key() == k; })) {
      return Bad(path + "." + it.key(), "unknown field");
    }
  }
  return Status();
}

StatusOr<int64_t> Int(const json& j, const std::string& path, int64_t lo, int64_t hi) {
  if (!j.is_number_integer()) return Bad(path, "must be an integer, got " + j.dump());
  const int64_t v = j.get<int64_t>();
  if (v < lo || v > hi) {
    return Bad(path, std::to_string(v) + " is not in [" + std::to_string(lo) + ", " +
                         std::to_string(hi) + "]");
  }
  return v;
}

StatusOr<std::string> Str(const json& j, const std::string& path) {
  if (!j.is_string()) return Bad(path, "must be a string, got " + j.dump());
  return j.get<std::string>();
}

StatusOr<ParallelConfig> ParseConfig(const json& j, const std::string& path, int num_layers) {
  MORPH_RETURN_IF_ERROR(
      OnlyKeys(j, path, {"dp", "tp", "pp", "zero_stage", "stage_of_layer", "micro_batches"}));
  ParallelConfig c;
  for (auto [key, field] : {std::pair{"dp", &c.dp}, {"tp", &c.tp}, {"pp", &c.pp}}) {
    if (!j.contains(key)) return Bad(path + "." + key, "is required");
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j[key], path + "." + key, 1, 1 << 20));
    *field = static_cast<int>(v);
  }
  if (j.contains("zero_stage")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["zero_stage"], path + ".zero_stage", 0, 3));
    c.zero_stage = static_cast<int>(v);
  }
  if (j.contains("micro_batches")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["micro_batches"], path + ".micro_batches", 1, 1 << 20));
    c.micro_batches = static_cast<int>(v);
  }
  if (j.contains("stage_of_layer")) {
    const json& s = j["stage_of_layer"];
    if (!s.is_array()) return Bad(path + ".stage_of_layer", "must be an array");
    if (static_cast<int>(s.size()) != num_layers) {
      return Bad(path + ".stage_of_layer", "has " + std::to_string(s.size()) +
                                               " entries, the model has " +
                                               std::to_string(num_layers) + " layers");
    }
    for (size_t i = 0; i < s.size(); ++i) {
      const std::string p = path + ".stage_of_layer[" + std::to_string(i) + "]";
      MORPH_ASSIGN_OR_RETURN(int64_t v, Int(s[i], p, 0, c.pp - 1));
      c.stage_of_layer.push_back(static_cast<int>(v));
    }
  } else {
    auto st = ParallelConfig::EvenStages(num_layers, c.pp);
    if (!st.ok()) return Bad(path + ".pp", std::string(st.status().message()));
    c.stage_of_layer = *std::move(st);
  }
  if (Status s = c.Validate(); !s.ok()) return Bad(path, std::string(s.message()));
  return c;
}

// The torch.chunk layouts of a "tensors" entry: "tp_chunk" (DTensor's Shard(tp_dim)) and
// "dp_chunk" (FSDP2's Shard(0) over DP; with "zero_group", HSDP).
struct Chunks {
  bool tp = false, dp = false;
};
StatusOr<Chunks> ParseChunks(const json& j, const std::string& path, int tp_dim, int blocks,
                             int pad, bool zero) {
  Chunks c;
  for (const char* key : {"tp_chunk", "dp_chunk"}) {
    if (j.contains(key) && !j[key].is_boolean()) {
      return Bad(path + "." + key, "must be true or false");
    }
  }
  c.tp = j.value("tp_chunk", false);
  c.dp = j.value("dp_chunk", false);
  if (c.tp && tp_dim < 0) return Bad(path + ".tp_chunk", "needs \"tp_dim\" (the dim to chunk)");
  if (c.tp && (blocks > 1 || pad > 0)) {
    return Bad(path + ".tp_chunk", "cannot be combined with \"tp_blocks\" or \"pad_multiple\"");
  }
  if (c.dp && zero) {
    return Bad(path + ".dp_chunk",
               "cannot be combined with \"zero\": true (one DP sharding: flat ZeRO ranges or "
               "dim-0 chunks)");
  }
  return c;
}

// One entry of "tensors", expanded over its "layers" range.
Status ParseTensor(const json& j, const std::string& path, std::vector<TensorSpec>& out,
                   std::vector<std::string>& paths) {
  MORPH_RETURN_IF_ERROR(
      OnlyKeys(j, path,
               {"name", "dtype", "shape", "layer", "layers", "tp_dim", "zero", "also_on_layers",
                "tp_blocks", "pad_multiple", "zero_group", "tp_chunk", "dp_chunk"}));
  if (!j.contains("name")) return Bad(path + ".name", "is required");
  MORPH_ASSIGN_OR_RETURN(std::string name, Str(j["name"], path + ".name"));
  if (!j.contains("dtype")) return Bad(path + ".dtype", "is required");
  MORPH_ASSIGN_OR_RETURN(std::string dts, Str(j["dtype"], path + ".dtype"));
  auto dtype = ParseDType(dts);
  if (!dtype.ok()) return Bad(path + ".dtype", std::string(dtype.status().message()));
  if (!j.contains("shape") || !j["shape"].is_array()) {
    return Bad(path + ".shape", "is required and must be an array");
  }
  std::vector<int64_t> shape;
  for (size_t i = 0; i < j["shape"].size(); ++i) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["shape"][i], path + ".shape[" + std::to_string(i) + "]",
                                          0, int64_t{1} << 50));
    shape.push_back(v);
  }
  int first = 0, last = 0;
  if (j.contains("layer") && j.contains("layers")) {
    return Bad(path, "give either \"layer\" or \"layers\", not both");
  }
  if (j.contains("layer")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["layer"], path + ".layer", 0, 1 << 20));
    first = last = static_cast<int>(v);
  } else if (j.contains("layers")) {
    const json& l = j["layers"];
    if (!l.is_array() || l.size() != 2) return Bad(path + ".layers", "must be [first, last]");
    MORPH_ASSIGN_OR_RETURN(int64_t a, Int(l[0], path + ".layers[0]", 0, 1 << 20));
    MORPH_ASSIGN_OR_RETURN(int64_t b, Int(l[1], path + ".layers[1]", a, 1 << 20));
    first = static_cast<int>(a);
    last = static_cast<int>(b);
    if (last > first && name.find("{layer}") == std::string::npos) {
      return Bad(path + ".name", "must contain {layer} when \"layers\" spans several layers");
    }
  }
  int tp_dim = -1;
  if (j.contains("tp_dim") && !j["tp_dim"].is_null()) {
    MORPH_ASSIGN_OR_RETURN(
        int64_t v, Int(j["tp_dim"], path + ".tp_dim", 0, static_cast<int64_t>(shape.size()) - 1));
    tp_dim = static_cast<int>(v);
  }
  bool zero = false;
  if (j.contains("zero")) {
    if (!j["zero"].is_boolean()) return Bad(path + ".zero", "must be true or false");
    zero = j["zero"].get<bool>();
  }
  // The real-model layouts (docs/reshard-planner.md §1).
  std::vector<int> also;
  if (j.contains("also_on_layers")) {
    const json& a = j["also_on_layers"];
    if (!a.is_array()) return Bad(path + ".also_on_layers", "must be an array of layers");
    for (size_t i = 0; i < a.size(); ++i) {
      MORPH_ASSIGN_OR_RETURN(
          int64_t v, Int(a[i], path + ".also_on_layers[" + std::to_string(i) + "]", 0, 1 << 20));
      also.push_back(static_cast<int>(v));
    }
    if (last > first && !also.empty()) {
      return Bad(path + ".also_on_layers",
                 "cannot be combined with \"layers\" spanning several layers (each expanded "
                 "tensor would be on every listed layer)");
    }
  }
  int blocks = 1;
  if (j.contains("tp_blocks")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["tp_blocks"], path + ".tp_blocks", 1, 1 << 20));
    if (v > 1 && tp_dim < 0) return Bad(path + ".tp_blocks", "needs \"tp_dim\" (a TP split)");
    if (v > 1 && shape[size_t(tp_dim)] % v != 0) {
      return Bad(path + ".tp_blocks", std::to_string(v) + " blocks do not divide dimension " +
                                          std::to_string(tp_dim) + " of size " +
                                          std::to_string(shape[size_t(tp_dim)]));
    }
    blocks = static_cast<int>(v);
  }
  int pad = 0;
  if (j.contains("pad_multiple")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["pad_multiple"], path + ".pad_multiple", 1, 1 << 20));
    if (tp_dim < 0) return Bad(path + ".pad_multiple", "needs \"tp_dim\" (pads the split dim)");
    if (blocks > 1) return Bad(path + ".pad_multiple", "cannot be combined with \"tp_blocks\"");
    pad = static_cast<int>(v);
  }
  MORPH_ASSIGN_OR_RETURN(const Chunks chunks, ParseChunks(j, path, tp_dim, blocks, pad, zero));
  int group = 0;
  if (j.contains("zero_group")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(j["zero_group"], path + ".zero_group", 1, 1 << 20));
    if (!zero && !chunks.dp) {
      return Bad(path + ".zero_group",
                 "needs \"zero\": true (hybrid ZeRO) or \"dp_chunk\": true (HSDP)");
    }
    group = static_cast<int>(v);
  }
  // The planner refuses more than kMaxPlanTensors tensors; refuse them here, before the
  // expansion builds them (many "layers" ranges of 2^20 layers each would take minutes).
  if (static_cast<int64_t>(out.size()) + (last - first + 1) > kMaxPlanTensors) {
    return Bad(path + (first == last ? std::string() : ".layers"),
               "the model would have more than " + std::to_string(kMaxPlanTensors) +
                   " tensors (the planner's limit)");
  }
  for (int l = first; l <= last; ++l) {
    std::string n = name;
    for (size_t at; (at = n.find("{layer}")) != std::string::npos;) {
      n.replace(at, 7, std::to_string(l));
    }
    Layout layout = Layout::Layer(l).ZeroShard(zero);
    for (int a : also) layout = layout.AlsoOnLayer(a);
    layout = blocks > 1 ? layout.SplitTPBlocks(tp_dim, blocks) : layout.SplitTP(tp_dim);
    if (pad > 0) layout = layout.PadToMultiple(pad);
    if (chunks.tp) layout = layout.ChunkTP(tp_dim);
    if (group > 0) layout = layout.ZeroShard(group);
    if (chunks.dp) layout = layout.ChunkDP(group);
    TensorSpec t{n, *dtype, shape, layout};
    if (Status s = ValidateTensorSpec(t); !s.ok()) return Bad(path, std::string(s.message()));
    out.push_back(std::move(t));
    paths.push_back(path);
  }
  return Status();
}

StatusOr<std::vector<std::string>> Names(const json& j, const std::string& path) {
  std::vector<std::string> v;
  if (!j.is_array()) return Bad(path, "must be an array of worker names");
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = path + "[" + std::to_string(i) + "]";
    MORPH_ASSIGN_OR_RETURN(std::string s, Str(j[i], at));
    if (s.empty()) return Bad(at, "worker name is empty");
    v.push_back(std::move(s));
  }
  return v;
}

std::string Bytes(int64_t b) {
  char buf[64];
  const double x = static_cast<double>(b);
  if (b >= (int64_t{1} << 30)) {
    std::snprintf(buf, sizeof(buf), "%lld (%.2f GiB)", static_cast<long long>(b), x / (1 << 30));
  } else if (b >= (1 << 20)) {
    std::snprintf(buf, sizeof(buf), "%lld (%.2f MiB)", static_cast<long long>(b), x / (1 << 20));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(b));
  }
  return buf;
}

json BoxJson(const Box& b) {
  json a = json::array();
  for (const Interval& i : b.dims()) a.push_back({i.begin, i.end});
  return a;
}

}  // namespace

namespace {

// Rejects duplicate object keys while parsing (nlohmann keeps the last one silently), naming the
// key's JSON path. Tracks the path with a stack of open containers.
class DuplicateKeyCheck {
 public:
  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        frames_.push_back({event == json::parse_event_t::object_start, ChildPath(), {}, {}, 0});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second && error_.ok()) {
          error_ =
              Bad(f.path + "." + f.key, "duplicate key (a JSON object may name each field once)");
        }
        break;
      }
      case json::parse_event_t::value:
        if (!frames_.empty() && !frames_.back().is_object) ++frames_.back().index;
        break;
    }
    return true;
  }
  const Status& error() const { return error_; }

 private:
  struct Frame {
    bool is_object = false;
    std::string path;
    std::set<std::string> keys;
    std::string key;   // the object's current key
    size_t index = 0;  // the array's next element
  };
  // The path of a container starting now (and, in an array, count it as an element).
  std::string ChildPath() {
    if (frames_.empty()) return "$";
    Frame& f = frames_.back();
    if (f.is_object) return f.path + "." + f.key;
    return f.path + "[" + std::to_string(f.index++) + "]";
  }
  std::vector<Frame> frames_;
  Status error_;
};

}  // namespace

StatusOr<PlanRequest> ParsePlanRequest(std::string_view text) {
  json root;
  DuplicateKeyCheck dup;
  try {
    root = json::parse(text, std::ref(dup));
  } catch (const json::exception& e) {
    return InvalidArgumentError(std::string("$: not valid JSON: ") + e.what());
  }
  MORPH_RETURN_IF_ERROR(dup.error());
  MORPH_RETURN_IF_ERROR(OnlyKeys(root, "$", {"num_layers", "tensors", "old", "new", "workers"}));
  if (!root.contains("tensors") || !root["tensors"].is_array()) {
    return Bad("$.tensors", "is required and must be an array");
  }
  PlanRequest req;
  PlanInput& in = req.input;
  std::vector<std::string> paths;
  for (size_t i = 0; i < root["tensors"].size(); ++i) {
    MORPH_RETURN_IF_ERROR(
        ParseTensor(root["tensors"][i], "$.tensors[" + std::to_string(i) + "]", in.tensors, paths));
  }
  std::map<std::string, size_t> seen;
  int num_layers = 1;
  for (size_t i = 0; i < in.tensors.size(); ++i) {
    auto [it, fresh] = seen.emplace(in.tensors[i].name, i);
    if (!fresh) {
      return Bad(paths[i] + ".name",
                 "tensor '" + in.tensors[i].name + "' is also defined at " + paths[it->second]);
    }
    for (int l : in.tensors[i].layout.layers()) num_layers = std::max(num_layers, l + 1);
  }
  if (root.contains("num_layers")) {
    MORPH_ASSIGN_OR_RETURN(int64_t v, Int(root["num_layers"], "$.num_layers", num_layers, 1 << 20));
    num_layers = static_cast<int>(v);
  }
  for (const char* key : {"old", "new"}) {
    if (!root.contains(key)) return Bad(std::string("$.") + key, "is required");
  }
  MORPH_ASSIGN_OR_RETURN(in.old_config, ParseConfig(root["old"], "$.old", num_layers));
  MORPH_ASSIGN_OR_RETURN(in.new_config, ParseConfig(root["new"], "$.new", num_layers));
  for (size_t i = 0; i < in.tensors.size(); ++i) {
    for (auto [key, cfg] : {std::pair{"$.old", &in.old_config}, {"$.new", &in.new_config}}) {
      if (Status s = ValidateTensorForConfig(in.tensors[i], *cfg); !s.ok()) {
        return Bad(paths[i], std::string(s.message()) + " (with " + key + ")");
      }
    }
  }

  // Workers: participants are the old workers that are not dead, in old rank order, then joiners.
  const int old_world = in.old_config.world();
  std::vector<std::string> old_names, dead, leave, join;
  json w = root.contains("workers") ? root["workers"] : json::object();
  MORPH_RETURN_IF_ERROR(OnlyKeys(w, "$.workers", {"old", "dead", "leave", "join"}));
  if (w.contains("old")) {
    MORPH_ASSIGN_OR_RETURN(old_names, Names(w["old"], "$.workers.old"));
    if (static_cast<int>(old_names.size()) != old_world) {
      return Bad("$.workers.old", "has " + std::to_string(old_names.size()) +
                                      " names, the old config has world " +
                                      std::to_string(old_world));
    }
  } else {
    for (int r = 0; r < old_world; ++r) old_names.push_back("w" + std::to_string(r));
  }
  std::map<std::string, int> old_rank_of;
  for (int r = 0; r < old_world; ++r) {
    if (!old_rank_of.emplace(old_names[static_cast<size_t>(r)], r).second) {
      return Bad("$.workers.old[" + std::to_string(r) + "]",
                 "worker '" + old_names[static_cast<size_t>(r)] + "' is listed twice");
    }
  }
  std::vector<char> is_dead(static_cast<size_t>(old_world), 0), leaving(is_dead);
  for (auto [key, list, flag] :
       {std::tuple{"dead", &dead, &is_dead}, {"leave", &leave, &leaving}}) {
    const std::string path = std::string("$.workers.") + key;
    if (!w.contains(key)) continue;
    MORPH_ASSIGN_OR_RETURN(*list, Names(w[key], path));
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string p = path + "[" + std::to_string(i) + "]";
      auto it = old_rank_of.find((*list)[i]);
      if (it == old_rank_of.end()) {
        return Bad(p, "'" + (*list)[i] + "' is not in $.workers.old");
      }
      if (is_dead[static_cast<size_t>(it->second)] || leaving[static_cast<size_t>(it->second)]) {
        return Bad(p, "worker '" + (*list)[i] + "' is already dead or leaving");
      }
      (*flag)[static_cast<size_t>(it->second)] = 1;
    }
  }
  if (w.contains("join")) {
    MORPH_ASSIGN_OR_RETURN(join, Names(w["join"], "$.workers.join"));
  }
  std::set<std::string> joined;
  for (size_t i = 0; i < join.size(); ++i) {
    if (old_rank_of.count(join[i]) || !joined.insert(join[i]).second) {
      return Bad("$.workers.join[" + std::to_string(i) + "]",
                 "worker '" + join[i] + "' is already a worker");
    }
  }
  in.old_participant_of_rank.assign(static_cast<size_t>(old_world), -1);
  for (int r = 0; r < old_world; ++r) {
    if (is_dead[static_cast<size_t>(r)]) continue;
    const int32_t q = static_cast<int32_t>(req.worker_names.size());
    in.old_participant_of_rank[static_cast<size_t>(r)] = q;
    req.worker_names.push_back(old_names[static_cast<size_t>(r)]);
    if (!leaving[static_cast<size_t>(r)]) in.available.push_back(q);
  }
  for (const std::string& n : join) {
    in.available.push_back(static_cast<int32_t>(req.worker_names.size()));
    req.worker_names.push_back(n);
  }
  in.num_participants = static_cast<int32_t>(req.worker_names.size());
  if (static_cast<int>(in.available.size()) < in.new_config.world()) {
    return Bad("$.new", "needs " + std::to_string(in.new_config.world()) + " workers but only " +
                            std::to_string(in.available.size()) +
                            " are available (old - dead - leaving + joining)");
  }
  return req;
}

std::string FormatPlanSummary(const PlanRequest& req, const Planner& planner, const PlanSummary& s,
                              const PlanTimes& times) {
  const PlanInput& in = planner.input();
  const Assignment& a = planner.assignment();
  const auto& names = req.worker_names;
  std::ostringstream os;
  os << "old: " << in.old_config.ToString() << " (" << in.old_config.world() << " ranks)\n"
     << "new: " << in.new_config.ToString() << " (" << in.new_config.world() << " ranks)\n"
     << "tensors: " << in.tensors.size() << ", workers: " << names.size()
     << ", assignment: " << (a.exact ? "exact" : "shipped (not verified optimal)") << "\n\n"
     << "new rank  worker  old rank  resident bytes\n";
  for (int r = 0; r < in.new_config.world(); ++r) {
    const int32_t q = a.participant_of_new_rank[static_cast<size_t>(r)];
    const int32_t o = a.old_rank_of_participant[static_cast<size_t>(q)];
    char line[256];
    std::snprintf(line, sizeof(line), "%8d  %6s  %8s  %lld\n", r,
                  names[static_cast<size_t>(q)].c_str(), o < 0 ? "join" : std::to_string(o).c_str(),
                  static_cast<long long>(planner.ResidentBytes(q, r)));
    os << line;
  }
  std::string standby, leaving;
  for (int32_t q : in.available) {
    if (a.new_rank_of_participant[static_cast<size_t>(q)] < 0)
      standby += " " + names[static_cast<size_t>(q)];
  }
  for (size_t q = 0; q < names.size(); ++q) {
    if (a.new_rank_of_participant[q] < 0 &&
        std::find(in.available.begin(), in.available.end(), static_cast<int32_t>(q)) ==
            in.available.end()) {
      leaving += " " + names[q];
    }
  }
  os << "standby:" << (standby.empty() ? " none" : standby) << "\n"
     << "leaving:" << (leaving.empty() ? " none" : leaving) << "\n\n"
     << "bytes needed:      " << Bytes(s.bytes_needed) << "\n"
     << "bytes resident:    " << Bytes(s.bytes_resident) << "\n"
     << "bytes lower bound: " << Bytes(s.bytes_lower_bound) << "\n"
     << "bytes moved:       " << Bytes(s.bytes_moved) << "\n";
  if (s.bytes_lost > 0) {
    os << "bytes lost:        " << Bytes(s.bytes_lost)
       << " (no surviving replica: restore from a checkpoint)\n";
  }
  auto nm = [&](int32_t q) { return q < 0 ? std::string("none") : names[static_cast<size_t>(q)]; };
  os << "busiest sender:    " << nm(s.busiest_sender) << " "
     << Bytes(s.busiest_sender < 0 ? 0 : s.bytes_sent[static_cast<size_t>(s.busiest_sender)])
     << "\n"
     << "busiest receiver:  " << nm(s.busiest_receiver) << " "
     << Bytes(s.busiest_receiver < 0 ? 0
                                     : s.bytes_received[static_cast<size_t>(s.busiest_receiver)])
     << "\n"
     << "busiest link:      " << nm(s.busiest_link.from) << " -> " << nm(s.busiest_link.to) << " "
     << Bytes(s.busiest_link.bytes) << "\n"
     << "messages (pieces): " << s.num_sends << "\n\n"
     << "worker  sent  received\n";
  for (size_t q = 0; q < names.size(); ++q) {
    if (s.bytes_sent[q] == 0 && s.bytes_received[q] == 0) continue;
    os << names[q] << "  " << s.bytes_sent[q] << "  " << s.bytes_received[q] << "\n";
  }
  char t[200];
  std::snprintf(t, sizeof(t),
                "\nplan time: assignment %.3f ms, local plans %.3f ms for all workers, "
                "slowest worker %.3f ms\n",
                times.create_seconds * 1e3, times.plans_seconds * 1e3,
                times.max_local_seconds * 1e3);
  os << t;
  return os.str();
}

nlohmann::json PlanToJson(const PlanRequest& req, const Planner& planner,
                          const std::vector<LocalPlan>& plans,
                          const std::vector<std::vector<PieceMove>>& lost, const PlanSummary& s,
                          const PlanTimes& times) {
  const PlanInput& in = planner.input();
  const Assignment& a = planner.assignment();
  const auto& names = req.worker_names;
  json out;
  json asg = json::array();
  for (int r = 0; r < in.new_config.world(); ++r) {
    const int32_t q = a.participant_of_new_rank[static_cast<size_t>(r)];
    const int32_t o = a.old_rank_of_participant[static_cast<size_t>(q)];
    asg.push_back({{"new_rank", r},
                   {"worker", names[static_cast<size_t>(q)]},
                   {"old_rank", o < 0 ? json(nullptr) : json(o)},
                   {"resident_bytes", planner.ResidentBytes(q, r)}});
  }
  out["assignment"] = asg;
  out["assignment_exact"] = a.exact;
  json standby = json::array();
  for (int32_t q : in.available) {
    if (a.new_rank_of_participant[static_cast<size_t>(q)] < 0)
      standby.push_back(names[static_cast<size_t>(q)]);
  }
  out["standby"] = standby;
  json per = json::array();
  for (size_t q = 0; q < names.size(); ++q) {
    per.push_back(
        {{"worker", names[q]}, {"sent", s.bytes_sent[q]}, {"received", s.bytes_received[q]}});
  }
  auto nm = [&](int32_t q) { return q < 0 ? json(nullptr) : json(names[static_cast<size_t>(q)]); };
  out["summary"] = {{"bytes_needed", s.bytes_needed},
                    {"bytes_resident", s.bytes_resident},
                    {"bytes_lower_bound", s.bytes_lower_bound},
                    {"bytes_moved", s.bytes_moved},
                    {"bytes_lost", s.bytes_lost},
                    {"busiest_sender", nm(s.busiest_sender)},
                    {"busiest_receiver", nm(s.busiest_receiver)},
                    {"busiest_link",
                     {{"from", nm(s.busiest_link.from)},
                      {"to", nm(s.busiest_link.to)},
                      {"bytes", s.busiest_link.bytes}}},
                    {"num_pieces_sent", s.num_sends},
                    {"per_worker", per}};
  out["plan_seconds"] = {{"assignment", times.create_seconds},
                         {"local_plans_total", times.plans_seconds},
                         {"slowest_worker", times.max_local_seconds}};
  json pj = json::array();
  for (const LocalPlan& lp : plans) {
    auto moves = [&](const std::vector<PieceMove>& v) {
      json m = json::array();
      for (const PieceMove& x : v) {
        m.push_back(
            {{"tensor", in.tensors[static_cast<size_t>(x.tensor)].name},
             {"peer", x.peer < 0 ? json(nullptr) : json(names[static_cast<size_t>(x.peer)])},
             {"box", BoxJson(x.box)},
             {"bytes", PieceBytes(lp, x)}});
      }
      return m;
    };
    pj.push_back({{"worker", names[static_cast<size_t>(lp.participant)]},
                  {"new_rank", a.new_rank_of_participant[static_cast<size_t>(lp.participant)]},
                  {"sends", moves(lp.sends)},
                  {"recvs", moves(lp.recvs)},
                  {"local_copies", moves(lp.local_copies)},
                  {"lost", lost.empty() ? json::array()
                                        : moves(lost[static_cast<size_t>(lp.participant)])}});
  }
  out["plans"] = pj;
  return out;
}

}  // namespace morph
