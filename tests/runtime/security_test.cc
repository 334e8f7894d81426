// What the job token protects and where morph listens (docs/operations.md "Security"), end to
// end on real sockets: a real Coordinator (control channel, hosted store, scheduler API), raw
// control connections and store clients, HTTP requests written by hand.
//   - a Hello with a wrong or missing token, or any other first frame, is refused at
//     registration with kUnauthenticated;
//   - a connection speaks for the worker it registered as only: a step report or an applied
//     message naming another worker is refused with kPermissionDenied (and the connection
//     closed); another worker's heartbeats do not keep a silent worker alive;
//   - a store client with a wrong or missing token is refused and reads nothing;
//   - POST /v1/resize without or with a wrong token is 401 and changes nothing; with
//     MORPH_API_TOKEN_FOR_READS the reads need the token too;
//   - every listener (coordinator, store, scheduler API, morphd, morphrun's launcher, the
//     hosting Runtime, Gloo's data plane) binds 127.0.0.1 by default, read from /proc.
// Bounded: every wait has a deadline; child processes are killed and reaped.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/store/store.h"
#include "collectives/store/tcp_store.h"
#include "runtime/agent/agent_core.h"
#include "morph/options.h"
#include "morph/runtime.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/agent/control_client.h"
#include "runtime/tools/launcher.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "security-test-token";

// ---- listening sockets, from /proc ------------------------------------------------------------

struct Listener {
  std::string address;  // "127.0.0.1", "0.0.0.0", "::1", ...
  uint16_t port = 0;
};

std::set<std::string> SocketInodes(pid_t pid) {
  std::set<std::string> inodes;
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return inodes;
  while (dirent* e = ::readdir(d)) {
    char target[256] = {};
    std::string path = dir + "/" + e->d_name;
    ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    std::string t(target, static_cast<size_t>(n));
    if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
  }
  ::closedir(d);
  return inodes;
}

// Every TCP socket in LISTEN state that process `pid` holds, with its bound address.
std::vector<Listener> ListeningSockets(pid_t pid) {
  std::set<std::string> inodes = SocketInodes(pid);
  std::vector<Listener> out;
  for (bool v6 : {false, true}) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/net/" + (v6 ? "tcp6" : "tcp"));
    std::string line;
    std::getline(f, line);  // the column names
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string slot, local, remote, state, queues, timer, retrans, uid, timeout, inode;
      in >> slot >> local >> remote >> state >> queues >> timer >> retrans >> uid >> timeout >>
          inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;  // 0A: LISTEN
      size_t colon = local.find(':');
      std::string hex = local.substr(0, colon);
      Listener l;
      l.port = static_cast<uint16_t>(std::stoul(local.substr(colon + 1), nullptr, 16));
      char text[INET6_ADDRSTRLEN] = {};
      if (!v6) {
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));  // host order words
        ::inet_ntop(AF_INET, &a, text, sizeof(text));
      } else {
        in6_addr a{};
        for (int w = 0; w < 4; ++w) {
          uint32_t word = static_cast<uint32_t>(std::stoul(hex.substr(8 * w, 8), nullptr, 16));
          std::memcpy(&a.s6_addr[4 * w], &word, 4);
        }
        ::inet_ntop(AF_INET6, &a, text, sizeof(text));
      }
      l.address = text;
      out.push_back(l);
    }
  }
  return out;
}

std::string Describe(const std::vector<Listener>& ls) {
  std::string s;
  for (const Listener& l : ls)
    s += (s.empty() ? "" : ", ") + l.address + ":" + std::to_string(l.port);
  return s.empty() ? "(none)" : s;
}

uint16_t PortOf(const std::string& host_port) {
  return static_cast<uint16_t>(std::stoi(host_port.substr(host_port.rfind(':') + 1)));
}

// The address `port` is bound to in process `pid` ("" when it does not listen there).
std::string BoundAddress(pid_t pid, uint16_t port) {
  for (const Listener& l : ListeningSockets(pid)) {
    if (l.port == port) return l.address;
  }
  return "";
}

