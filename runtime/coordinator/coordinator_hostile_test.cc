// What a stranger or a hostile token holder cannot do to a real Coordinator (control channel,
// hosted store, scheduler API), on real sockets:
//   - idle connections to the control port (more than the descriptor limit allows) do not take
//     the process's descriptors: the scheduler API answers, a worker registers, the store
//     serves, the process can still open sockets of its own, and the warnings are few;
//   - a Hello whose host is not a printable name of at most 255 bytes is refused naming the
//     field, and the host strings of workers that are gone are not kept;
//   - /v1/status's step and morph_step are the current generation's, which no single worker's
//     heartbeat can pin.
// Bounded: every wait has a deadline; the forked child is reaped.
#include <arpa/inet.h>
#include <fcntl.h>
#include <glog/logging.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/testing.h"
#include "collectives/store/tcp_store.h"
#include "runtime/agent/agent_core.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/agent/control_client.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "hostile-test-token";

JobManifest Manifest() {
  JobManifest m;
  m.model.num_layers = 1;
  m.model.global_batch = 12;
  m.tensors.push_back(TensorSpec{"w", DType::kF32, {4, 4}, Layout::Layer(0)});
  return m;
}

CoordinatorOptions Options(int initial_world) {
  CoordinatorOptions o;
  o.token = kToken;
  o.initial_world = initial_world;
  o.handshake_timeout_ms = 60000;  // the cap, not the handshake timer, must make room
  o.heartbeat_timeout_ms = 0;
  return o;
}

StatusOr<std::unique_ptr<ControlClient>> Register(const std::string& address,
                                                  const std::string& host) {
  return ControlClient::Connect(address, HelloMsg{.token = kToken, .host = host, .pid = 0},
                                RegisterMsg{.manifest = Manifest()}, Deadline::AfterMs(10000));
}

