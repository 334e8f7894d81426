// The coordinator's I/O shell end to end: a real Coordinator (control channel, store, scheduler
// API) and fake workers in threads, each a real ControlClient driving the real AgentCore. The
// training loop is simulated: a worker begins a step whenever its core lets it.
#include "runtime/coordinator/coordinator.h"

#include <arpa/inet.h>
#include <glog/logging.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/testing.h"
#include "reshard/checkpoint.h"
#include "runtime/agent/agent_core.h"
#include "runtime/agent/control_client.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "coordinator-test-token";

JobManifest Manifest() {
  JobManifest m;
  m.model.num_layers = 2;
  m.model.global_batch = 64;
  for (int l = 0; l < 2; ++l) {
    m.tensors.push_back(TensorSpec{"layers." + std::to_string(l) + ".w", DType::kF32, {8, 16},
                                   Layout::Layer(l)});
  }
  m.scalars = {ScalarSpec{"step", 8}};
  return m;
}

struct WorkerOptions {
  bool heartbeats = true;
  std::string token = kToken;
  JobManifest manifest = Manifest();
};

// One worker: a control connection and the pure agent, driven by a thread.
class FakeWorker {
 public:
  using Options = WorkerOptions;
  explicit FakeWorker(std::string address, Options o = {})
      : address_(std::move(address)), o_(std::move(o)) {}
  ~FakeWorker() { Stop(); }