void ExpectAllLoopback(pid_t pid, const std::vector<uint16_t>& expected_ports) {
  std::vector<Listener> ls = ListeningSockets(pid);
  for (const Listener& l : ls) {
    EXPECT_EQ(l.address, "127.0.0.1") << "port " << l.port << " of " << Describe(ls);
  }
  for (uint16_t p : expected_ports) {
    EXPECT_EQ(BoundAddress(pid, p), "127.0.0.1") << "port " << p << " in " << Describe(ls);
  }
}

// Unsets every MORPH_* variable a default might be read from, and restores them afterwards.
class CleanEnv {
 public:
  CleanEnv() {
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e;
      if (kv.rfind("MORPH_", 0) == 0) saved_.push_back(kv);
    }
    for (const std::string& kv : saved_) ::unsetenv(kv.substr(0, kv.find('=')).c_str());
  }
  ~CleanEnv() {
    for (char** e = environ; *e != nullptr;) {
      std::string kv = *e;
      if (kv.rfind("MORPH_", 0) == 0) {
        ::unsetenv(kv.substr(0, kv.find('=')).c_str());
      } else {
        ++e;
      }
    }
    for (const std::string& kv : saved_) {
      size_t eq = kv.find('=');
      ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
    }
  }

 private:
  std::vector<std::string> saved_;
};

// ---- the control channel ----------------------------------------------------------------------

JobManifest Manifest() {
  JobManifest m;
  m.model.num_layers = 1;
  m.model.global_batch = 8;
  m.tensors.push_back(TensorSpec{"w", DType::kF32, {4, 4}, Layout::Layer(0)});
  return m;
}

CoordinatorOptions Options(int initial_world) {
  CoordinatorOptions o;
  o.token = kToken;
  o.initial_world = initial_world;
  o.handshake_timeout_ms = 5000;
  return o;
}

StatusOr<std::unique_ptr<ControlClient>> Register(const Coordinator& c, std::string token,
                                                  WorkerId resume_id = 0) {
  return ControlClient::Connect(c.control_address(),
                                HelloMsg{.token = std::move(token),
                                         .host = "security-test",
                                         .pid = ::getpid(),
                                         .resume_id = resume_id},
                                RegisterMsg{.manifest = Manifest()}, Deadline::AfterMs(10000));
}

// Drives registered workers through the protocol (the real AgentCore) until each is in
// a generation that satisfies `done` (or `gen`), or `deadline` passes.
struct Worker {
  std::unique_ptr<ControlClient> client;
  std::unique_ptr<AgentCore> core;
  int64_t next_step = 0;  // the simulated training loop's next step
};
bool Reach(std::vector<Worker*> ws, const std::function<bool(const Generation&)>& done,
           Deadline deadline) {
  while (!deadline.Expired()) {
    bool all = true;
    for (Worker* w : ws) {
      if (done(w->core->generation())) continue;
      all = false;
      StatusOr<WireMessage> m = w->client->Receive(Deadline::AfterMs(5));
      if (!m.ok()) {
        if (m.status().code() != StatusCode::kDeadlineExceeded) return false;
      } else if (auto* p = std::get_if<PrepareMsg>(&*m)) {
        if (p->change.recovery) {
          w->core->OnRecoveryPrepare(*p);
          if (auto r = w->core->OnRecoveryBuilt(p->next.id)) (void)w->client->Send(*r);
        } else if (auto r = w->core->OnPrepare(*p, w->next_step)) {
          (void)w->client->Send(*r);
        }
      } else if (auto* ab = std::get_if<AbortMsg>(&*m)) {
        w->core->OnAbort(*ab);
      } else if (auto* c = std::get_if<CommitMsg>(&*m)) {
        w->core->OnCommit(*c);
      } else if (auto* a = std::get_if<AbandonMsg>(&*m)) {
        w->core->OnAbandon(*a);
      } else if (auto* o = std::get_if<OutcomeMsg>(&*m)) {
        w->core->OnOutcome(*o);
      }
      switch (w->core->AtStep(w->next_step)) {
        case AgentCore::Action::kProceed:
          ++w->next_step;  // one simulated step
          break;
        case AgentCore::Action::kSwitch:
          w->next_step = w->core->pending_commit()->next.start_step + 1;
          (void)w->client->Send(w->core->SwitchDone(true));
          break;
        case AgentCore::Action::kReport:  // a recovery: this worker's whole state is at next_step
          if (auto r = w->core->OnRecoveryState(w->next_step, true, -1, -1)) {
            (void)w->client->Send(*r);
          }
          break;
        case AgentCore::Action::kCannotSwitch:
          (void)w->client->Send(w->core->SwitchDone(false, "generation failed"));
          break;
        default:
          break;
      }
    }
    if (all) return true;
  }
  return false;
}
bool ReachGeneration(std::vector<Worker*> ws, int64_t gen, Deadline deadline) {
  return Reach(
      std::move(ws), [gen](const Generation& g) { return g.id == gen; }, deadline);
}
StatusOr<Worker> Join(const Coordinator& c) {
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client, Register(c, kToken));
  WorkerId me = client->welcome().worker;
  return Worker{std::move(client), std::make_unique<AgentCore>(me)};
}

