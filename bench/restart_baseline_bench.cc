// The C++ restart baseline of the end-to-end reconfiguration benchmark (issue 9): what a user
// without morph does at best. The old world's processes write each unique byte of the state
// once (replicas balanced over their holders) and fsync; every process exits; a fresh world is
// started (fork + exec); each new rank reads from the files only the byte ranges its new
// shards need (pread) and checks them bitwise. Model and changes: bench/reconfig_cases.h; who
// holds what: reshard/layout.h ShardOf, the same layouts morph reshards.
//
// One JSON object per change on stdout:
//   {"name":"restart_baseline/dp4to2","change":"dp4to2","bytes":<unique state>,
//    "bytes_written":...,"bytes_read":...,"save_s":...,"restart_s":...,"load_s":...,
//    "seconds":<save + restart + load>,"verified":true, ...}
// Phases: save = all old ranks released -> every file written and fsynced (and the folder);
// restart = -> every old process gone and every new one started, with its shards allocated and
// its reads planned; load = all new ranks released -> every read done.
//
// Usage: restart_baseline_bench [--bytes=1GiB] [--changes=dp4to2,dp2to4,tp2to1,pp2to1]
//                               [--dir=build/bench-tmp/restart_baseline]
//        restart_baseline_bench --print-layout=CHANGE [--bytes=...]   (JSON for dcp_reconfig.py)
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/params.h"
#include "morph/status.h"
#include "bench/reconfig_cases.h"
#include "reshard/layout.h"
#include "morph/shard.h"

namespace morph::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kElem = 4;                 // every tensor of the model is f32
constexpr int kGoFd = 3, kReportFd = 4;  // a worker's pipes after exec
constexpr auto kPhaseTimeout = std::chrono::seconds(600);

// Deterministic content: element `idx` (global row-major index) of tensor `t`.
inline uint32_t ValueAt(int t, int64_t idx) {
  return static_cast<uint32_t>(idx) * 2654435761u + static_cast<uint32_t>(t) * 40503u +
         static_cast<uint32_t>(idx >> 32);
}

// Calls f(local_offset_a, local_offset_b, global_index, count) for each row of `box`
// (all dimensions but the last), with the offsets of the row in views `a` and `b`.
template <typename F>
void ForEachRow(const TensorSpec& spec, const Box& box, const StridedView& a, const StridedView& b,
                F f) {
  const int rank = box.rank();
  std::vector<int64_t> gstride(static_cast<size_t>(rank), 1);
  for (int d = rank - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * spec.shape[d + 1];
  const int64_t len = box.dim(rank - 1).end - box.dim(rank - 1).begin;
  std::vector<int64_t> c(static_cast<size_t>(rank), 0);
  while (true) {
    int64_t oa = a.offset, ob = b.offset, g = box.dim(rank - 1).begin;
    for (int d = 0; d < rank - 1; ++d) {
      oa += c[d] * a.strides[d];
      ob += c[d] * b.strides[d];
      g += (box.dim(d).begin + c[d]) * gstride[d];
    }
    f(oa, ob, g, len);
    int d = rank - 2;
    for (; d >= 0; --d) {
      if (++c[d] < box.dim(d).end - box.dim(d).begin) break;
      c[d] = 0;
    }
    if (d < 0) break;
  }
}

// One shard of the old world as written to its writer's file.
struct Piece {
  int tensor = 0;
  int writer = 0;
  Shard shard;
  int64_t file_offset = 0;  // bytes
};

// Every unique shard of the old world, each assigned to the holder with the fewest bytes
// assigned so far (lowest rank on ties), in tensor order, with its offset in that holder's file.
// Every process computes the same plan.
std::vector<Piece> SavePlan(const std::vector<TensorSpec>& model, const ParallelConfig& cfg) {
  std::vector<Piece> plan;
  std::vector<int64_t> load(static_cast<size_t>(cfg.world()), 0);
  for (int t = 0; t < static_cast<int>(model.size()); ++t) {
    std::vector<std::pair<Shard, std::vector<int>>> groups;
    for (int r = 0; r < cfg.world(); ++r) {
      Shard s = ShardOfUnchecked(model[t], cfg, r);
      if (s.empty()) continue;
      auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == s; });
      if (it == groups.end()) {
        groups.push_back({s, {r}});
      } else {
        it->second.push_back(r);
      }
    }
    for (auto& [shard, holders] : groups) {
      int w = *std::min_element(holders.begin(), holders.end(),
                                [&](int a, int b) { return load[a] < load[b]; });
      plan.push_back({t, w, shard, load[w]});
      load[w] += shard.NumElements() * kElem;
    }
  }
  return plan;
}