  Status Connect() {
    StatusOr<std::unique_ptr<ControlClient>> c = ControlClient::Connect(
        address_, HelloMsg{.token = o_.token, .host = "test-host", .pid = ::getpid()},
        RegisterMsg{.manifest = o_.manifest}, Deadline::AfterMs(10000));
    if (!c.ok()) return c.status();
    client_ = *std::move(c);
    core_ = std::make_unique<AgentCore>(client_->welcome().worker);
    thread_ = std::thread([this] { Loop(); });
    return Status::Ok();
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // Training ended: send Done, then close.
  void FinishTraining() { finish_ = true; }
  // SIGTERM / Runtime::Leave(): ask the coordinator to let this worker go.
  void AskToLeave() { Send(LeaveMsg{.reason = "preempted"}); }

  WorkerId id() const { return client_->welcome().worker; }
  const WelcomeMsg& welcome() const { return client_->welcome(); }
  int64_t generation() const {
    std::lock_guard<std::mutex> l(mu_);
    return core_->generation().id;
  }
  int rank() const {
    std::lock_guard<std::mutex> l(mu_);
    return core_->rank();
  }
  Generation gen() const {
    std::lock_guard<std::mutex> l(mu_);
    return core_->generation();
  }
  bool finished() const {
    std::lock_guard<std::mutex> l(mu_);
    return core_->finished();
  }
  bool closed() const { return closed_.load(); }
  std::string close_status() const {
    std::lock_guard<std::mutex> l(mu_);
    return close_status_;
  }
  // Names of the frames received and sent, in order ("<prepare" / ">step_report").
  std::vector<std::string> log() const {
    std::lock_guard<std::mutex> l(mu_);
    return log_;
  }
  bool Saw(const std::string& what) const {
    for (const std::string& s : log()) {
      if (s == what) return true;
    }
    return false;
  }

 private:
  void Send(const WireMessage& m) {
    {
      std::lock_guard<std::mutex> l(mu_);
      log_.push_back(">" + std::string(WireTypeName(static_cast<uint16_t>(m.index() + 1))));
    }
    (void)client_->Send(m);
  }
  void Loop() {
    auto last_hb = std::chrono::steady_clock::now();
    while (!stop_) {
      if (finish_) {
        Send(DoneMsg{});
        client_->Close();
        closed_ = true;
        return;
      }
      if (o_.heartbeats && std::chrono::steady_clock::now() - last_hb > std::chrono::milliseconds(50)) {
        Send(HeartbeatMsg{.step = next_step_});
        last_hb = std::chrono::steady_clock::now();
      }
      StatusOr<WireMessage> m = client_->Receive(Deadline::AfterMs(2));
      if (!m.ok() && m.status().code() != StatusCode::kDeadlineExceeded) {
        std::lock_guard<std::mutex> l(mu_);
        close_status_ = m.status().ToString();
        closed_ = true;
        return;
      }
      std::optional<WireMessage> reply;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (m.ok()) {
          log_.push_back("<" + std::string(WireTypeName(static_cast<uint16_t>(m->index() + 1))));
          if (auto* p = std::get_if<PrepareMsg>(&*m)) {
            if (p->change.recovery) {
              core_->OnRecoveryPrepare(*p);
              if (auto r = core_->OnRecoveryBuilt(p->next.id)) reply = *r;
            } else if (auto r = core_->OnPrepare(*p, next_step_)) {
              reply = *r;
            }
          } else if (auto* ab = std::get_if<AbortMsg>(&*m)) {
            core_->OnAbort(*ab);
          } else if (auto* c = std::get_if<CommitMsg>(&*m)) {
            core_->OnCommit(*c);
          } else if (auto* a = std::get_if<AbandonMsg>(&*m)) {
            core_->OnAbandon(*a);
          } else if (auto* o = std::get_if<OutcomeMsg>(&*m)) {
            core_->OnOutcome(*o);
          } else if (auto* r = std::get_if<ReleaseMsg>(&*m)) {
            core_->OnRelease(*r);
          }
        }
        if (!reply) {
          switch (core_->AtStep(next_step_)) {
            case AgentCore::Action::kProceed:
              ++next_step_;  // one simulated training step
              break;
            case AgentCore::Action::kSwitch: {
              int64_t s = core_->pending_commit()->next.start_step;
              next_step_ = s + 1;  // the switch step itself runs in the new generation
              reply = core_->SwitchDone(true);
              break;
            }
            case AgentCore::Action::kReport:  // a recovery (these simulated workers never fail)
              reply = core_->OnRecoveryState(next_step_, true, -1, -1);
              break;
            case AgentCore::Action::kCannotSwitch:
              reply = core_->SwitchDone(false, "step failed");
              break;
            case AgentCore::Action::kWait:
            case AgentCore::Action::kFinished:
              break;
          }
        }
      }
      if (reply) Send(*reply);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  const std::string address_;
  const Options o_;
  std::unique_ptr<ControlClient> client_;
  mutable std::mutex mu_;
  std::unique_ptr<AgentCore> core_;
  int64_t next_step_ = 0;
  std::vector<std::string> log_;
  std::string close_status_;
  std::atomic<bool> stop_{false}, finish_{false}, closed_{false};
  std::thread thread_;
};

bool WaitFor(const std::function<bool()>& pred, int ms = 10000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

CoordinatorOptions Options(int initial_world) {
  CoordinatorOptions o;
  o.token = kToken;
  o.initial_world = initial_world;
  o.heartbeat_timeout_ms = 10000;
  return o;
}

std::vector<std::unique_ptr<FakeWorker>> StartWorkers(const Coordinator& c, int n,
                                                      FakeWorker::Options o = {}) {
  std::vector<std::unique_ptr<FakeWorker>> w;
  for (int i = 0; i < n; ++i) {
    w.push_back(std::make_unique<FakeWorker>(c.control_address(), o));
    Status s = w.back()->Connect();
    EXPECT_TRUE(s.ok()) << s;
  }
  return w;
}

bool AllIn(const std::vector<std::unique_ptr<FakeWorker>>& w, int64_t gen) {
  for (const auto& x : w) {
    if (x->generation() != gen) return false;
  }
  return true;
}

TEST(CoordinatorTest, FourRegisterThenGenerationOneIsCommittedToAll) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(4)));
  auto w = StartWorkers(*coord, 4);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  std::set<int> ranks;
  for (const auto& x : w) {
    ranks.insert(x->rank());
    EXPECT_EQ(x->gen(), w[0]->gen());
    EXPECT_EQ(x->welcome().store_address, coord->store_address());
    EXPECT_EQ(x->welcome().first_generation, 1);
    EXPECT_TRUE(x->Saw("<commit"));
    EXPECT_TRUE(x->Saw(">applied"));
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(w[0]->gen().config.world(), 4);
  EXPECT_NE(w[0]->gen().plan_digest, 0u);
  ASSERT_TRUE(WaitFor([&] {
    CoordinatorSnapshot s = coord->Snapshot();
    return s.generation == 1 && s.members.size() == 4 && s.phase == "stable";
  }));
  EXPECT_EQ(coord->Snapshot().members[0].host, "test-host");
  // The store serves generation 1 (only the coordinator advanced it).
  EXPECT_EQ(coord->store().table()->min_generation(), 1);
  // A late registration sees the current generation whole in its Welcome.
  auto late = StartWorkers(*coord, 1);
  EXPECT_EQ(late[0]->welcome().current, w[0]->gen());
}

TEST(CoordinatorTest, ResizeToTwoPreparesCommitsAndReleasesTheOthers) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(4)));
  auto w = StartWorkers(*coord, 4);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  MORPH_ASSERT_OK(coord->Resize(ResizeRequest{.world_size = 2, .reason = "test"},
                                Deadline::AfterMs(5000)));
  ASSERT_TRUE(WaitFor([&] {
    int in2 = 0, done = 0;
    for (const auto& x : w) {
      in2 += x->generation() == 2 && x->rank() >= 0 ? 1 : 0;
      done += x->finished() ? 1 : 0;
    }
    return in2 == 2 && done == 2;
  }));
  Generation g2;
  for (const auto& x : w) {
    if (!x->finished()) g2 = x->gen();
  }
  EXPECT_EQ(g2.config.world(), 2);
  for (const auto& x : w) {
    SCOPED_TRACE("worker " + std::to_string(x->id()));
    // Every old rank took part: prepare, its step report, the commit, applied, the outcome.
    for (const char* f : {"<prepare", ">step_report", "<commit", ">applied", "<outcome"}) {
      EXPECT_TRUE(x->Saw(f)) << f;
    }
    // The released ones are exactly those without a rank in generation 2.
    EXPECT_EQ(x->finished(), g2.RankOf(x->id()) < 0);
  }
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().reconfigurations == 1; }));
  CoordinatorSnapshot s = coord->Snapshot();
  ASSERT_TRUE(s.last_reconfiguration.has_value());
  EXPECT_EQ(s.last_reconfiguration->from_world, 4);
  EXPECT_EQ(s.last_reconfiguration->to_world, 2);
  EXPECT_GE(s.last_reconfiguration->total_ms, s.last_reconfiguration->agree_ms);
  EXPECT_EQ(coord->store().table()->min_generation(), 2);
  // A second resize beyond max_world is refused with the decider's message.
  EXPECT_THAT(coord->Resize(ResizeRequest{.world_size = 1 << 20}, Deadline::AfterMs(5000)),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("world_size: must be in [1, 65536], got 1048576")));
}