// The ErrorMsg the coordinator closed `client` with (receiving until it closes).
std::optional<ErrorMsg> ClosedWith(ControlClient& client, int ms = 5000) {
  Deadline deadline = Deadline::AfterMs(ms);
  while (!deadline.Expired()) {
    StatusOr<WireMessage> m = client.Receive(Deadline::AfterMs(50));
    if (!m.ok() && m.status().code() == StatusCode::kUnavailable) return client.last_error();
  }
  return std::nullopt;
}

bool WaitFor(const std::function<bool()>& pred, int ms = 10000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

TEST(SecurityTest, AWrongOrMissingTokenIsRefusedAtRegistration) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  EXPECT_THAT(Register(*coord, "not-the-token").status(),
              StatusIs(StatusCode::kUnauthenticated, "wrong job token"));
  EXPECT_THAT(Register(*coord, "").status(),
              StatusIs(StatusCode::kUnauthenticated, "wrong job token"));
  // A prefix of the token is no token either (the comparison covers the whole length).
  EXPECT_THAT(Register(*coord, std::string(kToken).substr(0, 5)).status(),
              StatusIs(StatusCode::kUnauthenticated, "wrong job token"));
  EXPECT_EQ(coord->stats().workers_registered, 0);
  EXPECT_EQ(coord->stats().handshakes_refused, 3);
  // The right token gets in: the refusals above were about the token.
  MORPH_ASSERT_OK_AND_ASSIGN(auto ok, Register(*coord, kToken));
  EXPECT_EQ(coord->stats().workers_registered, 1);
}

// A raw connection whose first frame is not Hello.
std::optional<ErrorMsg> FirstFrameReply(const Coordinator& c, const WireMessage& first) {
  std::string address = c.control_address();
  size_t colon = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::optional<ErrorMsg> out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    std::string frame = EncodeFrame(first);
    (void)::send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
    std::string reply;
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) reply.append(buf, static_cast<size_t>(n));
    StatusOr<WireMessage> m = DecodeFrame(reply);
    if (m.ok() && std::holds_alternative<ErrorMsg>(*m)) out = std::get<ErrorMsg>(*m);
  }
  ::close(fd);
  return out;
}

TEST(SecurityTest, NothingButHelloIsHeardBeforeAuthentication) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  const std::vector<std::pair<WireMessage, std::string>> cases = {
      {RegisterMsg{.manifest = Manifest()}, "the first frame must be hello, got register"},
      {HeartbeatMsg{.step = 1}, "the first frame must be hello, got heartbeat"},
      {StepReportMsg{.worker = 1, .generation = 1},
       "the first frame must be hello, got step_report"},
      {LeaveMsg{.reason = "x"}, "the first frame must be hello, got leave"},
  };
  for (const auto& [frame, message] : cases) {
    std::optional<ErrorMsg> e = FirstFrameReply(*coord, frame);
    ASSERT_TRUE(e.has_value()) << message;
    EXPECT_EQ(e->code, static_cast<int32_t>(StatusCode::kUnauthenticated)) << message;
    EXPECT_EQ(e->message, message);
  }
  EXPECT_EQ(coord->stats().workers_registered, 0);
}