std::string FileOf(const std::string& dir, int writer) {
  return dir + "/rank" + std::to_string(writer) + ".bin";
}

struct Report {
  int32_t rank = 0;
  int32_t kind = 0;  // 1 ready, 2 done (saved / loaded), 3 verified
  int64_t bytes = 0;
  int32_t ok = 1;
};

Status WriteReport(Report r) {
  if (write(kReportFd, &r, sizeof r) != static_cast<ssize_t>(sizeof r)) {
    return UnavailableError(std::string("report pipe: ") + std::strerror(errno));
  }
  return Status::Ok();
}

// Blocks until the parent releases this worker (one byte on the go pipe), 10 minutes at most.
Status WaitGo() {
  pollfd p{kGoFd, POLLIN, 0};
  int n = poll(&p, 1, static_cast<int>(std::chrono::milliseconds(kPhaseTimeout).count()));
  char c;
  if (n != 1 || read(kGoFd, &c, 1) != 1) return DeadlineExceededError("no go from the parent");
  return Status::Ok();
}

Status WriteAll(int fd, const char* p, int64_t n, const std::string& what) {
  while (n > 0) {
    ssize_t w = write(fd, p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return UnavailableError("write " + what + ": " + std::strerror(errno));
    p += w;
    n -= w;
  }
  return Status::Ok();
}

Status PreadAll(int fd, char* p, int64_t n, int64_t off, const std::string& what) {
  while (n > 0) {
    ssize_t r = pread(fd, p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)), off);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return DataLossError("pread " + what + ": " + (r == 0 ? "short file" : std::strerror(errno)));
    p += r;
    n -= r;
    off += r;
  }
  return Status::Ok();
}