bool WaitFor(const std::function<bool()>& pred, int ms = 10000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

int ConnectTo(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// One HTTP GET on a fresh connection; the whole reply ("" when none came within 5 s).
std::string HttpGet(uint16_t port, const std::string& target) {
  int fd = ConnectTo(port);
  if (fd < 0) return "";
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string request = "GET " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) reply.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return reply;
}

// ---- a flood of idle connections --------------------------------------------------------------

// Counts WARNING and worse lines (in the forked child).
class WarningCounter : public google::LogSink {
 public:
  void send(google::LogSeverity severity, const char*, const char*, int, const struct ::tm*,
            const char* message, size_t len) override {
    if (severity < google::GLOG_WARNING) return;
    std::lock_guard<std::mutex> l(mu_);
    ++count_;
    if (first_.size() < 5) first_.emplace_back(message, len);
  }
  int count() {
    std::lock_guard<std::mutex> l(mu_);
    return count_;
  }
  std::string first() {
    std::lock_guard<std::mutex> l(mu_);
    std::string s;
    for (const std::string& m : first_) s += "  " + m + "\n";
    return s;
  }

 private:
  std::mutex mu_;
  int count_ = 0;
  std::vector<std::string> first_;
};

struct ChildPorts {
  uint16_t control = 0, store = 0, http = 0;
};

// The coordinator runs in a child whose open-file limit is 256 (the common 1,024 scaled down):
// 300 idle connections to its control port and 300 to its store, more than the limit, must not
// keep it from serving the scheduler API, registering a worker, serving a store client or
// opening sockets of its own, and what it logs about them is a few lines, not one per accept.
TEST(CoordinatorHostileTest, IdleConnectionsDoNotTakeTheProcesssDescriptors) {
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = 256;
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) ::_exit(3);
    auto* warnings = new WarningCounter();
    google::AddLogSink(warnings);
    auto coord = Coordinator::Start(Options(1));
    if (!coord.ok()) ::_exit(2);
    const std::string control = (*coord)->control_address();
    ChildPorts ports{static_cast<uint16_t>(std::stoi(control.substr(control.rfind(':') + 1))),
                     (*coord)->store().port(), (*coord)->http_port()};
    if (::write(to_parent[1], &ports, sizeof(ports)) != sizeof(ports)) ::_exit(4);
    char go;
    if (::read(to_child[0], &go, 1) != 1) ::_exit(5);
    // The flood is on: this process (a training worker, when it hosts the coordinator) can
    // still open sockets of its own.
    std::vector<int> own;
    for (int i = 0; i < 32; ++i) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) own.push_back(fd);
    }
    for (int fd : own) ::close(fd);
    int result[2] = {static_cast<int>(own.size()), 0};
    if (::read(to_child[0], &go, 1) != 1) ::_exit(6);
    result[1] = warnings->count();
    std::fprintf(stderr, "child: %d of 32 own sockets, %d warnings; the first:\n%s", result[0],
                 result[1], warnings->first().c_str());
    if (::write(to_parent[1], result, sizeof(result)) != sizeof(result)) ::_exit(7);
    ::_exit(0);
  }
  ChildPorts ports;
  ASSERT_EQ(::read(to_parent[0], &ports, sizeof(ports)), static_cast<ssize_t>(sizeof(ports)));
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) {
    for (uint16_t port : {ports.control, ports.store}) {
      int fd = ConnectTo(port);
      if (fd >= 0) idle.push_back(fd);
    }
  }
  EXPECT_EQ(idle.size(), 600u);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_EQ(::write(to_child[1], "x", 1), 1);
  // The scheduler API answers.
  EXPECT_THAT(HttpGet(ports.http, "/v1/status"), HasSubstr("HTTP/1.1 200"));
  // A store client is served (in generation 0: before the worker below starts generation 1).
  StatusOr<std::unique_ptr<TcpStoreClient>> store = TcpStoreClient::Connect(
      "127.0.0.1:" + std::to_string(ports.store), kToken, 0, Deadline::AfterMs(10000));
  EXPECT_TRUE(store.ok()) << store.status();
  if (store.ok()) MORPH_EXPECT_OK((*store)->Set("k", "v", Deadline::AfterMs(5000)));
  // A worker registers.
  StatusOr<std::unique_ptr<ControlClient>> worker =
      Register("127.0.0.1:" + std::to_string(ports.control), "flooded-host");
  EXPECT_TRUE(worker.ok()) << worker.status();
  // Let a second's worth of would-be warnings pile up.
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  ASSERT_EQ(::write(to_child[1], "x", 1), 1);
  int result[2] = {-1, -1};
  EXPECT_EQ(::read(to_parent[0], result, sizeof(result)), static_cast<ssize_t>(sizeof(result)));
  EXPECT_EQ(result[0], 32) << "the process could not open sockets of its own";
  EXPECT_LE(result[1], 6) << "warnings are not rate-limited";
  for (int fd : idle) ::close(fd);
  worker = Status::Ok();
  store = Status::Ok();
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) ::close(fd);
}