TEST(CoordinatorTest, AJoinerGrowsTheJob) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(2)));
  auto w = StartWorkers(*coord, 2);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  auto more = StartWorkers(*coord, 1);
  w.push_back(std::move(more[0]));
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 2); }));
  EXPECT_EQ(w[0]->gen().config.world(), 3);
  EXPECT_GE(w[2]->rank(), 0);
  EXPECT_TRUE(w[2]->Saw("<prepare"));  // a joiner hears the proposal
  EXPECT_FALSE(w[2]->Saw(">step_report"));  // but only old ranks promise a step
}

TEST(CoordinatorTest, ALeaveRequestShrinksTheJobAndTheLeaverFinishes) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(3)));
  auto w = StartWorkers(*coord, 3);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  w[1]->AskToLeave();
  ASSERT_TRUE(WaitFor([&] { return w[1]->finished() && w[0]->generation() == 2; }));
  EXPECT_EQ(w[0]->gen().config.world(), 2);
  EXPECT_LT(w[0]->gen().RankOf(w[1]->id()), 0);
  EXPECT_TRUE(w[1]->Saw(">leave"));
  EXPECT_TRUE(w[1]->Saw("<outcome"));  // it sent its state away, then was done
}

// A joiner that registers after the job completed (a grow accepted in its last steps) is
// released, not refused: its Start returns with Finished() and it exits 0 (issue 33, item 12).
TEST(CoordinatorTest, AfterTheJobCompletedRegistrationIsReleased) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  auto w = StartWorkers(*coord, 1);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  w[0]->FinishTraining();
  MORPH_ASSERT_OK(coord->Wait(Deadline::AfterMs(5000)));
  FakeWorker late(coord->control_address());
  EXPECT_THAT(late.Connect(),
              StatusIs(StatusCode::kCancelled, HasSubstr("released this worker at its registration")));
}

