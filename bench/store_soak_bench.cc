// Store soak (issue 8 §1): a TcpStoreServer in a child process serves a rendezvous of 1,024
// clients (each sets its key, then waits for all 1,024) while 4,096 authenticated idle
// connections stay open, once alone and once with 50 hostile clients misbehaving throughout
// (stalled 64 MiB announcements before and after authentication, garbage, a body announcing
// 67 M keys, waiters that disconnect). One JSON object per case: rendezvous seconds and the
// server's RSS, the hostile case as a ratio of the quiet one.
//
//   make bench-store        (or build/bench/store_soak_bench [clients] [idle] [hostile])
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <latch>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/store/store_protocol.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

using namespace store_wire;

constexpr char kToken[] = "soak-bench-token";
int server_pipe_ = -1;  // the parent's end; closing it stops the server

int64_t RssOf(pid_t pid, const char* field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + std::strlen(field)) * 1024;
  }
  return 0;
}

int Dial(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, std::string_view b) {
  while (!b.empty()) {
    ssize_t n = ::send(fd, b.data(), b.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    b.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Sends the hello and reads the (small) answer.
bool Authenticate(int fd) {
  if (!SendAll(fd, Frame(EncodeHello(kToken)))) return false;
  char buf[256];
  ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  return n > 4;
}

// The server: its own process, so that its RSS is its own. Writes its port, serves until the
// parent closes the pipe.
pid_t ForkServer(uint16_t& port) {
  int up[2], down[2];
  if (::pipe(up) != 0 || ::pipe(down) != 0) std::abort();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(up[0]);
    ::close(down[1]);
    TcpStoreServerOptions options;
    options.max_connections = 16384;
    auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken, options);
    if (!server.ok()) {
      std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
      ::_exit(1);
    }
    uint16_t p = (*server)->port();
    if (::write(up[1], &p, sizeof(p)) != sizeof(p)) ::_exit(1);
    char c;
    while (::read(down[0], &c, 1) > 0) {
    }
    ::_exit(0);
  }
  ::close(up[1]);
  ::close(down[0]);
  if (::read(up[0], &port, sizeof(port)) != sizeof(port)) std::abort();
  ::close(up[0]);
  server_pipe_ = down[1];
  return pid;
}

// 50 hostile clients, in 5 kinds, re-created as the server drops them, until `stop`.
class Hostile {
 public:
  Hostile(uint16_t port, int n) : port_(port), n_(n) {}

  void Run(const std::atomic<bool>& stop) {
    std::vector<int> fds(static_cast<size_t>(n_), -1);
    std::mt19937 rng(1);
    while (!stop.load()) {
      for (int i = 0; i < n_ && !stop.load(); ++i) {
        int& fd = fds[static_cast<size_t>(i)];
        if (fd >= 0) {
          char c;
          ssize_t r = ::recv(fd, &c, 1, MSG_DONTWAIT);
          if (r != 0 && !(r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) continue;
          ::close(fd);  // the server closed it: come back
        }
        fd = Dial(port_);
        if (fd < 0) continue;
        ++attacks_;
        Misbehave(fd, i % 5, rng);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  int64_t attacks() const { return attacks_; }

 private:
  void Misbehave(int& fd, int kind, std::mt19937& rng) {
    std::string b;
    switch (kind) {
      case 0:  // announces a 64 MiB token frame, stalls
        PutU32(b, 64u << 20);
        SendAll(fd, b);
        break;
      case 1:  // authenticated, announces 64 MiB, sends 64 KiB, stalls
        if (!Authenticate(fd)) break;
        PutU32(b, 64u << 20);
        b.append(64 << 10, 'x');
        SendAll(fd, b);
        break;
      case 2:  // garbage
        for (int i = 0; i < 4096; ++i) b.push_back(static_cast<char>(rng()));
        SendAll(fd, b);
        break;
      case 3: {  // authenticated, a 1 MiB body announcing 67 M empty keys
        if (!Authenticate(fd)) break;
        std::string body(1, static_cast<char>(KvTable::Op::kWait));
        PutU64(body, 0);
        PutU64(body, 0);
        PutU32(body, 67u << 20);
        body.append((1u << 20) - body.size(), '\0');
        SendAll(fd, Frame(body));
        break;
      }
      case 4: {  // authenticated, a long Get, then gone
        if (!Authenticate(fd)) break;
        KvTable::Request r{.op = KvTable::Op::kGet, .keys = {"never"}};
        SendAll(fd, Frame(EncodeRequest(r, int64_t{1} << 62)));
        ::close(fd);
        fd = -1;
        break;
      }
    }
  }

  uint16_t port_;
  int n_;
  std::atomic<int64_t> attacks_{0};
};

struct Result {
  double seconds = 0;
  int64_t rss = 0, peak_rss = 0;
  int64_t attacks = 0;
  int failures = 0;
};

Result RunCase(int clients, int idle, int hostile) {
  uint16_t port = 0;
  pid_t pid = ForkServer(port);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  Result res;
  // Idle, authenticated connections.
  std::vector<int> idle_fds;
  for (int i = 0; i < idle; ++i) {
    int fd = Dial(port);
    if (fd < 0 || !Authenticate(fd)) {
      std::fprintf(stderr, "idle connection %d failed\n", i);
      std::exit(1);
    }
    idle_fds.push_back(fd);
  }
  std::atomic<bool> stop{false};
  Hostile bad(port, hostile);
  std::thread bad_thread;
  if (hostile > 0) {
    bad_thread = std::thread([&] { bad.Run(stop); });
    // Every hostile client in place (and the first ones already dropped) before the clients
    // connect.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  // Rendezvous: every client sets its key, then waits for all of them.
  std::vector<std::string> keys;
  for (int i = 0; i < clients; ++i) keys.push_back("addr/" + std::to_string(i));
  std::latch connected(clients + 1);
  std::latch go(1);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      auto c = TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(60000));
      connected.count_down();
      go.wait();
      if (!c.ok()) {
        ++failures;
        return;
      }
      Deadline d = Deadline::AfterMs(60000);
      if (!(*c)->Set(keys[static_cast<size_t>(i)], "host:port", d).ok() ||
          !(*c)->Wait(keys, d).ok()) {
        ++failures;
      }
    });
  }
  connected.arrive_and_wait();
  auto t0 = std::chrono::steady_clock::now();
  go.count_down();
  for (auto& t : threads) t.join();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.rss = RssOf(pid, "VmRSS:");
  res.peak_rss = RssOf(pid, "VmHWM:");
  stop = true;
  if (bad_thread.joinable()) bad_thread.join();
  res.attacks = bad.attacks();
  res.failures = failures.load();
  for (int fd : idle_fds) ::close(fd);
  ::close(server_pipe_);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return res;
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  using namespace morph;
  const int clients = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int idle = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int hostile = argc > 3 ? std::atoi(argv[3]) : 50;
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  const rlim_t need = static_cast<rlim_t>(clients + idle + hostile) + 256;
  if (lim.rlim_cur < need) {
    lim.rlim_cur = std::min(need, lim.rlim_max);
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  if (lim.rlim_cur < need) {
    std::fprintf(stderr, "store_soak_bench: open-file limit %llu < %llu needed; raise ulimit -Hn\n",
                 static_cast<unsigned long long>(lim.rlim_cur),
                 static_cast<unsigned long long>(need));
    return 1;
  }
  Result quiet = RunCase(clients, idle, 0);
  Result loud = RunCase(clients, idle, hostile);
  for (const auto& [r, h] : {std::pair{quiet, 0}, std::pair{loud, hostile}}) {
    std::printf(
        "{\"name\":\"store_soak\",\"clients\":%d,\"idle\":%d,\"hostile\":%d,\"bytes\":0,"
        "\"seconds\":%.4f,\"server_rss_bytes\":%lld,\"server_peak_rss_bytes\":%lld,"
        "\"hostile_attacks\":%lld,\"failures\":%d,\"ratio_vs_baseline\":%.3f,"
        "\"rss_ratio_vs_baseline\":%.3f}\n",
        clients, idle, h, r.seconds, static_cast<long long>(r.rss),
        static_cast<long long>(r.peak_rss), static_cast<long long>(r.attacks), r.failures,
        r.seconds / quiet.seconds,
        static_cast<double>(r.peak_rss) / static_cast<double>(quiet.peak_rss));
  }
  return quiet.failures + loud.failures == 0 ? 0 : 1;
}
