// morphd: a standalone coordinator (docs/operations.md "morphd"). Configured from the
// environment (CoordinatorOptions::FromEnv), flags override. Prints one JSON line on stdout once
// it listens:
//   {"control":"10.0.0.1:29400","store":"10.0.0.1:41235","http_port":8080}
// and runs until the job completes (exit 0), stops because every worker asked to leave (exit
// 0), fails (exit 1), or SIGTERM / SIGINT stops it (exit 0). Bad flags or a failed start: exit 2.
// With --etcd / MORPH_ETCD it is a coordinator candidate (docs/operations.md "Coordinator
// failover"): it prints the line at once, leads once elected and follows meanwhile.
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/logging.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/ha/election.h"

namespace {

int Usage(const char* why = nullptr) {
  if (why) std::fprintf(stderr, "morphd: %s\n", why);
  std::fprintf(stderr,
               "usage: morphd [--address IP] [--port N] [--advertise HOST] [--initial-world N]\n"
               "              [--max-world N] [--heartbeat-timeout-ms N] [--token-file PATH]\n"
               "              [--api-address IP] [--api-port N] [--no-http]\n"
               "              [--etcd HOST:PORT,...] [--etcd-prefix PREFIX]\n"
               "Environment: MORPH_COORDINATOR_ADDR/PORT/ADVERTISE, MORPH_TOKEN(_FILE),\n"
               "MORPH_INITIAL_WORLD, MORPH_MAX_WORLD, MORPH_HEARTBEAT_TIMEOUT_MS, MORPH_API_*,\n"
               "MORPH_STORE_*, MORPH_ETCD, MORPH_ETCD_PREFIX, MORPH_ETCD_TTL_S,\n"
               "MORPH_ETCD_REJOIN_MS; flags override them. With --etcd (MORPH_ETCD) this morphd\n"
               "is one coordinator candidate: it leads when elected, else follows.\n");
  return 2;
}

bool ParseInt(const char* text, long long lo, long long hi, long long* out) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  morph::InitLogging(argv[0]);
  struct Flag {
    std::string value;
    bool set = false;
  };
  Flag address, port, advertise, initial, max_world, hb, token_file, api_address, api_port, etcd,
      etcd_prefix;
  bool no_http = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto take = [&](Flag& f) {
      if (i + 1 >= argc) return false;
      f.value = argv[++i];
      f.set = true;
      return true;
    };
    bool ok = true;
    if (a == "--address") ok = take(address);
    else if (a == "--port") ok = take(port);
    else if (a == "--advertise") ok = take(advertise);
    else if (a == "--initial-world") ok = take(initial);
    else if (a == "--max-world") ok = take(max_world);
    else if (a == "--heartbeat-timeout-ms") ok = take(hb);
    else if (a == "--token-file") ok = take(token_file);
    else if (a == "--api-address") ok = take(api_address);
    else if (a == "--api-port") ok = take(api_port);
    else if (a == "--etcd") ok = take(etcd);
    else if (a == "--etcd-prefix") ok = take(etcd_prefix);
    else if (a == "--no-http") no_http = true;
    else if (a == "-h" || a == "--help") return Usage(), 0;
    else return Usage(("unknown argument '" + a + "'").c_str());
    if (!ok) return Usage((a + " needs a value").c_str());
  }
  // The token file flag wins over the environment's token.
  if (token_file.set) {
    ::unsetenv("MORPH_TOKEN");
    ::setenv("MORPH_TOKEN_FILE", token_file.value.c_str(), 1);
  }
  morph::StatusOr<morph::CoordinatorOptions> env = morph::CoordinatorOptions::FromEnv();
  if (!env.ok()) {
    std::fprintf(stderr, "morphd: %s\n", env.status().ToString().c_str());
    return 2;
  }
  morph::CoordinatorOptions o = *std::move(env);
  long long v = 0;
  if (address.set) o.address = address.value;
  if (advertise.set) o.advertise_host = advertise.value;
  if (port.set) {
    if (!ParseInt(port.value.c_str(), 0, 65535, &v)) return Usage("--port: not in [0, 65535]");
    o.port = static_cast<uint16_t>(v);
  }
  if (max_world.set) {
    if (!ParseInt(max_world.value.c_str(), 1, 1 << 20, &v)) {
      return Usage("--max-world: not in [1, 1048576]");
    }
    o.max_world = static_cast<int>(v);
  }
  if (initial.set) {
    if (!ParseInt(initial.value.c_str(), 1, o.max_world, &v)) {
      return Usage("--initial-world: not in [1, max world]");
    }
    o.initial_world = static_cast<int>(v);
  }
  if (hb.set) {
    if (!ParseInt(hb.value.c_str(), 0, 3600000, &v)) {
      return Usage("--heartbeat-timeout-ms: not in [0, 3600000]");
    }
    o.heartbeat_timeout_ms = v;
  }
  if (api_address.set) o.http.address = api_address.value;
  if (api_port.set) {
    if (!ParseInt(api_port.value.c_str(), 0, 65535, &v)) {
      return Usage("--api-port: not in [0, 65535]");
    }
    o.http.port = static_cast<uint16_t>(v);
  }
  if (no_http) o.serve_http = false;
  if (etcd.set) {
    morph::StatusOr<morph::EtcdOptions> eo = morph::EtcdOptions::Parse(etcd.value, "--etcd");
    if (!eo.ok()) return Usage(std::string(eo.status().message()).c_str());
    o.etcd = *std::move(eo);
  }
  if (etcd_prefix.set) {
    if (morph::Status v = morph::ValidateJobPrefix(etcd_prefix.value, "--etcd-prefix"); !v.ok()) {
      return Usage(std::string(v.message()).c_str());
    }
    o.etcd_prefix = etcd_prefix.value;
  }

  // SIGTERM and SIGINT are taken by sigtimedwait below: block them before any thread starts.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  morph::StatusOr<std::unique_ptr<morph::Coordinator>> c = morph::Coordinator::Start(o);
  if (!c.ok()) {
    std::fprintf(stderr, "morphd: %s\n", c.status().ToString().c_str());
    return 2;
  }
  morph::Coordinator& coord = **c;
  std::printf("{\"control\":\"%s\",\"store\":\"%s\",\"http_port\":%u}\n",
              coord.control_address().c_str(), coord.store_address().c_str(),
              static_cast<unsigned>(coord.http_port()));
  std::fflush(stdout);

  while (true) {
    timespec slice{.tv_sec = 0, .tv_nsec = 200 * 1000 * 1000};
    int sig = sigtimedwait(&stop_signals, nullptr, &slice);
    if (sig > 0) {
      LOG(INFO) << "morphd: " << strsignal(sig) << ": stopping";
      coord.Stop();
      return 0;
    }
    morph::Status s = coord.Wait(morph::Deadline::AfterMs(0));
    if (s.code() == morph::StatusCode::kDeadlineExceeded) continue;
    coord.Stop();
    if (s.ok()) {
      LOG(INFO) << "morphd: the job completed";
      return 0;
    }
    if (s.code() == morph::StatusCode::kCancelled) {
      LOG(INFO) << "morphd: " << s.message();  // every worker left, as asked
      return 0;
    }
    LOG(ERROR) << "morphd: " << s;
    return 1;
  }
}
