#include "runtime/ha/etcd_testutil.h"

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "runtime/ha/election.h"

extern char** environ;

namespace morph {

uint16_t FreeLoopbackPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  uint16_t port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

namespace {

std::string EtcdBinary() {
  if (const char* b = getenv("MORPH_ETCD_BINARY"); b != nullptr && *b != '\0') return b;
  if (const char* path = getenv("PATH")) {
    std::string p = path;
    size_t pos = 0;
    while (pos <= p.size()) {
      size_t colon = p.find(':', pos);
      if (colon == std::string::npos) colon = p.size();
      std::string cand = p.substr(pos, colon - pos) + "/etcd";
      if (access(cand.c_str(), X_OK) == 0) return cand;
      pos = colon + 1;
    }
  }
  return access("/usr/bin/etcd", X_OK) == 0 ? "/usr/bin/etcd" : "";
}

}  // namespace

StatusOr<std::unique_ptr<EtcdCluster>> EtcdCluster::Start(int members,
                                                         const std::string& client_host) {
  const std::string binary = EtcdBinary();
  if (binary.empty()) {
    return NotFoundError("no etcd binary (apt-get install etcd-server, or set MORPH_ETCD_BINARY)");
  }
  std::unique_ptr<EtcdCluster> c(new EtcdCluster());
  std::string tmpl = (std::filesystem::temp_directory_path() / "morph-etcd-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) return InternalError("mkdtemp failed");
  c->dir_ = tmpl;
  c->client_host_ = client_host;
  std::vector<uint16_t> peer_ports;
  std::string initial;
  for (int i = 0; i < members; ++i) {
    c->client_ports_.push_back(FreeLoopbackPort());
    peer_ports.push_back(FreeLoopbackPort());
    initial += (i ? "," : "") + std::string("m") + std::to_string(i) +
               "=http://127.0.0.1:" + std::to_string(peer_ports.back());
  }
  for (int i = 0; i < members; ++i) {
    const std::string name = "m" + std::to_string(i);
    const std::string client = "http://" + client_host + ":" + std::to_string(c->client_ports_[i]);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_ports[i]);
    std::vector<std::string> args = {binary,
                                     "--name=" + name,
                                     "--data-dir=" + c->dir_ + "/" + name,
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=" + initial,
                                     "--initial-cluster-token=" + c->dir_,
                                     "--initial-cluster-state=new",
                                     // Loopback: elect quickly, so a test's member kill is short.
                                     "--heartbeat-interval=50",
                                     "--election-timeout=500",
                                     "--log-level=warn"};
    c->args_.push_back(std::move(args));
    c->pids_.push_back(0);
    MORPH_RETURN_IF_ERROR(c->Spawn(i));
  }
  MORPH_RETURN_IF_ERROR(c->WaitReady());
  return c;
}

Status EtcdCluster::Spawn(int i) {
  std::vector<char*> argv;
  for (auto& a : args_[i]) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  const std::string log = dir_ + "/m" + std::to_string(i) + ".log";
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return InternalError(std::string("spawning ") + argv[0] + ": " + strerror(rc));
  pids_[i] = pid;
  return Status::Ok();
}

Status EtcdCluster::WaitReady() {
  // Ready when a write goes through (the cluster has elected its raft leader).
  EtcdOptions o = options();
  o.timeout = std::chrono::milliseconds(1000);
  EtcdClient client(o);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  Status last;
  while (std::chrono::steady_clock::now() < deadline) {
    last = client.Put("/morph-test/ready", "1");
    if (last.ok()) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return DeadlineExceededError("etcd cluster in " + dir_ + " not ready within 30 s (" +
                               std::string(last.message()) + "); see its *.log");
}

Status EtcdCluster::Restart(int i) {
  if (i < 0 || static_cast<size_t>(i) >= pids_.size()) return InvalidArgumentError("no member");
  Kill(i);
  return Spawn(i);  // its data folder holds the cluster: it rejoins as it was
}

EtcdCluster::~EtcdCluster() {
  for (size_t i = 0; i < pids_.size(); ++i) Kill(static_cast<int>(i));
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

void EtcdCluster::Kill(int i) {
  if (i < 0 || static_cast<size_t>(i) >= pids_.size() || pids_[i] <= 0) return;
  kill(pids_[i], SIGKILL);
  int status = 0;
  waitpid(pids_[i], &status, 0);  // SIGKILL cannot be ignored: bounded
  pids_[i] = 0;
}

std::string EtcdCluster::endpoints() const {
  std::string s;
  for (size_t i = 0; i < client_ports_.size(); ++i) {
    s += (i ? "," : "") + client_host_ + ":" + std::to_string(client_ports_[i]);
  }
  return s;
}

EtcdOptions EtcdCluster::options() const {
  EtcdOptions o;
  for (uint16_t p : client_ports_) o.endpoints.push_back(client_host_ + ":" + std::to_string(p));
  return o;
}

LeaderSeen WaitForLeader(EtcdOptions options, const std::string& prefix, int64_t timeout_ms,
                         const std::string& not_) {
  options.timeout = std::chrono::milliseconds(500);
  EtcdClient etcd(options);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    StatusOr<std::optional<std::string>> v = LookupLeader(etcd, prefix);
    if (v.ok() && v->has_value()) {
      nlohmann::json j = nlohmann::json::parse(**v, nullptr, /*allow_exceptions=*/false);
      const std::string control = j.is_object() ? j.value("control", "") : "";
      if (!control.empty() && control != not_) {
        return LeaderSeen{control, static_cast<uint16_t>(j.value("http_port", 0))};
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return LeaderSeen{};
}

}  // namespace morph