TEST(CoordinatorTest, WrongTokenIsUnauthenticated) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  FakeWorker bad(coord->control_address(), {.token = "not-the-token"});
  EXPECT_THAT(bad.Connect(), StatusIs(StatusCode::kUnauthenticated, "wrong job token"));
  EXPECT_EQ(coord->stats().workers_registered, 0);
  EXPECT_EQ(coord->stats().handshakes_refused, 1);
}

TEST(CoordinatorTest, ADifferentManifestIsRefusedNamingTheTensor) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(2)));
  auto w = StartWorkers(*coord, 1);
  JobManifest other = Manifest();
  other.tensors[1].shape = {8, 32};
  FakeWorker bad(coord->control_address(), {.manifest = other});
  EXPECT_THAT(bad.Connect(),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("registration differs from the job's: tensor 'layers.1.w' (#1): "
                                 "shape [8, 16] vs [8, 32]")));
  JobManifest invalid = Manifest();
  invalid.dataset_samples = 0;
  FakeWorker bad2(coord->control_address(), {.manifest = invalid});
  EXPECT_THAT(bad2.Connect(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("dataset_samples")));
  EXPECT_EQ(coord->stats().workers_registered, 1);
}

// A raw TCP connection to the coordinator.
class RawConn {
 public:
  explicit RawConn(const std::string& address) {
    size_t colon = address.rfind(':');
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{.tv_sec = 5, .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ok_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~RawConn() { ::close(fd_); }
  bool ok() const { return ok_; }
  void Write(std::string_view b) { (void)::send(fd_, b.data(), b.size(), MSG_NOSIGNAL); }
  // Everything until the peer closes (or 5 s pass).
  std::string ReadToEnd() {
    std::string out;
    char buf[4096];
    while (true) {
      ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
};

std::string Header(WireType type, uint32_t length) {
  std::string h = EncodeFrame(AbandonMsg{}).substr(0, kFrameHeaderBytes);
  h[6] = static_cast<char>(static_cast<uint16_t>(type) & 0xff);
  h[7] = static_cast<char>(static_cast<uint16_t>(type) >> 8);
  for (int i = 0; i < 4; ++i) h[8 + i] = static_cast<char>(length >> (8 * i));
  return h;
}

TEST(CoordinatorTest, AnOversizedHeaderClosesTheConnectionWithoutAllocating) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(2)));
  {
    // Before authentication: a Hello announcing 1 GiB.
    RawConn raw(coord->control_address());
    ASSERT_TRUE(raw.ok());
    raw.Write(Header(WireType::kHello, 1u << 30));
    std::string reply = raw.ReadToEnd();  // an ErrorMsg, then the close
    MORPH_ASSERT_OK_AND_ASSIGN(WireMessage m, DecodeFrame(reply));
    ASSERT_TRUE(std::holds_alternative<ErrorMsg>(m));
    EXPECT_EQ(std::get<ErrorMsg>(m).code, static_cast<int>(StatusCode::kInvalidArgument));
    EXPECT_THAT(std::get<ErrorMsg>(m).message, HasSubstr("hello body of 1073741824 bytes exceeds"));
  }
  {
    // After registering: a Commit header announcing 4 GiB - 1.
    RawConn raw(coord->control_address());
    raw.Write(EncodeFrame(HelloMsg{.token = kToken}));
    raw.Write(EncodeFrame(RegisterMsg{.manifest = Manifest()}));
    raw.Write(Header(WireType::kStepReport, 0xffffffffu));
    std::string reply = raw.ReadToEnd();
    // Welcome, then the error naming the frame.
    std::vector<WireMessage> frames;
    std::string_view rest = reply;
    while (rest.size() >= kFrameHeaderBytes) {
      MORPH_ASSERT_OK_AND_ASSIGN(FrameHeader h, DecodeHeader(rest));
      MORPH_ASSERT_OK_AND_ASSIGN(WireMessage m,
                                 DecodeFrame(rest.substr(0, kFrameHeaderBytes + h.length)));
      frames.push_back(std::move(m));
      rest.remove_prefix(kFrameHeaderBytes + h.length);
    }
    ASSERT_GE(frames.size(), 2u);
    EXPECT_TRUE(std::holds_alternative<WelcomeMsg>(frames.front()));
    ASSERT_TRUE(std::holds_alternative<ErrorMsg>(frames.back()));
    EXPECT_THAT(std::get<ErrorMsg>(frames.back()).message,
                HasSubstr("step_report body of 4294967295 bytes exceeds 33554432"));
  }
  {
    // Another wire version is refused naming both versions.
    RawConn raw(coord->control_address());
    std::string hello = EncodeFrame(HelloMsg{.token = kToken});
    hello[4] = static_cast<char>(kWireVersion + 1);  // the u16 version's low byte
    raw.Write(hello);
    MORPH_ASSERT_OK_AND_ASSIGN(WireMessage m, DecodeFrame(raw.ReadToEnd()));
    ASSERT_TRUE(std::holds_alternative<ErrorMsg>(m));
    EXPECT_EQ(std::get<ErrorMsg>(m).code, static_cast<int>(StatusCode::kFailedPrecondition));
    EXPECT_THAT(std::get<ErrorMsg>(m).message,
                HasSubstr("wire version " + std::to_string(kWireVersion + 1) +
                          ", this side speaks " + std::to_string(kWireVersion)));
  }
  // The coordinator goes on serving: a real worker still gets in.
  auto w = StartWorkers(*coord, 2);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  EXPECT_EQ(coord->stats().workers_registered, 3);
}

TEST(CoordinatorTest, ASilentWorkerIsLostAfterTheTimeout) {
  CoordinatorOptions o = Options(2);
  o.heartbeat_timeout_ms = 300;
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  auto talker = StartWorkers(*coord, 1);
  auto silent = StartWorkers(*coord, 1, {.heartbeats = false});
  ASSERT_TRUE(WaitFor([&] { return AllIn(talker, 1) && AllIn(silent, 1); }));
  ASSERT_TRUE(WaitFor([&] { return silent[0]->closed(); }, 5000));
  EXPECT_THAT(silent[0]->close_status(), HasSubstr("declared lost: no heartbeat for more than 300"));
  // The survivor carries on alone in generation 2.
  ASSERT_TRUE(WaitFor([&] { return AllIn(talker, 2); }));
  EXPECT_EQ(talker[0]->gen().ranks, std::vector<WorkerId>{talker[0]->id()});
}

// A worker on the coordinator's host whose process dies while its connection stays open (here
// a grandchild holds it; for real, the kernel freeing a SIGKILLed process's memory before it
// closes its files) is lost at once, not after the heartbeat timeout.
TEST(CoordinatorTest, ASameHostWorkerWhoseProcessExitsIsLostBeforeItsConnectionCloses) {
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  // Fork before any thread starts (the coordinator's): the child gets the address by a pipe.
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(to_child[1]);
    close(from_child[0]);
    char address[256] = {};
    if (read(to_child[0], address, sizeof(address) - 1) <= 0) _exit(1);
    auto c = ControlClient::Connect(address,
                                    HelloMsg{.token = kToken, .host = host, .pid = ::getpid()},
                                    RegisterMsg{.manifest = Manifest()}, Deadline::AfterMs(10000));
    if (!c.ok()) _exit(2);
    pid_t holder = fork();  // keeps the connection open after this process dies
    if (holder == 0) {
      for (;;) pause();
    }
    (void)!write(from_child[1], &holder, sizeof(holder));
    for (;;) pause();
  }
  close(to_child[0]);
  close(from_child[1]);
  CoordinatorOptions o = Options(2);
  o.heartbeat_timeout_ms = 60000;
  o.local_watch_ms = 10;
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  const std::string address = coord->control_address();
  ASSERT_EQ(write(to_child[1], address.data(), address.size()),
            static_cast<ssize_t>(address.size()));
  close(to_child[1]);
  pid_t holder = -1;
  ASSERT_EQ(read(from_child[0], &holder, sizeof(holder)), static_cast<ssize_t>(sizeof(holder)));
  close(from_child[0]);
  auto talker = StartWorkers(*coord, 1);
  ASSERT_TRUE(WaitFor([&] { return AllIn(talker, 1); }));
  ASSERT_EQ(talker[0]->gen().ranks.size(), 2u);
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(child, SIGKILL), 0);
  const bool recovered = WaitFor([&] { return AllIn(talker, 2); }, 10000);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  kill(holder, SIGKILL);
  waitpid(child, nullptr, 0);
  ASSERT_TRUE(recovered) << "still in generation " << talker[0]->generation();
  EXPECT_LT(seconds, 5.0);  // against a 60 s heartbeat timeout
  EXPECT_EQ(talker[0]->gen().ranks, std::vector<WorkerId>{talker[0]->id()});
}