const ReconfigChange* FindChange(const std::string& name) {
  static const std::vector<ReconfigChange> changes = ReconfigChanges();
  for (const auto& c : changes) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

// ---- the workers ----

Status OldWorker(const ReconfigChange& change, uint64_t bytes, const std::string& dir, int rank) {
  std::vector<TensorSpec> model = ReconfigModel(bytes);
  const ParallelConfig& cfg = change.old_config;
  // The training state this rank holds: every shard, filled (untimed).
  std::vector<std::unique_ptr<uint32_t[]>> data(model.size());
  std::vector<Shard> shards(model.size());
  for (size_t t = 0; t < model.size(); ++t) {
    shards[t] = ShardOfUnchecked(model[t], cfg, rank);
    if (shards[t].empty()) continue;
    data[t].reset(new uint32_t[static_cast<size_t>(shards[t].NumElements())]);
    for (const Box& b : ShardBoxes(shards[t])) {
      StridedView v = *ViewOf(shards[t], b);
      ForEachRow(model[t], b, v, v, [&](int64_t off, int64_t, int64_t g, int64_t n) {
        for (int64_t j = 0; j < n; ++j) data[t][off + j] = ValueAt(static_cast<int>(t), g + j);
      });
    }
  }
  std::vector<Piece> mine;
  for (const Piece& p : SavePlan(model, cfg)) {
    if (p.writer == rank) mine.push_back(p);
  }
  MORPH_RETURN_IF_ERROR(WriteReport({rank, 1, 0, 1}));
  MORPH_RETURN_IF_ERROR(WaitGo());
  int64_t written = 0;
  if (!mine.empty()) {
    std::string path = FileOf(dir, rank);
    int fd = open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return UnavailableError("open " + path + ": " + std::strerror(errno));
    for (const Piece& p : mine) {
      int64_t n = p.shard.NumElements() * kElem;
      MORPH_RETURN_IF_ERROR(
          WriteAll(fd, reinterpret_cast<const char*>(data[p.tensor].get()), n, path));
      written += n;
    }
    if (fsync(fd) != 0) return UnavailableError("fsync " + path + ": " + std::strerror(errno));
    close(fd);
  }
  return WriteReport({rank, 2, written, 1});
}

Status NewWorker(const ReconfigChange& change, uint64_t bytes, const std::string& dir, int rank) {
  std::vector<TensorSpec> model = ReconfigModel(bytes);
  const ParallelConfig& cfg = change.new_config;
  std::vector<Piece> plan = SavePlan(model, change.old_config);
  std::vector<std::unique_ptr<uint32_t[]>> data(model.size());
  std::vector<Shard> shards(model.size());
  struct Read {
    int writer;
    int tensor;
    int64_t file_off, dst_off, len;  // bytes, elements, elements
  };
  std::vector<Read> reads;
  for (size_t t = 0; t < model.size(); ++t) {
    shards[t] = ShardOfUnchecked(model[t], cfg, rank);
    if (shards[t].empty()) continue;
    data[t].reset(new uint32_t[static_cast<size_t>(shards[t].NumElements())]);
    for (const Piece& p : plan) {
      if (p.tensor != static_cast<int>(t)) continue;
      for (const Box& b : ShardBoxes(shards[t])) {
        for (const Box& c : IntersectShard(p.shard, b)) {
          StridedView src = *ViewOf(p.shard, c), dst = *ViewOf(shards[t], c);
          ForEachRow(model[t], c, src, dst, [&](int64_t so, int64_t d, int64_t, int64_t n) {
            int64_t fo = p.file_offset + so * kElem;
            if (!reads.empty()) {  // coalesce runs contiguous on both sides
              Read& last = reads.back();
              if (last.writer == p.writer && last.tensor == static_cast<int>(t) &&
                  last.file_off + last.len * kElem == fo && last.dst_off + last.len == d) {
                last.len += n;
                return;
              }
            }
            reads.push_back({p.writer, static_cast<int>(t), fo, d, n});
          });
        }
      }
    }
  }
  std::map<int, int> fds;
  for (const Read& r : reads) {
    if (fds.contains(r.writer)) continue;
    std::string path = FileOf(dir, r.writer);
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return UnavailableError("open " + path + ": " + std::strerror(errno));
    fds[r.writer] = fd;
  }
  MORPH_RETURN_IF_ERROR(WriteReport({rank, 1, 0, 1}));
  MORPH_RETURN_IF_ERROR(WaitGo());
  int64_t read_bytes = 0;
  for (const Read& r : reads) {
    MORPH_RETURN_IF_ERROR(PreadAll(fds[r.writer],
                                   reinterpret_cast<char*>(data[r.tensor].get() + r.dst_off),
                                   r.len * kElem, r.file_off, FileOf(dir, r.writer)));
    read_bytes += r.len * kElem;
  }
  MORPH_RETURN_IF_ERROR(WriteReport({rank, 2, read_bytes, 1}));
  for (auto& [w, fd] : fds) close(fd);
  // Untimed: every element of every new shard is the expected one.
  int64_t wrong = 0;
  for (size_t t = 0; t < model.size(); ++t) {
    if (shards[t].empty()) continue;
    for (const Box& b : ShardBoxes(shards[t])) {
      StridedView v = *ViewOf(shards[t], b);
      ForEachRow(model[t], b, v, v, [&](int64_t off, int64_t, int64_t g, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          wrong += data[t][off + j] != ValueAt(static_cast<int>(t), g + j);
        }
      });
    }
  }
  if (wrong != 0) {
    std::fprintf(stderr, "restart_baseline: rank %d: %lld wrong elements\n", rank,
                 static_cast<long long>(wrong));
  }
  return WriteReport({rank, 3, 0, wrong == 0 ? 1 : 0});
}

// ---- the parent ----

