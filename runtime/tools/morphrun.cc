// morphrun: runs an elastic job on this machine, or inside a Slurm allocation with one job step
// per worker (docs/operations.md "morphrun" and "Slurm").
//
//   morphrun -n 4 [--max 8] [--log-dir DIR] [--port P] [--api-port P] [--etcd H:P,...]
//            [--config N=dpAtpBppC]... -- ./train args...
//   morphrun --slurm -n 4 [--max 8] [--token-file F] [--srun-arg A]... -- ./train args...
//
// --config N=dpAtpBppC pins the config for a world of exactly N workers (config_pins.h); the
// planner decides the other sizes.
// Hosts the coordinator (its scheduler API on 127.0.0.1:<api-port>, the token in MORPH_TOKEN or
// MORPH_TOKEN_FILE, or generated), starts the workers (the token in a 0600 file their
// MORPH_TOKEN_FILE names, removed at exit; worker logs under --log-dir are 0600), starts joiners
// on grow requests, reaps leavers, forwards
// SIGINT/SIGTERM to the workers (a preemption notice for each) and exits with the job's status:
// 0 when it completed (workers killed by a signal were failures it survived) or a forwarded
// SIGTERM stopped it as asked, 130 when a forwarded SIGINT (Ctrl-C) did, a worker's exit code
// in 1..127, 1 when it failed without one, 128 + the signal when a forwarded signal ended it
// otherwise, 2 for a usage error (a --log-dir it cannot create included).
//
// --etcd (or MORPH_ETCD): coordinator failover with candidates hosted by the workers
// (docs/operations.md "Coordinator failover"): morphrun hosts no coordinator; its first
// MORPH_ETCD_CANDIDATES workers host candidates, the scheduler API is the leader's (the
// <prefix>/leader key names it), and the joiners a grow asks for come from morphrun as before.
//
// --slurm (in an sbatch script or salloc): each worker is `srun -N1 -n1 --exact
// --kill-on-bad-exit=0 -J morph-<index> [--srun-arg...] PROGRAM`, its own step, so the scheduler
// can signal or lose one worker (scancel --signal=TERM JOB.STEP); grow requests start new steps
// in the allocation (a forwarded SIGTERM reaches srun, which cancels its step: not a graceful
// leave). The coordinator binds MORPH_COORDINATOR_ADDR (default 0.0.0.0) and workers
// dial this host's name (or MORPH_COORDINATOR_ADVERTISE); they read the token from a 0600 file
// (--token-file, default $SLURM_SUBMIT_DIR/.morph-token-$SLURM_JOB_ID, removed at exit), which
// must be readable on every node.
#include <glog/logging.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "base/params.h"
#include "collectives/store/tcp_store.h"
#include "runtime/tools/config_pins.h"
#include "runtime/tools/launcher.h"