TEST(CoordinatorTest, HttpResizeReachesTheDecider) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(3)));
  ASSERT_NE(coord->http_port(), 0);
  auto w = StartWorkers(*coord, 3);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  auto post = [&](const std::string& body, const std::string& token) {
    RawConn raw("127.0.0.1:" + std::to_string(coord->http_port()));
    raw.Write("POST /v1/resize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token +
              "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
              std::to_string(body.size()) + "\r\n\r\n" + body);
    return raw.ReadToEnd();
  };
  EXPECT_THAT(post(R"({"world_size": 2})", "wrong"), HasSubstr("HTTP/1.1 401"));
  std::string reply = post(R"({"world_size": 2, "reason": "scheduler"})", kToken);
  EXPECT_THAT(reply, HasSubstr("HTTP/1.1 202"));
  EXPECT_THAT(reply, HasSubstr("accepted"));
  ASSERT_TRUE(WaitFor([&] {
    int in2 = 0;
    for (const auto& x : w) in2 += x->generation() == 2 && x->rank() >= 0 ? 1 : 0;
    return in2 == 2;
  }));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().generation == 2; }));
  RawConn raw("127.0.0.1:" + std::to_string(coord->http_port()));
  raw.Write("GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string status = raw.ReadToEnd();
  EXPECT_THAT(status, HasSubstr("\"generation\": 2")) << status;
  EXPECT_THAT(status, HasSubstr("test-host"));
}