class World {
 public:
  // Starts `n` workers: this binary, exec'd afresh, with the go and report pipes at fds 3, 4.
  Status Start(const std::vector<std::string>& args, int n) {
    int go[2], rep[2];
    if (pipe2(go, O_CLOEXEC) != 0 || pipe2(rep, O_CLOEXEC) != 0) {
      return UnavailableError(std::string("pipe2: ") + std::strerror(errno));
    }
    go_ = go[1];
    report_ = rep[0];
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> a = args;
      a.push_back("--rank=" + std::to_string(r));
      pid_t pid = fork();
      if (pid < 0) return UnavailableError(std::string("fork: ") + std::strerror(errno));
      if (pid == 0) {
        // Through fds above the target ones, so that neither dup2 clobbers the other's source
        // and both targets lose O_CLOEXEC.
        int g = fcntl(go[0], F_DUPFD, 10), w = fcntl(rep[1], F_DUPFD, 10);
        if (g < 0 || w < 0 || dup2(g, kGoFd) < 0 || dup2(w, kReportFd) < 0) _exit(126);
        std::vector<char*> argv;
        for (auto& s : a) argv.push_back(s.data());
        argv.push_back(nullptr);
        execv("/proc/self/exe", argv.data());
        _exit(127);
      }
      pids_.push_back(pid);
    }
    close(go[0]);
    close(rep[1]);
    return Status::Ok();
  }

  // Waits for one report of `kind` from every worker; `bytes` sums theirs. Reports of a later
  // kind that arrive meanwhile (a fast worker) are kept for the next call.
  Status Collect(int kind, int64_t* bytes, bool* all_ok) {
    auto deadline = Clock::now() + kPhaseTimeout;
    while (count_[kind] < static_cast<int>(pids_.size())) {
      if (Clock::now() > deadline) return DeadlineExceededError("workers did not report in time");
      pollfd p{report_, POLLIN, 0};
      int n = poll(&p, 1, 100);
      if (n == 1) {
        Report r;
        ssize_t k = read(report_, &r, sizeof r);
        if (k == 0) return UnavailableError("every worker exited before reporting");
        if (k != static_cast<ssize_t>(sizeof r) || r.kind < 1 || r.kind > 3) {
          return InternalError("malformed report");
        }
        ++count_[r.kind];
        bytes_[r.kind] += r.bytes;
        ok_[r.kind] = ok_[r.kind] && r.ok;
        continue;
      }
      MORPH_RETURN_IF_ERROR(CheckAlive());
    }
    if (bytes) *bytes += bytes_[kind];
    if (all_ok) *all_ok = *all_ok && ok_[kind];
    return Status::Ok();
  }

  Status Go() {
    std::string bytes(pids_.size(), 'g');
    if (write(go_, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) {
      return UnavailableError(std::string("go pipe: ") + std::strerror(errno));
    }
    return Status::Ok();
  }

  // Reaps every worker (each exits right after its last report).
  Status Join() {
    auto deadline = Clock::now() + std::chrono::seconds(60);
    for (pid_t& pid : pids_) {
      while (pid > 0) {
        int st = 0;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) {
          pid = 0;
          if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return InternalError("a worker failed");
        } else if (Clock::now() > deadline) {
          return DeadlineExceededError("a worker did not exit");
        } else {
          usleep(200);
        }
      }
    }
    Close();
    return Status::Ok();
  }

  ~World() {
    for (pid_t pid : pids_) {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
    Close();
  }

 private:
  Status CheckAlive() {
    for (pid_t& pid : pids_) {
      int st = 0;
      if (pid > 0 && waitpid(pid, &st, WNOHANG) == pid) {
        pid = 0;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
          return InternalError("a worker died (status " + std::to_string(st) + ")");
        }
      }
    }
    return Status::Ok();
  }
  void Close() {
    if (go_ >= 0) close(go_);
    if (report_ >= 0) close(report_);
    go_ = report_ = -1;
  }

  std::vector<pid_t> pids_;
  int go_ = -1, report_ = -1;
  int count_[4] = {};
  int64_t bytes_[4] = {};
  bool ok_[4] = {true, true, true, true};
};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