TEST(SecurityTest, AConnectionCannotSpeakForAnotherWorker) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(3)));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker a, Join(*coord));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker b, Join(*coord));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker x, Join(*coord));
  ASSERT_TRUE(ReachGeneration({&a, &b, &x}, 1, Deadline::AfterMs(10000)));
  const WorkerId ia = a.client->welcome().worker, ib = b.client->welcome().worker,
                 ix = x.client->welcome().worker;
  // A step report in b's name, sent on a's connection.
  MORPH_ASSERT_OK(
      a.client->Send(StepReportMsg{.worker = ib, .generation = 2, .last_free_step = 7}));
  std::optional<ErrorMsg> e = ClosedWith(*a.client);
  ASSERT_TRUE(e.has_value()) << "a's connection was not closed";
  EXPECT_EQ(e->code, static_cast<int32_t>(StatusCode::kPermissionDenied));
  EXPECT_EQ(e->message, "step_report.worker: names worker " + std::to_string(ib) +
                            ", but this connection is worker " + std::to_string(ia));
  // An applied message in x's name, on b's connection.
  MORPH_ASSERT_OK(b.client->Send(AppliedMsg{.worker = ix, .generation = 1, .ok = true}));
  e = ClosedWith(*b.client);
  ASSERT_TRUE(e.has_value()) << "b's connection was not closed";
  EXPECT_EQ(e->code, static_cast<int32_t>(StatusCode::kPermissionDenied));
  EXPECT_EQ(e->message, "applied.worker: names worker " + std::to_string(ix) +
                            ", but this connection is worker " + std::to_string(ib));
  // The impostors are gone; the worker they named is still there, and alone in the job.
  ASSERT_TRUE(WaitFor([&] { return coord->stats().workers_connected == 1; }));
  EXPECT_FALSE(x.client->closed());
  ASSERT_TRUE(Reach(
      {&x}, [&](const Generation& g) { return g.ranks == std::vector<WorkerId>{ix}; },
      Deadline::AfterMs(10000)))
      << "generation " << x.core->generation().id;
}

TEST(SecurityTest, AnotherWorkersHeartbeatsDoNotKeepASilentWorkerAlive) {
  CoordinatorOptions o = Options(2);
  o.heartbeat_timeout_ms = 300;
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker talker, Join(*coord));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker silent, Join(*coord));
  ASSERT_TRUE(ReachGeneration({&talker, &silent}, 1, Deadline::AfterMs(10000)));
  // The talker heartbeats often (a heartbeat names nobody: it is the connection's), the other
  // never does after generation 1.
  std::optional<ErrorMsg> e;
  Deadline deadline = Deadline::AfterMs(5000);
  while (!deadline.Expired() && !silent.client->closed()) {
    MORPH_ASSERT_OK(talker.client->Send(HeartbeatMsg{.step = 1}));
    StatusOr<WireMessage> m = silent.client->Receive(Deadline::AfterMs(20));
    if (!m.ok() && m.status().code() == StatusCode::kUnavailable) e = silent.client->last_error();
  }
  ASSERT_TRUE(e.has_value()) << "the silent worker was not declared lost";
  EXPECT_EQ(e->code, static_cast<int32_t>(StatusCode::kUnavailable));
  EXPECT_THAT(e->message, HasSubstr("declared lost: no heartbeat for more than 300"));
  EXPECT_FALSE(talker.client->closed());
}

TEST(SecurityTest, AResumeIdDoesNotTakeOverAnotherWorkersIdentity) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(2)));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker a, Join(*coord));
  const WorkerId ia = a.client->welcome().worker;
  MORPH_ASSERT_OK_AND_ASSIGN(auto thief, Register(*coord, kToken, /*resume_id=*/ia));
  EXPECT_NE(thief->welcome().worker, ia);
  EXPECT_EQ(coord->stats().workers_connected, 2);
  EXPECT_FALSE(a.client->closed());
}

// ---- the store --------------------------------------------------------------------------------

