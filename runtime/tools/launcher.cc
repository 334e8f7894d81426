#include "runtime/tools/launcher.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "runtime/api/bootstrap.h"
#include "runtime/ha/election.h"
#include "runtime/coordinator/decider.h"

extern char** environ;

namespace morph {

namespace {

// A launch request's key after the launch prefix: "<id>-<n>", letters and digits, no "/".
bool IsLaunchRequestKey(std::string_view rest) {
  const size_t dash = rest.rfind('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == rest.size()) return false;
  for (size_t i = 0; i < rest.size(); ++i) {
    const char c = rest[i];
    const bool ok = i == dash ? true : i < dash ? std::isalnum(static_cast<unsigned char>(c))
                                                : std::isdigit(static_cast<unsigned char>(c));
    if (!ok) return false;
  }
  return true;
}

// The --log-dir folder: made if missing (0700, as its files are 0600), and writable.
Status MakeLogDir(const std::string& dir) {
  std::error_code ec;
  const bool made = std::filesystem::create_directories(dir, ec);
  if (ec) {
    return InvalidArgumentError("--log-dir " + dir + ": cannot create it: " + ec.message());
  }
  if (made) {
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return InvalidArgumentError("--log-dir " + dir + ": not a directory");
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return InvalidArgumentError("--log-dir " + dir + ": not writable: " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Launcher>> Launcher::Start(LauncherOptions options) {
  if (options.argv.empty()) return InvalidArgumentError("no worker program given");
  if (options.workers < 1) {
    return InvalidArgumentError("workers: must be at least 1, got " +
                                std::to_string(options.workers));
  }
  if (!options.log_dir.empty()) {
    MORPH_RETURN_IF_ERROR(MakeLogDir(options.log_dir));
  }
  std::unique_ptr<Launcher> l(new Launcher());
  l->options_ = std::move(options);
  CoordinatorOptions& c = l->options_.coordinator;
  if (c.token.empty()) {
    MORPH_ASSIGN_OR_RETURN(c.token, RandomToken());
  }
  c.http.token = c.token;
  // The workers' checkpoint folder (their environment: the launcher's, plus `env`) is where a
  // recovery finds the newest complete checkpoint.
  if (c.checkpoint_dir.empty()) {
    auto it = l->options_.env.find("MORPH_CHECKPOINT_DIR");
    if (it != l->options_.env.end()) {
      c.checkpoint_dir = it->second;
    } else if (const char* d = std::getenv("MORPH_CHECKPOINT_DIR")) {
      c.checkpoint_dir = d;
    }
  }
  // So are resume at start (MORPH_RESUME, default auto) and the scheduler's restart count.
  const auto worker_env = [&](const std::string& name) -> const char* {
    auto it = l->options_.env.find(name);
    return it != l->options_.env.end() ? it->second.c_str() : std::getenv(name.c_str());
  };
  if (!c.resume) {
    const char* mode = worker_env("MORPH_RESUME");
    MORPH_ASSIGN_OR_RETURN(c.resume, ParseResumeMode(mode && *mode ? mode : "auto"));
    MORPH_ASSIGN_OR_RETURN(c.restart_count, ParseRestartCount(worker_env("SLURM_RESTART_COUNT")));
  }
  c.initial_world = l->options_.workers;
  c.max_world = l->options_.max_workers;
  if (l->options_.etcd.empty()) {
    const char* e = worker_env("MORPH_ETCD");
    if (e != nullptr) l->options_.etcd = e;
  }
  if (!l->options_.etcd.empty()) {
    MORPH_ASSIGN_OR_RETURN(EtcdOptions eo, EtcdOptions::Parse(l->options_.etcd, "MORPH_ETCD"));
    l->etcd_ = std::make_unique<EtcdClient>(eo);
    std::string& prefix = l->options_.etcd_prefix;
    if (prefix.empty()) {
      const char* p = worker_env("MORPH_ETCD_PREFIX");
      if (p != nullptr && *p != 0) {
        prefix = p;
      } else {
        // A fresh prefix per launch: never an earlier job's saved state.
        MORPH_ASSIGN_OR_RETURN(std::string id, RandomToken());
        prefix = "/morph/morphrun-" + id.substr(0, 12);
        l->own_prefix_ = true;
      }
    }
    MORPH_RETURN_IF_ERROR(ValidateJobPrefix(prefix, "MORPH_ETCD_PREFIX"));
  }
  if (l->options_.token_file.empty()) {
    // A folder of its own (0700): nobody can read the file, or put one in its place first.
    std::error_code ec;
    std::string dir = (std::filesystem::temp_directory_path(ec) / "morphrun-XXXXXX").string();
    if (::mkdtemp(dir.data()) == nullptr) {
      return FailedPreconditionError("token file: cannot create a private folder " + dir + ": " +
                                     std::strerror(errno));
    }
    l->private_dir_ = dir;
    l->options_.token_file = dir + "/token";
  }
  MORPH_RETURN_IF_ERROR(WritePrivateFile(l->options_.token_file, c.token + "\n", "token file"));
  Launcher* raw = l.get();
  if (l->etcd_) {
    // The workers host the coordinator's candidates; this process only launches.
    LOG(INFO) << "morphrun: coordinator failover on etcd " << l->options_.etcd << ", prefix "
              << l->options_.etcd_prefix << ": the first workers host coordinator candidates";
    for (int i = 0; i < l->options_.workers; ++i) MORPH_RETURN_IF_ERROR(l->SpawnOne());
    l->watcher_ = std::thread([raw] { raw->Watch(); });
    return l;
  }
  c.launch_workers = [raw](int count) {
    int n = raw->Spawn(count);
    LOG(INFO) << "morphrun: started " << n << " of " << count << " requested worker(s)";
  };
  MORPH_ASSIGN_OR_RETURN(l->coordinator_, Coordinator::Start(c));
  for (int i = 0; i < l->options_.workers; ++i) MORPH_RETURN_IF_ERROR(l->SpawnOne());
  return l;
}

void Launcher::Watch() {
  const std::string launch = LaunchKeyPrefix(options_.etcd_prefix);
  for (int tick = 0; !stopping_.load(); ++tick) {
    StatusOr<std::vector<EtcdKv>> asks = etcd_->GetPrefix(launch);
    if (asks.ok()) {
      for (const EtcdKv& kv : *asks) {
        // Only what a leader of this job writes (bootstrap.cc: <launch>/<id>-<n>); anything
        // else under it is not this launcher's to read or delete.
        if (!IsLaunchRequestKey(std::string_view(kv.key).substr(launch.size()))) continue;
        // Deleted first: a request is carried out once (a failed delete is tried again).
        if (!etcd_->Delete(kv.key).ok()) continue;
        char* end = nullptr;
        const long count = std::strtol(kv.value.c_str(), &end, 10);
        if (end == kv.value.c_str() || *end != 0 || count < 1 || count > options_.max_workers) {
          LOG(WARNING) << "morphrun: ignoring launch request " << kv.key << " = '" << kv.value
                       << "'";
          continue;
        }
        int n = Spawn(static_cast<int>(count));
        LOG(INFO) << "morphrun: started " << n << " of " << count << " requested worker(s)";
      }
    }
    if (tick % 2 == 0) {
      std::optional<Status> outcome = OutcomeFromEtcd();
      if (outcome) {
        std::lock_guard<std::mutex> l(mu_);
        etcd_outcome_ = *outcome;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::optional<Status> Launcher::OutcomeFromEtcd() {
  StatusOr<std::optional<EtcdKv>> got = etcd_->Get(options_.etcd_prefix + "/state");
  if (!got.ok() || !got->has_value()) return std::nullopt;
  nlohmann::json j = nlohmann::json::parse((*got)->value, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("decider") || !j["decider"].is_string()) return std::nullopt;
  Decider d{DeciderOptions{}};
  if (!d.Load(j["decider"].get<std::string>()).ok()) return std::nullopt;
  switch (d.phase()) {
    case Decider::Phase::kComplete:
      return Status::Ok();
    case Decider::Phase::kStopped:
      return CancelledError("the job stopped: every worker was asked to leave");
    case Decider::Phase::kFailed:
      return FailedPreconditionError("the job failed (its coordinator's log says why)");
    default:
      return std::nullopt;
  }
}

Launcher::~Launcher() {
  stopping_ = true;
  if (watcher_.joinable()) watcher_.join();
  Reap();
  Signal(SIGTERM);
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.kill_grace_ms);
  while (std::chrono::steady_clock::now() < until) {
    Reap();
    bool any = false;
    for (const ChildInfo& c : children()) any |= c.running;
    if (!any) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Signal(SIGKILL);
  for (const ChildInfo& c : children()) {
    if (c.running) waitpid(c.pid, nullptr, 0);
  }
  if (coordinator_) coordinator_->Stop();
  if (etcd_ && own_prefix_) {
    // Every worker is gone: nobody reads the job's keys any more. Exactly the job's keys.
    Status s = etcd_->DeletePrefix(LaunchKeyPrefix(options_.etcd_prefix));
    for (const char* key : {"/leader", "/state"}) {
      if (s.ok()) s = etcd_->Delete(options_.etcd_prefix + key);
    }
    if (!s.ok()) LOG(WARNING) << "morphrun: the job's keys stay in etcd: " << s;
  }
  if (!options_.token_file.empty()) unlink(options_.token_file.c_str());
  if (!private_dir_.empty()) rmdir(private_dir_.c_str());
}

Status Launcher::SpawnOne() {
  // The launcher's own: where the coordinator is and where the token is (never the token).
  std::map<std::string, std::string> mine = {{"MORPH_TOKEN_FILE", options_.token_file}};
  if (etcd_) {
    mine["MORPH_ETCD"] = options_.etcd;
    mine["MORPH_ETCD_PREFIX"] = options_.etcd_prefix;
    mine["MORPH_INITIAL_WORLD"] = std::to_string(options_.workers);
    mine["MORPH_MAX_WORLD"] = std::to_string(options_.max_workers);
    const CoordinatorOptions& c = options_.coordinator;
    if (c.port) mine["MORPH_COORDINATOR_PORT"] = std::to_string(c.port);
    if (c.http.port) mine["MORPH_API_PORT"] = std::to_string(c.http.port);
  } else {
    mine["MORPH_COORDINATOR"] = coordinator_->control_address();
  }
  const auto ours = [&](const std::string& key) {
    return key == "MORPH_COORDINATOR" || key == "MORPH_TOKEN" || mine.count(key) > 0;
  };
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    if (ours(key) || options_.env.count(key)) continue;
    env_strings.push_back(std::move(kv));
  }
  for (const auto& [k, v] : options_.env) {
    if (!ours(k)) env_strings.push_back(k + "=" + v);
  }
  for (const auto& [k, v] : mine) env_strings.push_back(k + "=" + v);
  // One spawn at a time (the coordinator's launcher thread and Start's), so indexes are unique.
  std::lock_guard<std::mutex> spawning(spawn_mu_);
  int index;
  {
    std::lock_guard<std::mutex> l(mu_);
    index = static_cast<int>(children_.size());
  }
  env_strings.push_back("MORPH_LAUNCH_INDEX=" + std::to_string(index));
  std::string log_path;
  if (!options_.log_dir.empty()) {
    log_path = options_.log_dir + "/worker-" + std::to_string(index) + ".log";
  }
  // Everything the child needs is built before fork (no allocation after it).
  std::vector<std::string> args;
  for (std::string a : options_.wrapper) {
    for (size_t at = a.find("{index}"); at != std::string::npos; at = a.find("{index}", at)) {
      a.replace(at, 7, std::to_string(index));
    }
    args.push_back(std::move(a));
  }
  args.insert(args.end(), options_.argv.begin(), options_.argv.end());
  std::vector<char*> argv, envp;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return InternalError(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Its own process group, so that a terminal's Ctrl-C reaches morphrun, which forwards it.
    setpgid(0, 0);
    if (!log_path.empty()) {
      // Private, as the token file: a worker's log may say more than the world should read.
      int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd >= 0) {
        (void)fchmod(fd, 0600);  // a file left by an earlier run keeps its mode otherwise
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
    }
    // Nothing of morphrun's but stdin, stdout and stderr: its listening sockets (the control
    // channel, the store, the scheduler API) must not outlive it in a worker, where they would
    // accept connections nobody answers and keep a restarted morphrun from binding its ports.
    close_range(3, ~0U, 0);
    execvpe(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  std::lock_guard<std::mutex> l(mu_);
  children_.push_back(ChildInfo{.index = index, .pid = pid});
  LOG(INFO) << "morphrun: worker " << index << " started (pid " << pid << ")";
  return Status();
}

int Launcher::Spawn(int count) {
  int started = 0;
  for (int i = 0; i < count; ++i) {
    Status s = SpawnOne();
    if (!s.ok()) {
      LOG(ERROR) << "morphrun: " << s;
      break;
    }
    ++started;
  }
  return started;
}

void Launcher::Signal(int sig) {
  std::lock_guard<std::mutex> l(mu_);
  for (const ChildInfo& c : children_) {
    if (c.running) kill(c.pid, sig);
  }
}

std::vector<ChildInfo> Launcher::children() const {
  std::lock_guard<std::mutex> l(mu_);
  return children_;
}

void Launcher::Reap() {
  std::lock_guard<std::mutex> l(mu_);
  for (ChildInfo& c : children_) {
    if (!c.running) continue;
    int status = 0;
    pid_t r = waitpid(c.pid, &status, WNOHANG);
    if (r != c.pid) continue;
    c.running = false;
    c.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    LOG(INFO) << "morphrun: worker " << c.index << " (pid " << c.pid << ") exited with "
              << c.exit_code;
  }
}

StatusOr<int> Launcher::Wait(Deadline deadline) {
  std::optional<Status>& job = job_;
  std::optional<std::chrono::steady_clock::time_point>& all_gone = all_gone_;
  while (true) {
    Reap();
    if (!job && !coordinator_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::lock_guard<std::mutex> l(mu_);
      if (etcd_outcome_) {
        job = etcd_outcome_->code() == StatusCode::kCancelled ? Status::Ok() : *etcd_outcome_;
        stopped_as_asked_ = etcd_outcome_->code() == StatusCode::kCancelled;
        if (etcd_outcome_->ok()) {
          LOG(INFO) << "morphrun: the job completed";
        } else if (job->ok()) {
          LOG(INFO) << "morphrun: " << etcd_outcome_->message();
        } else {
          LOG(ERROR) << "morphrun: " << *job;
        }
      }
    } else if (!job) {
      Status s = coordinator_->Wait(Deadline::AfterMs(20));
      if (s.code() == StatusCode::kCancelled) {
        LOG(INFO) << "morphrun: " << s.message();  // every worker left, as asked
        job = Status::Ok();
        stopped_as_asked_ = true;
      } else if (s.code() != StatusCode::kDeadlineExceeded) {
        job = s;
        if (!s.ok()) LOG(ERROR) << "morphrun: the job failed: " << s;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    bool running = false;
    int first_bad = 0, first_error = 0;  // any non-zero code; a code the worker chose (< 128)
    for (const ChildInfo& c : children()) {
      running |= c.running;
      if (c.running || c.exit_code == 0) continue;
      if (first_bad == 0) first_bad = c.exit_code;
      if (c.exit_code < 128 && first_error == 0) first_error = c.exit_code;
    }
    if (job && !running) {
      if (!job->ok()) return first_bad ? first_bad : 1;
      return first_error;
    }
    // Every worker is gone but the job did not complete: nobody is left to finish it (after a
    // grace period for the last workers' messages to be read).
    if (running) all_gone.reset();  // a joiner started meanwhile
    if (!running && !job) {
      if (!all_gone) all_gone = std::chrono::steady_clock::now();
      if (std::chrono::steady_clock::now() - *all_gone > std::chrono::seconds(2)) {
        LOG(ERROR) << "morphrun: every worker exited but the job did not complete";
        return first_bad ? first_bad : 1;
      }
    }
    if (deadline.Expired()) {
      return DeadlineExceededError("the job did not end in time");
    }
  }
}

}  // namespace morph