Status RunChange(const ReconfigChange& c, uint64_t bytes, const std::string& base_dir) {
  const std::string dir = base_dir + "/" + c.name;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir, ec);
  if (ec) return UnavailableError("create " + dir + ": " + ec.message());
  std::vector<std::string> common = {"restart_baseline_bench", "--change=" + c.name,
                                     "--bytes=" + std::to_string(bytes), "--dir=" + dir};
  std::vector<TensorSpec> model = ReconfigModel(bytes);
  int64_t unique = 0;
  for (const TensorSpec& t : model) unique += TensorBytes(t);

  auto old_world = std::make_unique<World>();
  std::vector<std::string> a = common;
  a.push_back("--worker=old");
  MORPH_RETURN_IF_ERROR(old_world->Start(a, c.old_config.world()));
  MORPH_RETURN_IF_ERROR(old_world->Collect(1, nullptr, nullptr));
  const auto t0 = Clock::now();
  MORPH_RETURN_IF_ERROR(old_world->Go());
  int64_t written = 0;
  MORPH_RETURN_IF_ERROR(old_world->Collect(2, &written, nullptr));
  int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  const auto t1 = Clock::now();
  MORPH_RETURN_IF_ERROR(old_world->Join());
  old_world.reset();

  World new_world;
  a = common;
  a.push_back("--worker=new");
  MORPH_RETURN_IF_ERROR(new_world.Start(a, c.new_config.world()));
  MORPH_RETURN_IF_ERROR(new_world.Collect(1, nullptr, nullptr));
  const auto t2 = Clock::now();
  MORPH_RETURN_IF_ERROR(new_world.Go());
  int64_t read_bytes = 0;
  MORPH_RETURN_IF_ERROR(new_world.Collect(2, &read_bytes, nullptr));
  const auto t3 = Clock::now();
  bool ok = true;
  MORPH_RETURN_IF_ERROR(new_world.Collect(3, nullptr, &ok));
  MORPH_RETURN_IF_ERROR(new_world.Join());
  std::filesystem::remove_all(dir, ec);
  std::printf(
      "{\"name\":\"restart_baseline/%s\",\"change\":\"%s\",\"bytes\":%lld,\"bytes_written\":%lld,"
      "\"bytes_read\":%lld,\"old_world\":%d,\"new_world\":%d,\"old_config\":\"%s\","
      "\"new_config\":\"%s\",\"save_s\":%.4f,\"restart_s\":%.4f,\"load_s\":%.4f,"
      "\"seconds\":%.4f,\"verified\":%s}\n",
      c.name.c_str(), c.name.c_str(), static_cast<long long>(unique),
      static_cast<long long>(written), static_cast<long long>(read_bytes), c.old_config.world(),
      c.new_config.world(), c.old_config.ToString().c_str(), c.new_config.ToString().c_str(),
      Seconds(t1 - t0), Seconds(t2 - t1), Seconds(t3 - t2), Seconds(t3 - t0),
      ok ? "true" : "false");
  std::fflush(stdout);
  if (!ok) return DataLossError(c.name + ": a new rank loaded wrong bytes");
  return Status::Ok();
}

// The model and both worlds' shards as JSON, for dcp_reconfig.py (every shard of this model
// is one box: ZeRO ranges are whole rows).
StatusOr<std::string> LayoutJson(const ReconfigChange& c, uint64_t bytes) {
  using json = nlohmann::json;
  std::vector<TensorSpec> model = ReconfigModel(bytes);
  json j;
  j["change"] = c.name;
  json tensors = json::array();
  int64_t unique = 0;
  for (const TensorSpec& t : model) {
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"layer", t.layout.layer()},
                       {"tp_dim", t.layout.tp_dim()},
                       {"zero", t.layout.zero_sharded()}});
    unique += TensorBytes(t);
  }
  j["bytes"] = unique;
  j["tensors"] = std::move(tensors);
  for (const auto& [key, cfg] : {std::pair{"old", &c.old_config}, {"new", &c.new_config}}) {
    MORPH_RETURN_IF_ERROR(cfg->Validate());
    json w;
    w["dp"] = cfg->dp;
    w["tp"] = cfg->tp;
    w["pp"] = cfg->pp;
    w["stage_of_layer"] = cfg->stage_of_layer;
    json ranks = json::array();
    for (int r = 0; r < cfg->world(); ++r) {
      json shards = json::array();
      for (size_t t = 0; t < model.size(); ++t) {
        MORPH_ASSIGN_OR_RETURN(Shard s, ShardOf(model[t], *cfg, r));
        if (s.empty()) continue;
        std::vector<Box> boxes = ShardBoxes(s);
        if (boxes.size() != 1) {
          return InternalError(model[t].name + ": shard " + s.ToString() + " is not one box");
        }
        json box = json::array();
        for (const Interval& i : boxes[0].dims()) box.push_back({i.begin, i.end});
        shards.push_back({{"tensor", t}, {"box", std::move(box)}});
      }
      ranks.push_back(std::move(shards));
    }
    w["ranks"] = std::move(ranks);
    j[key] = std::move(w);
  }
  return j.dump();
}