// One resize path: the scheduler API and Coordinator::Resize share one counter (the 202's id is
// the one after the C++ call's) and one validation (the same words for the same mistake).
TEST(CoordinatorTest, BothResizeDoorsShareOneCounterAndOneValidation) {
  CoordinatorOptions o = Options(2);
  o.max_world = 64;
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  auto w = StartWorkers(*coord, 2);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  auto post = [&](const std::string& body) {
    RawConn raw("127.0.0.1:" + std::to_string(coord->http_port()));
    raw.Write("POST /v1/resize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
              std::string(kToken) +
              "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
              std::to_string(body.size()) + "\r\n\r\n" + body);
    return raw.ReadToEnd();
  };
  Status cpp = coord->Resize(ResizeRequest{.world_size = 0}, Deadline::AfterMs(5000));
  EXPECT_EQ(cpp.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cpp.message(), "world_size: must be in [1, 64], got 0");
  EXPECT_THAT(post(R"({"world_size": 0})"), HasSubstr("\"world_size: must be in [1, 64], got 0\""));
  MORPH_EXPECT_OK(coord->Resize(ResizeRequest{.world_size = 2}, Deadline::AfterMs(5000)));
  // Requests 1 (C++), 2 (HTTP, refused by the parser: not numbered), 3 (C++): the next is 3.
  std::string accepted = post(R"({"world_size": 2})");
  EXPECT_THAT(accepted, HasSubstr("\"request_id\":3")) << accepted;
}

TEST(CoordinatorTest, DoneFromEveryWorkerCompletesTheJob) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(2)));
  auto w = StartWorkers(*coord, 2);
  ASSERT_TRUE(WaitFor([&] { return AllIn(w, 1); }));
  EXPECT_THAT(coord->Wait(Deadline::AfterMs(50)), StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("running")));
  w[0]->FinishTraining();
  ASSERT_TRUE(WaitFor([&] { return w[0]->closed(); }));
  // One closed after Done: no change follows, the job is not complete yet.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_THAT(coord->Wait(Deadline::AfterMs(50)), StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("running")));
  EXPECT_EQ(w[1]->generation(), 1);
  w[1]->FinishTraining();
  MORPH_EXPECT_OK(coord->Wait(Deadline::AfterMs(5000)));
  ASSERT_TRUE(WaitFor([&] { return coord->Snapshot().phase == "complete"; }));
}