TEST(SecurityTest, AStoreClientWithoutTheTokenIsRefusedAndReadsNothing) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  MORPH_ASSERT_OK_AND_ASSIGN(auto good, TcpStoreClient::Connect(coord->store_address(), kToken, 0,
                                                                Deadline::AfterMs(5000)));
  MORPH_ASSERT_OK(good->Set("secret", "42", Deadline::AfterMs(5000)));
  for (const std::string& token : {std::string("wrong"), std::string(kToken) + "x"}) {
    EXPECT_THAT(
        TcpStoreClient::Connect(coord->store_address(), token, 0, Deadline::AfterMs(5000)).status(),
        StatusIs(StatusCode::kUnauthenticated, HasSubstr("the job token was refused")))
        << token;
  }
  // An empty token is refused too (the client sends it; the server compares it).
  EXPECT_THAT(
      TcpStoreClient::Connect(coord->store_address(), "", 0, Deadline::AfterMs(5000)).status(),
      StatusIs(StatusCode::kUnauthenticated, HasSubstr("the job token was refused")));
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v, good->Get("secret", Deadline::AfterMs(5000)));
  EXPECT_EQ(v, "42");
}

// ---- the scheduler API ------------------------------------------------------------------------

// One HTTP request on a fresh connection; the whole reply.
std::string Http(uint16_t port, const std::string& request) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string reply;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    (void)::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) reply.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return reply;
}
std::string Post(uint16_t port, const std::string& body, const std::string& authorization) {
  return Http(port, "POST /v1/resize HTTP/1.1\r\nHost: x\r\n" +
                        (authorization.empty() ? "" : "Authorization: " + authorization + "\r\n") +
                        "Content-Type: application/json\r\nConnection: close\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\n\r\n" + body);
}
std::string Get(uint16_t port, const std::string& target, const std::string& authorization) {
  return Http(port, "GET " + target + " HTTP/1.1\r\nHost: x\r\n" +
                        (authorization.empty() ? "" : "Authorization: " + authorization + "\r\n") +
                        "Connection: close\r\n\r\n");
}

TEST(SecurityTest, AResizeWithoutTheTokenIs401AndChangesNothing) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  MORPH_ASSERT_OK_AND_ASSIGN(Worker w, Join(*coord));
  ASSERT_TRUE(ReachGeneration({&w}, 1, Deadline::AfterMs(10000)));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().generation == 1; }));
  const uint16_t port = coord->http_port();
  const std::string body = R"({"world_size": 2, "reason": "not allowed"})";
  struct Case {
    std::string authorization, message;
  };
  const std::vector<Case> cases = {
      {"", "Authorization: missing; send \\\"Authorization: Bearer <job token>\\\""},
      {"Bearer wrong", "Authorization: not \\\"Bearer <job token>\\\" with this job's token"},
      {std::string("Bearer ") + kToken + "x", "with this job's token"},
      {std::string("Basic ") + kToken, "with this job's token"},
      {kToken, "with this job's token"},
  };
  for (const Case& c : cases) {
    std::string reply = Post(port, body, c.authorization);
    EXPECT_THAT(reply, HasSubstr("HTTP/1.1 401")) << c.authorization;
    EXPECT_THAT(reply, HasSubstr("WWW-Authenticate: Bearer")) << c.authorization;
    EXPECT_THAT(reply, HasSubstr(c.message)) << reply;
  }
  // Nothing reached the decider: no prepare for the worker, the snapshot is as before.
  Deadline quiet = Deadline::AfterMs(300);
  while (!quiet.Expired()) {
    StatusOr<WireMessage> m = w.client->Receive(Deadline::AfterMs(20));
    if (!m.ok()) {
      ASSERT_EQ(m.status().code(), StatusCode::kDeadlineExceeded) << m.status();
      continue;
    }
    EXPECT_FALSE(std::holds_alternative<PrepareMsg>(*m)) << "a change was prepared";
  }
  CoordinatorSnapshot s = coord->Snapshot();
  EXPECT_EQ(s.generation, 1);
  EXPECT_FALSE(s.resize_in_progress);
  EXPECT_FALSE(s.pending_generation.has_value());
  EXPECT_EQ(s.members.size(), 1u);
  // The same request with the token is accepted (the refusals were about the token).
  EXPECT_THAT(Post(port, body, std::string("Bearer ") + kToken), HasSubstr("HTTP/1.1 202"));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().resize_in_progress; }));
}