namespace {

std::atomic<int> g_signal{0};
void OnSignal(int sig) { g_signal.store(sig); }

int Usage(const std::string& why) {
  std::cerr << "morphrun: " << why << "\n"
            << "usage: morphrun -n N [--max M] [--log-dir DIR] [--port P] [--api-port P] "
               "[--etcd HOST:PORT,...] [--config N=dpAtpBppC]... -- PROGRAM [ARGS...]\n"
            << "       morphrun --slurm -n N [--max M] [--token-file F] [--srun-arg A]... "
               "[options above] -- PROGRAM [ARGS...]\n";
  return 2;
}

bool ParseInt(const std::string& s, int& out, long max = 1 << 20) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != 0 || v < 0 || v > max) return false;
  out = static_cast<int>(v);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  morph::LauncherOptions o;
  int api_port = 0, port = 0;
  int i = 1;
  bool have_n = false, slurm = false;
  std::string slurm_token_file;
  std::vector<std::string> srun_args, pins;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    auto value = [&](int& out, long max = 1 << 20) {
      if (i + 1 >= argc || !ParseInt(argv[i + 1], out, max)) return false;
      ++i;
      return true;
    };
    if (a == "-n" || a == "--workers") {
      if (!value(o.workers) || o.workers < 1) return Usage("-n needs a worker count >= 1");
      have_n = true;
    } else if (a == "--max") {
      if (!value(o.max_workers) || o.max_workers < 1) return Usage("--max needs a count >= 1");
    } else if (a == "--port") {
      if (!value(port, 65535)) return Usage("--port needs a port number (0..65535)");
    } else if (a == "--api-port") {
      if (!value(api_port, 65535)) return Usage("--api-port needs a port number (0..65535)");
    } else if (a == "--log-dir") {
      if (i + 1 >= argc) return Usage("--log-dir needs a directory");
      o.log_dir = argv[++i];
    } else if (a == "--etcd") {
      if (i + 1 >= argc || argv[i + 1][0] == 0) return Usage("--etcd needs host:port,...");
      o.etcd = argv[++i];
    } else if (a == "--slurm") {
      slurm = true;
    } else if (a == "--token-file") {
      if (i + 1 >= argc || argv[i + 1][0] == 0) return Usage("--token-file needs a path");
      slurm_token_file = argv[++i];
    } else if (a == "--config") {  // a config pinned for a world size (config_pins.h)
      if (i + 1 >= argc) return Usage("--config needs N=dpAtpBppC");
      pins.push_back(argv[++i]);
    } else if (a == "--srun-arg") {
      if (i + 1 >= argc) return Usage("--srun-arg needs an argument for srun");
      srun_args.push_back(argv[++i]);
    } else {
      return Usage("unknown option '" + a + "' (the program follows --)");
    }
  }
  if (!have_n) return Usage("-n N is required");
  if (i >= argc) return Usage("no program given after --");
  if (o.max_workers < o.workers) return Usage("--max is below -n");
  for (; i < argc; ++i) o.argv.push_back(argv[i]);
  if (!pins.empty()) {
    const char* etcd_env = std::getenv("MORPH_ETCD");
    if (!o.etcd.empty() || (etcd_env != nullptr && *etcd_env != 0)) {
      return Usage("--config pins morphrun's own coordinator's configs; with etcd the workers "
                   "host the coordinator candidates");
    }
    auto parsed = morph::ParseConfigPins(pins);
    if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
    o.coordinator.policy = parsed->Policy();
  }
  if (!slurm && (!slurm_token_file.empty() || !srun_args.empty())) {
    return Usage("--token-file and --srun-arg go with --slurm");
  }
  if (slurm) {
    const char* job = std::getenv("SLURM_JOB_ID");
    if (job == nullptr || *job == 0) {
      return Usage("--slurm runs inside a Slurm allocation (sbatch or salloc): SLURM_JOB_ID is "
                   "not set");
    }
    if (slurm_token_file.empty()) {
      const char* submit = std::getenv("SLURM_SUBMIT_DIR");
      slurm_token_file = std::string(submit && *submit ? submit : ".") + "/.morph-token-" + job;
    }
    o.token_file = slurm_token_file;
    o.wrapper = {"srun", "-N1", "-n1", "--exact", "--kill-on-bad-exit=0", "-J", "morph-{index}"};
    o.wrapper.insert(o.wrapper.end(), srun_args.begin(), srun_args.end());
    // Workers on other nodes dial this one: bind every interface unless told, advertise this
    // host's name (the coordinator's default for 0.0.0.0) unless told.
    const char* bind = std::getenv("MORPH_COORDINATOR_ADDR");
    o.coordinator.address = bind && *bind ? bind : "0.0.0.0";
    const char* advertise = std::getenv("MORPH_COORDINATOR_ADVERTISE");
    if (advertise && *advertise) o.coordinator.advertise_host = advertise;
  }

  auto http = morph::HttpServerOptions::FromEnv();
  if (!http.ok()) return Usage(std::string(http.status().message()));
  o.coordinator.http = *http;
  if (api_port) o.coordinator.http.port = static_cast<uint16_t>(api_port);
  o.coordinator.port = static_cast<uint16_t>(port);
  auto heartbeat_timeout = morph::params::HeartbeatTimeoutMs();
  if (!heartbeat_timeout.ok()) return Usage(std::string(heartbeat_timeout.status().message()));
  o.coordinator.heartbeat_timeout_ms = *heartbeat_timeout;
  auto local_watch = morph::params::LocalWatchMs();
  if (!local_watch.ok()) return Usage(std::string(local_watch.status().message()));
  o.coordinator.local_watch_ms = *local_watch;
  auto max_unauthenticated = morph::params::CoordinatorMaxUnauthenticated();
  if (!max_unauthenticated.ok()) return Usage(std::string(max_unauthenticated.status().message()));
  o.coordinator.max_unauthenticated = *max_unauthenticated;
  auto token = morph::params::Token();
  auto token_file = morph::params::TokenFile();
  if (token.ok() && token_file.ok() && (!token->empty() || !token_file->empty())) {
    auto t = morph::JobTokenFromEnv();
    if (!t.ok()) return Usage(std::string(t.status().message()));
    o.coordinator.token = *t;
  }

  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  auto launcher = morph::Launcher::Start(std::move(o));
  if (!launcher.ok()) {
    if (launcher.status().code() == morph::StatusCode::kInvalidArgument) {
      return Usage(std::string(launcher.status().message()));
    }
    std::cerr << "morphrun: " << launcher.status() << "\n";
    return 1;
  }
  if ((*launcher)->hosts_coordinator()) {
    morph::Coordinator& c = (*launcher)->coordinator();
    // The token file's path (never the token): what morphctl needs, as MORPH_TOKEN_FILE.
    std::cerr << "morphrun: coordinator " << c.control_address() << ", scheduler API 127.0.0.1:"
              << c.http_port() << ", token file " << (*launcher)->token_file() << std::endl;
  } else {
    std::cerr << "morphrun: coordinator candidates hosted by the first workers, etcd prefix "
              << (*launcher)->etcd_prefix() << " (the leader and its scheduler API: "
              << (*launcher)->etcd_prefix() << "/leader)" << std::endl;
  }
  int forwarded = 0;  // the first signal forwarded
  while (true) {
    int sig = g_signal.exchange(0);
    if (sig != 0) {
      LOG(INFO) << "morphrun: forwarding signal " << sig << " to the workers";
      (*launcher)->Signal(SIGTERM);
      if (forwarded == 0) forwarded = sig;
    }
    auto code = (*launcher)->Wait(morph::Deadline::AfterMs(100));
    if (code.ok()) {
      if (forwarded == 0) return *code;
      // Interrupted: the workers' status is the signal's doing, not theirs (as a shell reports
      // an interrupted job), unless the job completed anyway. A job that stopped as asked is
      // 0 after SIGTERM (a preemption, docs/operations.md "Preemption") and 130 after SIGINT
      // (Ctrl-C: interrupted before it completed).
      if (*code != 0) return 128 + forwarded;
      return (*launcher)->stopped_as_asked() && forwarded == SIGINT ? 128 + SIGINT : 0;
    }
    if (code.status().code() != morph::StatusCode::kDeadlineExceeded) {
      std::cerr << "morphrun: " << code.status() << "\n";
      return 1;
    }
  }
}