TEST(CoordinatorTest, OptionsFromTheEnvironment) {
  ::setenv("MORPH_TOKEN", "env-token", 1);
  ::setenv("MORPH_COORDINATOR_PORT", "0", 1);
  ::setenv("MORPH_INITIAL_WORLD", "3", 1);
  ::setenv("MORPH_MAX_WORLD", "8", 1);
  ::setenv("MORPH_HEARTBEAT_TIMEOUT_MS", "2500", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(CoordinatorOptions o, CoordinatorOptions::FromEnv());
  EXPECT_EQ(o.token, "env-token");
  EXPECT_EQ(o.http.token, "env-token");  // read once, handed to the scheduler API
  EXPECT_EQ(o.address, "127.0.0.1");
  EXPECT_EQ(o.initial_world, 3);
  EXPECT_EQ(o.max_world, 8);
  EXPECT_EQ(o.heartbeat_timeout_ms, 2500);
  ::setenv("MORPH_INITIAL_WORLD", "9", 1);
  EXPECT_THAT(CoordinatorOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_INITIAL_WORLD")));
  ::setenv("MORPH_INITIAL_WORLD", "three", 1);
  EXPECT_THAT(CoordinatorOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_INITIAL_WORLD")));
  for (const char* v : {"MORPH_TOKEN", "MORPH_COORDINATOR_PORT", "MORPH_INITIAL_WORLD",
                        "MORPH_MAX_WORLD", "MORPH_HEARTBEAT_TIMEOUT_MS"}) {
    ::unsetenv(v);
  }
}

TEST(CoordinatorTest, StartRefusesBadOptionsAndStopIsIdempotent) {
  CoordinatorOptions o = Options(1);
  o.token = "";
  EXPECT_THAT(Coordinator::Start(o).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("token")));
  o = Options(0);
  EXPECT_THAT(Coordinator::Start(o).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("initial_world")));
  o = Options(1);
  o.address = "not an ip";
  EXPECT_THAT(Coordinator::Start(o).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("address")));
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(Options(1)));
  coord->Stop();
  coord->Stop();
  EXPECT_THAT(coord->Wait(Deadline::AfterMs(10)), StatusIs(StatusCode::kAborted, HasSubstr("stopped")));
  EXPECT_THAT(coord->Resize(ResizeRequest{.world_size = 1}, Deadline::AfterMs(10)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("stopped")));
}

// A job on a checkpoint folder numbers its generations after the newest one a folder names, so
// that it never writes into an earlier run's folder. A name whose generation leaves no room to
// count on (2^63 - 1: the next would wrap to a negative number, and the job used to start again
// from 1, reusing the earlier run's names) stops the start, naming the folder; the largest
// generation that leaves room (kMaxCheckpointGeneration) is followed as any other.
TEST(CoordinatorTest, ACheckpointFolderWhoseGenerationCannotBeFollowedStopsTheStart) {
  char tmpl[] = "/tmp/morph_coordinator_test_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string wrapping = dir + "/step-1-g9223372036854775807";
  ASSERT_EQ(::mkdir(wrapping.c_str(), 0755), 0);
  CoordinatorOptions o = Options(1);
  o.checkpoint_dir = dir;
  StatusOr<std::unique_ptr<Coordinator>> coord = Coordinator::Start(o);
  if (coord.ok()) {
    auto w = StartWorkers(**coord, 1);
    WaitFor([&] { return w[0]->generation() != 0; });
    ADD_FAILURE() << "the job started beside " << wrapping << ", numbering generations from "
                  << w[0]->generation();
  } else {
    EXPECT_THAT(coord.status(), StatusIs(StatusCode::kFailedPrecondition,
                                         HasSubstr("step-1-g9223372036854775807")));
  }
  ASSERT_EQ(::rmdir(wrapping.c_str()), 0);
  const std::string largest = dir + "/step-1-g4611686018427387904";  // 2^62
  ASSERT_EQ(::mkdir(largest.c_str(), 0755), 0);
  MORPH_ASSERT_OK_AND_ASSIGN(auto job, Coordinator::Start(o));
  auto w = StartWorkers(*job, 1);
  ASSERT_TRUE(WaitFor([&] { return w[0]->generation() != 0; }));
  EXPECT_EQ(w[0]->generation(), (int64_t{1} << 62) + 1);
  EXPECT_EQ(w[0]->welcome().first_generation, (int64_t{1} << 62) + 1);
  w.clear();
  job.reset();
  std::filesystem::remove_all(dir);
  // Nor may a first generation be set beyond it.
  o = Options(1);
  o.first_generation = (int64_t{1} << 62) + 2;
  EXPECT_THAT(Coordinator::Start(o).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("first_generation")));
}