// Strangers refused at their first frame (a wrong token, no Hello) are what a flood repeats:
// the coordinator says so at most once per 10 s, not once per connection.
TEST(CoordinatorHostileTest, RefusalsOfStrangersAreRateLimited) {
  WarningCounter warnings;
  google::AddLogSink(&warnings);
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  const std::string address = coord->control_address();
  const uint16_t port = static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  for (int i = 0; i < 200; ++i) {
    int fd = ConnectTo(port);
    ASSERT_GE(fd, 0);
    std::string frame = i % 2 == 0 ? EncodeFrame(HelloMsg{.token = "wrong", .host = "x"})
                                   : EncodeFrame(HeartbeatMsg{.step = 1});
    (void)::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
    timeval tv{.tv_sec = 5, .tv_usec = 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[512];
    while (::recv(fd, buf, sizeof(buf), 0) > 0) {
    }
    ::close(fd);
  }
  EXPECT_EQ(coord->stats().handshakes_refused, 200);
  google::RemoveLogSink(&warnings);
  EXPECT_LE(warnings.count(), 2) << warnings.first();
  // A token holder's refusal is still worth a line each.
  EXPECT_FALSE(Register(address, "bad host").ok());
}

// ---- hosts ------------------------------------------------------------------------------------

TEST(CoordinatorHostileTest, AHostThatIsNotAPrintableNameIsRefusedNamingTheField) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1 << 10)));
  const std::string address = coord->control_address();
  const std::vector<std::string> bad = {
      "node1\nI0101 00:00:00.000000 1 coordinator.cc:1] forged line",
      "\x1b[31mred\x1b[0m",
      "two words",
      std::string("nul\0byte", 8),
      std::string(3900, 'h'),  // the audit's: kept for good before
      std::string(256, 'h'),
  };
  for (const std::string& host : bad) {
    EXPECT_THAT(Register(address, host).status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("hello.host: ")))
        << host.size() << " bytes";
  }
  // 4 KiB does not even fit in a Hello (kMaxHelloBody): refused at the frame's header.
  EXPECT_FALSE(Register(address, std::string(4096, 'h')).ok());
  EXPECT_EQ(coord->stats().workers_registered, 0);
  // The longest allowed, and names as they come.
  for (const std::string& host :
       {std::string(255, 'h'), std::string("node-7.rack_3.example.com"), std::string("10.0.0.1")}) {
    SCOPED_TRACE(host);
    MORPH_EXPECT_OK(Register(address, host).status());
  }
}

TEST(CoordinatorHostileTest, TheHostsOfWorkersThatAreGoneAreForgotten) {
  // The first generation never starts: every worker stays a registered candidate until it
  // disconnects.
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1 << 16)));
  const std::string address = coord->control_address();
  constexpr int kCycles = 1000;
  for (int i = 0; i < kCycles; ++i) {
    auto w = Register(address, std::string(200, 'a' + i % 26));
    ASSERT_TRUE(w.ok()) << "cycle " << i << ": " << w.status();
  }
  ASSERT_TRUE(WaitFor([&] { return coord->stats().workers_connected == 0; }));
  EXPECT_EQ(coord->stats().workers_registered, kCycles);
  EXPECT_EQ(coord->stats().hosts_known, 0) << "host strings of departed workers are kept";
}

// ---- the step ---------------------------------------------------------------------------------

// Registered workers driven through the protocol by the real AgentCore (the training loop
// simulated: a step whenever the core lets it), until `done` holds for every one.
struct Worker {
  std::unique_ptr<ControlClient> client;
  std::unique_ptr<AgentCore> core;
  int64_t next_step = 0;
};

StatusOr<Worker> Join(const Coordinator& c) {
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client,
                         Register(c.control_address(), "step-test"));
  WorkerId me = client->welcome().worker;
  return Worker{std::move(client), std::make_unique<AgentCore>(me)};
}

bool Reach(const std::vector<Worker*>& ws, int64_t generation, Deadline deadline) {
  while (!deadline.Expired()) {
    bool all = true;
    for (Worker* w : ws) {
      if (w->core->generation().id == generation) continue;
      all = false;
      StatusOr<WireMessage> m = w->client->Receive(Deadline::AfterMs(5));
      if (!m.ok()) {
        if (m.status().code() != StatusCode::kDeadlineExceeded) return false;
      } else if (auto* p = std::get_if<PrepareMsg>(&*m)) {
        if (auto r = w->core->OnPrepare(*p, w->next_step)) (void)w->client->Send(*r);
      } else if (auto* c = std::get_if<CommitMsg>(&*m)) {
        w->core->OnCommit(*c);
      } else if (auto* o = std::get_if<OutcomeMsg>(&*m)) {
        w->core->OnOutcome(*o);
      } else if (auto* a = std::get_if<AbandonMsg>(&*m)) {
        w->core->OnAbandon(*a);
      }
      switch (w->core->AtStep(w->next_step)) {
        case AgentCore::Action::kProceed:
          ++w->next_step;
          break;
        case AgentCore::Action::kSwitch:
          w->next_step = w->core->pending_commit()->next.start_step + 1;
          (void)w->client->Send(w->core->SwitchDone(true));
          break;
        default:
          break;
      }
    }
    if (all) return true;
  }
  return false;
}