TEST(SecurityTest, WithTokenForReadsTheReadsNeedTheTokenToo) {
  CleanEnv env;
  ::setenv("MORPH_TOKEN", kToken, 1);
  ::setenv("MORPH_API_TOKEN_FOR_READS", "1", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(CoordinatorOptions o, CoordinatorOptions::FromEnv());
  EXPECT_TRUE(o.http.token_for_reads);
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  const uint16_t port = coord->http_port();
  for (const char* target : {"/v1/status", "/metrics"}) {
    EXPECT_THAT(Get(port, target, ""), HasSubstr("HTTP/1.1 401")) << target;
    EXPECT_THAT(Get(port, target, "Bearer wrong"), HasSubstr("HTTP/1.1 401")) << target;
    EXPECT_THAT(Get(port, target, std::string("Bearer ") + kToken), HasSubstr("HTTP/1.1 200"))
        << target;
  }
  // Without the setting, reads are open (a status page for the scheduler), writes are not.
  ::unsetenv("MORPH_API_TOKEN_FOR_READS");
  MORPH_ASSERT_OK_AND_ASSIGN(CoordinatorOptions open, CoordinatorOptions::FromEnv());
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord2, Coordinator::Start(open));
  EXPECT_THAT(Get(coord2->http_port(), "/v1/status", ""), HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(Post(coord2->http_port(), R"({"world_size": 2})", ""), HasSubstr("HTTP/1.1 401"));
}

// ---- where everything listens -----------------------------------------------------------------

TEST(SecurityTest, TheCoordinatorBindsLoopbackByDefault) {
  CleanEnv env;
  ::setenv("MORPH_TOKEN", kToken, 1);
  MORPH_ASSERT_OK_AND_ASSIGN(CoordinatorOptions o, CoordinatorOptions::FromEnv());
  EXPECT_EQ(o.address, "127.0.0.1");
  EXPECT_EQ(o.http.address, "127.0.0.1");
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  ExpectAllLoopback(::getpid(),
                    {PortOf(coord->control_address()), coord->store().port(), coord->http_port()});
  EXPECT_EQ(coord->control_address(),
            "127.0.0.1:" + std::to_string(PortOf(coord->control_address())));
}

TEST(SecurityTest, OpeningTheControlChannelLeavesTheApiOnLoopback) {
  CleanEnv env;
  ::setenv("MORPH_TOKEN", kToken, 1);
  ::setenv("MORPH_COORDINATOR_ADDR", "0.0.0.0", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(CoordinatorOptions o, CoordinatorOptions::FromEnv());
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  EXPECT_EQ(BoundAddress(::getpid(), PortOf(coord->control_address())), "0.0.0.0");
  EXPECT_EQ(BoundAddress(::getpid(), coord->store().port()), "0.0.0.0");
  EXPECT_EQ(BoundAddress(::getpid(), coord->http_port()), "127.0.0.1");
  // Opened up, it is still authenticated.
  EXPECT_THAT(Register(*coord, "wrong").status(),
              StatusIs(StatusCode::kUnauthenticated, "wrong job token"));
}

TEST(SecurityTest, MorphrunsLauncherBindsLoopback) {
  CleanEnv env;
  LauncherOptions o;
  o.workers = 1;
  o.argv = {"/bin/sleep", "30"};
  o.kill_grace_ms = 2000;
  MORPH_ASSERT_OK_AND_ASSIGN(auto launcher, Launcher::Start(std::move(o)));
  Coordinator& c = launcher->coordinator();
  ExpectAllLoopback(::getpid(), {PortOf(c.control_address()), c.store().port(), c.http_port()});
}

TEST(SecurityTest, MorphdBindsLoopback) {
  int out[2];
  ASSERT_EQ(::pipe2(out, O_CLOEXEC), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    for (char** e = environ; *e != nullptr;) {
      std::string kv = *e;
      if (kv.rfind("MORPH_", 0) == 0) {
        ::unsetenv(kv.substr(0, kv.find('=')).c_str());
      } else {
        ++e;
      }
    }
    ::setenv("MORPH_TOKEN", kToken, 1);
    ::execl(MORPHD, MORPHD, "--initial-world", "1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  // {"control":"127.0.0.1:P","store":"127.0.0.1:Q","http_port":R}
  std::string line;
  Deadline deadline = Deadline::AfterMs(10000);
  while (line.find('\n') == std::string::npos && !deadline.Expired()) {
    pollfd p{.fd = out[0], .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[512];
    ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  auto port_after = [&](const std::string& key) -> uint16_t {
    size_t at = line.find(key);
    if (at == std::string::npos) return 0;
    at += key.size();
    return static_cast<uint16_t>(std::strtoul(line.c_str() + at, nullptr, 10));
  };
  uint16_t control = port_after("\"control\":\"127.0.0.1:");
  uint16_t store = port_after("\"store\":\"127.0.0.1:");
  uint16_t http = port_after("\"http_port\":");
  EXPECT_NE(control, 0) << line;
  EXPECT_NE(store, 0) << line;
  EXPECT_NE(http, 0) << line;
  ExpectAllLoopback(pid, {control, store, http});
  ::kill(pid, SIGTERM);
  int status = 0;
  for (int i = 0; i < 100 && ::waitpid(pid, &status, WNOHANG) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (::waitpid(pid, &status, WNOHANG) == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
}

TEST(SecurityTest, TheRuntimeAndGlooBindLoopbackByDefault) {
  CleanEnv env;
  MORPH_ASSERT_OK_AND_ASSIGN(morph::Options o, morph::Options::FromEnv());
  EXPECT_EQ(o.coordinator_bind, "127.0.0.1");
  EXPECT_EQ(o.api_address, "127.0.0.1");
  MORPH_ASSERT_OK_AND_ASSIGN(GlooOptions gloo, GlooOptions::FromEnv());
  EXPECT_EQ(gloo.hostname, "127.0.0.1");
  EXPECT_EQ(gloo.iface, "");
  // A worker that hosts its coordinator (the bootstrap of a lone process).
  o.bootstrap = Bootstrap::kHost;
  o.model = {.num_layers = 1, .global_batch = 4};
  o.dataset_samples = 8;
  o.handle_sigterm = false;
  o.start_timeout_ms = 30000;
  {
    MORPH_ASSERT_OK_AND_ASSIGN(auto rt, Runtime::Start(o, [](State& s) {
                                 return s.AddTensor("x", {4}, DType::kF32, Layout::Layer(0));
                               }));
    std::vector<Listener> ls = ListeningSockets(::getpid());
    EXPECT_GE(ls.size(), 3u) << Describe(ls);  // control, store, scheduler API at least
    ExpectAllLoopback(::getpid(), {});
  }
  // Gloo's data plane, two ranks with the default options. A pair listens until its peer
  // connected: rank 0 alone, waiting for rank 1 in the rendezvous, shows its listeners.
  MemoryStore store(std::make_shared<KvTable>(), 0);
  MORPH_ASSERT_OK_AND_ASSIGN(auto device, GlooDevice::Create(gloo));
  std::vector<std::unique_ptr<GlooCommunicator>> comms(2);
  std::vector<Status> built(2);
  auto build = [&](int r) {
    StatusOr<std::unique_ptr<GlooCommunicator>> c =
        GlooCommunicator::Create(store, "world", r, 2, device, Deadline::AfterMs(20000));
    built[r] = c.status();
    if (c.ok()) comms[r] = *std::move(c);
  };
  std::set<std::string> before;
  for (const Listener& l : ListeningSockets(::getpid())) {
    before.insert(l.address + ":" + std::to_string(l.port));
  }
  std::thread rank0(build, 0);
  std::vector<Listener> gloo_listeners;
  WaitFor([&] {
    gloo_listeners.clear();
    for (const Listener& l : ListeningSockets(::getpid())) {
      if (before.count(l.address + ":" + std::to_string(l.port)) == 0) gloo_listeners.push_back(l);
    }
    return !gloo_listeners.empty();
  });
  EXPECT_FALSE(gloo_listeners.empty()) << "rank 0 of the Gloo rendezvous never listened";
  for (const Listener& l : gloo_listeners) {
    EXPECT_EQ(l.address, "127.0.0.1") << "Gloo listens on " << Describe(gloo_listeners);
  }
  std::thread rank1(build, 1);
  rank0.join();
  rank1.join();
  MORPH_ASSERT_OK(built[0]);
  MORPH_ASSERT_OK(built[1]);
}

}  // namespace
}  // namespace morph