// Saves a checkpoint of Manifest()'s tensors and scalars at `step` (one rank) under `dir`.
void SaveManifestCheckpoint(const std::string& dir, int64_t step, int64_t generation) {
  const JobManifest m = Manifest();
  std::vector<std::vector<char>> bytes;
  std::vector<CheckpointPiece> pieces;
  bytes.reserve(m.tensors.size() + m.scalars.size());
  auto add = [&](TensorInfo info) {
    const Box box = Box::FromShape(info.shape);
    bytes.emplace_back(static_cast<size_t>(*box.NumElements() * DTypeSize(info.dtype)),
                       static_cast<char>(step));
    pieces.push_back(
        {std::move(info), *Shard::Whole(box),
         ConstBufferView(bytes.back().data(), bytes.back().size(), MemoryKind::kHost)});
  };
  for (const TensorSpec& t : m.tensors) add({t.name, t.dtype, t.shape, {}});
  for (const ScalarSpec& sc : m.scalars) add({"scalar:" + sc.name, DType::kU8, {sc.bytes}, {}});
  const std::string path =
      dir + "/step-" + std::to_string(step) + "-g" + std::to_string(generation);
  MORPH_ASSERT_OK_AND_ASSIGN(auto save, SaveCheckpointAsync(path, 0, 1, step, "", pieces));
  MORPH_ASSERT_OK(save->Wait(Deadline::AfterMs(60000)));
}

class WarningSink : public google::LogSink {
 public:
  void send(google::LogSeverity severity, const char*, const char*, int, const struct ::tm*,
            const char* message, size_t len) override {
    if (severity < google::GLOG_WARNING) return;
    std::lock_guard<std::mutex> l(mu_);
    lines_ += std::string(message, len) + "\n";
  }
  std::string lines() {
    std::lock_guard<std::mutex> l(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::string lines_;
};

// Resume at start with one flipped byte in the newest checkpoint's data (issue 22): the job
// resumes from the newest checkpoint that verifies (step 4), with a WARNING naming the one passed
// over and the steps lost; MORPH_RESUME=always and auto on a restart alike. With every complete
// checkpoint damaged the job does not start (DATA_LOSS naming the newest).
TEST(CoordinatorTest, ResumePassesOverADamagedNewestCheckpoint) {
  char tmpl[] = "/tmp/morph_coordinator_test_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  SaveManifestCheckpoint(dir, 4, 1);
  SaveManifestCheckpoint(dir, 8, 1);
  auto flip = [&](int64_t step) {
    std::fstream f(dir + "/step-" + std::to_string(step) + "-g1/rank-00000/data.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put(static_cast<char>(step ^ 0x40));
  };
  flip(8);
  for (const auto& [mode, restarts] : {std::pair{ResumeMode::kAlways, 0}, {ResumeMode::kAuto, 1}}) {
    SCOPED_TRACE(std::string(ResumeModeName(mode)));
    WarningSink sink;
    google::AddLogSink(&sink);
    CoordinatorOptions o = Options(1);
    o.checkpoint_dir = dir;
    o.resume = mode;
    o.restart_count = restarts;
    MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
    auto w = StartWorkers(*coord, 1);
    const bool started = WaitFor([&] { return w[0]->generation() != 0; });
    google::RemoveLogSink(&sink);
    ASSERT_TRUE(started);
    EXPECT_EQ(w[0]->gen().start_step, 4);
    const std::string warnings = sink.lines();
    EXPECT_NE(warnings.find(dir + "/step-8-g1"), std::string::npos) << warnings;
    EXPECT_NE(warnings.find("checksum mismatch"), std::string::npos) << warnings;
    EXPECT_NE(warnings.find("4 steps"), std::string::npos) << warnings;
  }
  flip(4);
  CoordinatorOptions o = Options(1);
  o.checkpoint_dir = dir;
  o.resume = ResumeMode::kAlways;
  MORPH_ASSERT_OK_AND_ASSIGN(auto coord, Coordinator::Start(o));
  auto w = StartWorkers(*coord, 1);
  EXPECT_THAT(coord->Wait(Deadline::AfterMs(10000)),
              StatusIs(StatusCode::kDataLoss, HasSubstr(dir + "/step-8-g1")));
  w.clear();
  coord.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace morph