int64_t MetricsStep(uint16_t http_port) {
  std::string reply = HttpGet(http_port, "/metrics");
  size_t at = reply.find("\nmorph_step ");
  if (at == std::string::npos) return -1;
  return std::strtoll(reply.c_str() + at + 12, nullptr, 10);
}

TEST(CoordinatorHostileTest, TheStepIsTheCurrentGenerationsAndNoWorkerPinsIt) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(2)));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker a, Join(*coord));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker b, Join(*coord));
  ASSERT_TRUE(Reach({&a, &b}, 1, Deadline::AfterMs(10000)));
  const int64_t start1 = a.core->generation().start_step;
  // Only once the coordinator has seen generation 1 applied by both: a heartbeat that arrives
  // before the last member's SwitchDone is a step of the generation it is still leaving (real
  // workers send one every second; these are sent once).
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().generation == 1; }));
  // One member claims the largest step there is, the other an honest one.
  MORPH_ASSERT_OK(a.client->Send(HeartbeatMsg{.step = INT64_MAX}));
  MORPH_ASSERT_OK(b.client->Send(HeartbeatMsg{.step = start1 + 7}));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().step == start1 + 7; }))
      << "step " << coord->Snapshot().step;
  EXPECT_EQ(MetricsStep(coord->http_port()), start1 + 7);
  // Both far ahead (and plausibly so: 10 steps per millisecond at most): then a change (a
  // joiner) commits generation 2 at the steps the members report, far below, as after a
  // rollback; the old heartbeats no longer count.
  const int64_t far = start1 + 5000;
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  MORPH_ASSERT_OK(a.client->Send(HeartbeatMsg{.step = far}));
  MORPH_ASSERT_OK(b.client->Send(HeartbeatMsg{.step = far}));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().step == far; }))
      << "step " << coord->Snapshot().step;
  MORPH_ASSERT_OK_AND_ASSIGN(Worker c, Join(*coord));
  ASSERT_TRUE(Reach({&a, &b, &c}, 2, Deadline::AfterMs(10000)));
  const int64_t start2 = a.core->generation().start_step;
  ASSERT_LT(start2, far);
  auto in_generation_2_at = [&](int64_t step) {
    CoordinatorSnapshot s = coord->Snapshot();
    return s.generation == 2 && s.step == step;
  };
  ASSERT_TRUE(WaitFor([&] { return in_generation_2_at(start2); }))
      << "step " << coord->Snapshot().step << ", generation 2 starts at " << start2;
  for (Worker* w : {&a, &b, &c}) {
    MORPH_ASSERT_OK(w->client->Send(HeartbeatMsg{.step = start2 + 3}));
  }
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().step == start2 + 3; }))
      << "step " << coord->Snapshot().step;
  EXPECT_EQ(MetricsStep(coord->http_port()), start2 + 3);
}

TEST(CoordinatorHostileTest, ALoneMemberCannotClaimAnImplausibleStep) {
  auto began = std::chrono::steady_clock::now();
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker a, Join(*coord));
  ASSERT_TRUE(Reach({&a}, 1, Deadline::AfterMs(10000)));
  MORPH_ASSERT_OK(a.client->Send(HeartbeatMsg{.step = INT64_MAX}));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().step > 0; }));
  // At most 10 steps per millisecond since the generation began.
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::steady_clock::now() - began)
                         .count();
  EXPECT_LE(coord->Snapshot().step, 10 * ms);
}

}  // namespace
}  // namespace morph