int Main(int argc, char** argv) {
  uint64_t bytes = 1ull << 30;
  std::string changes = "dp4to2,dp2to4,tp2to1,pp2to1", dir = "build/bench-tmp/restart_baseline";
  std::string worker, change, print_layout;
  int rank = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      size_t n = std::strlen(flag);
      return a.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--bytes=")) {
      StatusOr<uint64_t> b = params::ParseBytes("--bytes", v);
      if (!b.ok()) {
        std::fprintf(stderr, "%s\n", b.status().ToString().c_str());
        return 2;
      }
      bytes = *b;
    } else if (const char* v = value("--changes=")) {
      changes = v;
    } else if (const char* v = value("--dir=")) {
      dir = v;
    } else if (const char* v = value("--worker=")) {
      worker = v;
    } else if (const char* v = value("--change=")) {
      change = v;
    } else if (const char* v = value("--rank=")) {
      rank = std::atoi(v);
    } else if (const char* v = value("--print-layout=")) {
      print_layout = v;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--bytes=1GiB] [--changes=dp4to2,dp2to4,tp2to1,pp2to1] "
                   "[--dir=DIR] | --print-layout=CHANGE [--bytes=...]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!print_layout.empty()) {
    const ReconfigChange* c = FindChange(print_layout);
    if (c == nullptr) {
      std::fprintf(stderr, "unknown change %s\n", print_layout.c_str());
      return 2;
    }
    StatusOr<std::string> j = LayoutJson(*c, bytes);
    if (!j.ok()) {
      std::fprintf(stderr, "%s\n", j.status().ToString().c_str());
      return 1;
    }
    std::printf("%s\n", j->c_str());
    return 0;
  }
  if (!worker.empty()) {
    const ReconfigChange* c = FindChange(change);
    if (c == nullptr || rank < 0) return 2;
    Status s = worker == "old" ? OldWorker(*c, bytes, dir, rank) : NewWorker(*c, bytes, dir, rank);
    if (!s.ok()) {
      std::fprintf(stderr, "restart_baseline %s rank %d: %s\n", worker.c_str(), rank,
                   s.ToString().c_str());
      return 1;
    }
    return 0;
  }
  signal(SIGPIPE, SIG_IGN);
  int rc = 0;
  size_t pos = 0;
  while (pos <= changes.size()) {
    size_t comma = changes.find(',', pos);
    std::string name = changes.substr(pos, comma == std::string::npos ? comma : comma - pos);
    pos = comma == std::string::npos ? changes.size() + 1 : comma + 1;
    if (name.empty()) continue;
    const ReconfigChange* c = FindChange(name);
    if (c == nullptr) {
      std::fprintf(stderr, "unknown change %s\n", name.c_str());
      return 2;
    }
    Status s = RunChange(*c, bytes, dir);
    if (!s.ok()) {
      std::fprintf(stderr, "restart_baseline %s: %s\n", name.c_str(), s.ToString().c_str());
      rc = 1;
    }
  }
  return rc;
}

}  // namespace
}  // namespace morph::bench

int main(int argc, char** argv) { return morph::bench::Main(argc, argv); }
