// morphctl against a real HttpServer on loopback (fake coordinator callbacks): output, exit
// codes and the server's messages for status, resize/add/remove, watch, and bad input (world
// size 0, missing and wrong token, unreachable or silent address, malformed arguments), and a
// server's hostile text (control characters, escapes) reaching the terminal escaped. The
// last tests run the morphctl binary itself (its path is $MORPHCTL_BINARY, set by ctest).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "runtime/coordinator/http_server.h"
#include "runtime/tools/api_client.h"
#include "runtime/tools/morphctl_cli.h"

namespace morph {
namespace {

namespace asio = boost::asio;
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken[] = "ctl-s3cret";

CoordinatorSnapshot SampleSnapshot() {
  CoordinatorSnapshot s;
  s.generation = 3;
  s.phase = "stable";
  s.config = ParallelConfig{.dp = 2, .tp = 2, .pp = 1, .zero_stage = 1, .micro_batches = 4};
  for (int r = 0; r < 4; ++r) s.members.push_back({r, 10 + r, "node" + std::to_string(r / 2)});
  s.standby = {20};
  s.step = 1234;
  s.reconfigurations = 2;
  s.last_reconfiguration = ReconfigurationRecord{.from_generation = 2,
                                                 .to_generation = 3,
                                                 .from_world = 6,
                                                 .to_world = 4,
                                                 .agree_ms = 12.5,
                                                 .communicators_ms = 300,
                                                 .plan_ms = 4,
                                                 .transfer_ms = 410,
                                                 .resume_ms = 20,
                                                 .total_ms = 760,
                                                 .stall_ms = 450,
                                                 .explanation = "kept tp=2; dp 3 -> 2"};
  return s;
}

struct CtlRun {
  int rc = -1;
  std::string out, err;
};

void ClearEnv() {
  for (const char* v : {"MORPH_API_ADDR", "MORPH_API_PORT", "MORPH_TOKEN", "MORPH_TOKEN_FILE",
                        "MORPH_API_TOKEN_FOR_READS"}) {
    unsetenv(v);
  }
}

// A port nothing listens on (bound, then closed).
uint16_t DeadPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

class MorphctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClearEnv();
    HttpServerOptions o;
    o.token = kToken;
    o.max_world = 64;
    server_ = std::make_unique<HttpServer>(
        io_, o,
        HttpServer::Callbacks{.resize =
                                  [this](ResizeCall call, HttpServer::Answer answer) {
                                    std::lock_guard<std::mutex> l(mu_);
                                    calls_.push_back(call);
                                    answer(answer_);
                                    return static_cast<int64_t>(calls_.size());
                                  },
                              .snapshot =
                                  [this] {
                                    std::lock_guard<std::mutex> l(mu_);
                                    return snapshot_;
                                  }});
    Status s = server_->Start();
    ASSERT_TRUE(s.ok()) << s;
    thread_ = std::thread([this] { io_.run(); });
    addr_ = "127.0.0.1:" + std::to_string(server_->port());
  }
  void TearDown() override {
    std::promise<void> done;
    asio::post(io_, [&] {
      server_->Stop();
      done.set_value();
    });
    done.get_future().wait();
    work_.reset();
    io_.stop();
    thread_.join();
    server_.reset();
    ClearEnv();
  }

  CtlRun Ctl(std::vector<std::string> args, const std::atomic<bool>* interrupted = nullptr) {
    std::ostringstream out, err;
    CtlRun r;
    r.rc = RunMorphctl(args, out, err, interrupted);
    r.out = out.str();
    r.err = err.str();
    return r;
  }
  std::vector<ResizeCall> Calls() {
    std::lock_guard<std::mutex> l(mu_);
    return calls_;
  }
  void SetSnapshot(CoordinatorSnapshot s) {
    std::lock_guard<std::mutex> l(mu_);
    snapshot_ = std::move(s);
  }

  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_ = asio::make_work_guard(io_);
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  std::string addr_;
  std::mutex mu_;
  std::vector<ResizeCall> calls_;
  Status answer_ = Status::Ok();
  CoordinatorSnapshot snapshot_ = SampleSnapshot();
};

TEST_F(MorphctlTest, StatusIsHumanReadable) {
  CtlRun r = Ctl({"--addr", addr_, "status"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("generation 3 (stable), step 1234\n"));
  EXPECT_THAT(r.out, HasSubstr("world 4: dp=2 tp=2 pp=1 zero=1 micro_batches=4\n"));
  EXPECT_THAT(r.out, HasSubstr("  0  10  node0\n"));
  EXPECT_THAT(r.out, HasSubstr("  3  13  node1\n"));
  EXPECT_THAT(r.out, HasSubstr("standby: 20\n"));
  EXPECT_THAT(r.out, HasSubstr("resize: none in progress\n"));
  EXPECT_THAT(r.out, HasSubstr("reconfigurations: 2\n"));
  EXPECT_THAT(r.out,
              HasSubstr("last reconfiguration: generation 2 -> 3, world 6 -> 4 in 760.0 ms "
                        "(stall 450.0 ms): agree 12.5 ms, communicators 300.0 ms, plan 4.0 ms, "
                        "transfer 410.0 ms, resume 20.0 ms; kept tp=2; dp 3 -> 2\n"));
}

TEST_F(MorphctlTest, StatusJsonIsTheServersDocument) {
  CtlRun r = Ctl({"status", "--json", "--addr=" + addr_});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(json::parse(r.out), json::parse(RenderStatusJson(SampleSnapshot())));
}

TEST_F(MorphctlTest, StatusBeforeTheFirstGeneration) {
  SetSnapshot(CoordinatorSnapshot{
      .phase = "starting", .resize_in_progress = true, .pending_generation = 1});
  CtlRun r = Ctl({"--addr", addr_, "status"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("generation 0 (starting), step 0\n"));
  EXPECT_THAT(r.out, HasSubstr("standby: none\n"));
  EXPECT_THAT(r.out, HasSubstr("resize: in progress (generation 1 pending)\n"));
  EXPECT_THAT(r.out, Not(HasSubstr("last reconfiguration")));
}

TEST_F(MorphctlTest, AddressAndTokenFromEnvironment) {
  setenv("MORPH_API_PORT", std::to_string(server_->port()).c_str(), 1);
  setenv("MORPH_TOKEN", kToken, 1);
  CtlRun r = Ctl({"resize", "8", "--deadline-ms", "5000", "--reason", "scale up"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(r.out, "accepted: request 1 (world size -> 8); follow it with: morphctl watch\n");
  std::vector<ResizeCall> calls = Calls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].request.world_size, 8);
  EXPECT_EQ(calls[0].deadline_ms, 5000);
  EXPECT_EQ(calls[0].request.reason, "scale up");
}

TEST_F(MorphctlTest, TokenFromFile) {
  std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("morphctl_token_" + std::to_string(getpid()));
  std::ofstream(file) << kToken << "\n";
  setenv("MORPH_TOKEN_FILE", file.c_str(), 1);
  CtlRun r = Ctl({"--addr", addr_, "add", "2"});
  EXPECT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("accepted: request 1 (add 2 worker(s))"));
  std::filesystem::remove(file);
  CtlRun gone = Ctl({"--addr", addr_, "add", "2"});
  EXPECT_EQ(gone.rc, kExitUsage);
  EXPECT_THAT(gone.err, HasSubstr("MORPH_TOKEN_FILE=" + file.string() + ": cannot read"));
  ASSERT_EQ(Calls().size(), 1u);
  EXPECT_EQ(Calls()[0].request.add, 2);
}

TEST_F(MorphctlTest, RemoveSendsTheIds) {
  CtlRun r = Ctl({"--addr", addr_, "--token", kToken, "remove", "3", "5", "--json"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_EQ(json::parse(r.out), json::parse(R"({"request_id": 1, "status": "accepted"})"));
  ASSERT_EQ(Calls().size(), 1u);
  EXPECT_EQ(Calls()[0].request.remove, (std::vector<WorkerId>{3, 5}));
}

TEST_F(MorphctlTest, WorldSizeZeroIsRefusedWithTheServersMessage) {
  CtlRun r = Ctl({"--addr", addr_, "--token", kToken, "resize", "0"});
  EXPECT_EQ(r.rc, kExitRefused);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err,
            "morphctl: resize: refused by the coordinator (HTTP 400): world_size: must be in "
            "[1, 64], got 0\n");
  CtlRun big = Ctl({"--addr", addr_, "--token", kToken, "resize", "65"});
  EXPECT_EQ(big.rc, kExitRefused);
  EXPECT_THAT(big.err, HasSubstr("world_size: must be in [1, 64], got 65"));
  CtlRun dup = Ctl({"--addr", addr_, "--token", kToken, "remove", "3", "3"});
  EXPECT_EQ(dup.rc, kExitRefused);
  EXPECT_THAT(dup.err, HasSubstr("HTTP 400): remove: "));
  EXPECT_TRUE(Calls().empty());
}

TEST_F(MorphctlTest, MissingTokenIsAUsageErrorAndSendsNothing) {
  CtlRun r = Ctl({"--addr", addr_, "resize", "4"});
  EXPECT_EQ(r.rc, kExitUsage);
  EXPECT_EQ(r.err,
            "morphctl: resize: no job token: pass --token or set MORPH_TOKEN or "
            "MORPH_TOKEN_FILE\n");
  EXPECT_TRUE(Calls().empty());
  // Reads need none.
  EXPECT_EQ(Ctl({"--addr", addr_, "status"}).rc, kExitOk);
}

TEST_F(MorphctlTest, WrongTokenIsRefused) {
  CtlRun r = Ctl({"--addr", addr_, "--token", "not-the-token", "resize", "4"});
  EXPECT_EQ(r.rc, kExitRefused);
  EXPECT_THAT(r.err, HasSubstr("refused by the coordinator (HTTP 401): Authorization: not "
                               "\"Bearer <job token>\" with this job's token"));
  EXPECT_TRUE(Calls().empty());
}

TEST_F(MorphctlTest, DeciderRefusalIsPrinted) {
  answer_ = FailedPreconditionError("resize: generation 4 is still being prepared");
  CtlRun r = Ctl({"--addr", addr_, "--token", kToken, "resize", "6"});
  EXPECT_EQ(r.rc, kExitRefused);
  EXPECT_EQ(r.err,
            "morphctl: resize: refused by the coordinator (HTTP 409): resize: generation 4 is "
            "still being prepared\n");
}

TEST_F(MorphctlTest, UnreachableAddress) {
  std::string dead = "127.0.0.1:" + std::to_string(DeadPort());
  CtlRun r = Ctl({"--addr", dead, "status"});
  EXPECT_EQ(r.rc, kExitUnreachable);
  EXPECT_THAT(r.err, HasSubstr("morphctl: status: coordinator unreachable: connecting to " + dead +
                               ": Connection refused"));
  CtlRun w = Ctl({"--addr", dead, "watch", "--count", "3"});
  EXPECT_EQ(w.rc, kExitUnreachable);
  CtlRun name = Ctl({"--addr", "no-such-host.invalid:80", "--timeout-ms", "3000", "status"});
  EXPECT_EQ(name.rc, kExitUnreachable) << name.err;
  EXPECT_THAT(name.err, HasSubstr("resolving no-such-host.invalid:80"));
}

TEST_F(MorphctlTest, SilentServerTimesOut) {
  // Accepts (the kernel's backlog) and never answers.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  std::string silent = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  auto start = std::chrono::steady_clock::now();
  CtlRun r = Ctl({"--addr", silent, "--timeout-ms", "300", "status"});
  auto took = std::chrono::steady_clock::now() - start;
  close(fd);
  EXPECT_EQ(r.rc, kExitUnreachable);
  EXPECT_THAT(r.err, HasSubstr("reading the reply from " + silent + ": no answer within 300 ms"));
  EXPECT_LT(took, std::chrono::seconds(5));
}

// A listener that accepts connections and answers each with `reply` (nothing: just closes).
class RawServer {
 public:
  explicit RawServer(std::string reply) : reply_(std::move(reply)) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    listen(fd_, 4);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    addr_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
    thread_ = std::thread([this] {
      int c = accept(fd_, nullptr, nullptr);  // one connection; the destructor's shutdown ends it
      if (c < 0) return;
      char buf[4096];
      (void)!read(c, buf, sizeof buf);
      if (!reply_.empty()) (void)!write(c, reply_.data(), reply_.size());
      close(c);
    });
  }
  ~RawServer() {
    shutdown(fd_, SHUT_RDWR);
    thread_.join();
    close(fd_);
  }
  const std::string& addr() const { return addr_; }

 private:
  std::string reply_;
  int fd_ = -1;
  std::string addr_;
  std::thread thread_;
};

TEST_F(MorphctlTest, ClosedOrGarbledReplies) {
  {
    RawServer closes("");
    CtlRun r = Ctl({"--addr", closes.addr(), "--timeout-ms", "3000", "status"});
    EXPECT_EQ(r.rc, kExitUnreachable) << r.err;
    EXPECT_THAT(r.err,
                HasSubstr("coordinator unreachable: reading the reply from " + closes.addr()));
  }
  {
    RawServer garbage("SSH-2.0-OpenSSH_9.2\r\n\r\n");
    CtlRun r = Ctl({"--addr", garbage.addr(), "--timeout-ms", "3000", "status"});
    EXPECT_EQ(r.rc, kExitError) << r.err;
    EXPECT_THAT(r.err, HasSubstr("not a valid HTTP reply"));
  }
  {
    RawServer not_json("HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello");
    CtlRun r = Ctl({"--addr", not_json.addr(), "--timeout-ms", "3000", "status"});
    EXPECT_EQ(r.rc, kExitError) << r.err;
    EXPECT_THAT(r.err, HasSubstr("morphctl: status: status document: not a JSON object"));
  }
}

// Text a server sent (a worker's host, the planner's explanation, an error message, metrics)
// reaches the terminal with its control characters escaped: no forged lines, no escape
// sequences.
TEST_F(MorphctlTest, HostileServerTextIsEscaped) {
  CoordinatorSnapshot s = SampleSnapshot();
  s.members[1].host = "node0\nI0101 00:00:00.000000 1 morphctl.cc:1] forged\x1b[2J\a";
  s.last_reconfiguration->explanation = "kept tp=2\r\x1b[31mred\x7f";
  s.phase = "stable\x1b]0;title\a";
  SetSnapshot(s);
  auto clean = [](const std::string& text) {
    for (char c : text) {
      unsigned char u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\n') || u >= 0x7f) return false;
    }
    return true;
  };
  CtlRun r = Ctl({"--addr", addr_, "status"});
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_TRUE(clean(r.out)) << r.out;
  EXPECT_THAT(r.out, HasSubstr("  1  11  node0\\nI0101 00:00:00.000000 1 morphctl.cc:1] "
                               "forged\\x1b[2J\\x07\n"));
  EXPECT_THAT(r.out, HasSubstr("; kept tp=2\\r\\x1b[31mred\\x7f\n"));
  EXPECT_THAT(r.out, Not(HasSubstr("\nI0101")));
  CtlRun j = Ctl({"--addr", addr_, "status", "--json"});
  ASSERT_EQ(j.rc, kExitOk) << j.err;
  EXPECT_TRUE(clean(j.out)) << j.out;
  EXPECT_EQ(json::parse(j.out), json::parse(RenderStatusJson(s)));
  CtlRun w = Ctl({"--addr", addr_, "watch", "--count", "1"});
  ASSERT_EQ(w.rc, kExitOk) << w.err;
  EXPECT_TRUE(clean(w.out)) << w.out;
  CtlRun wj = Ctl({"--addr", addr_, "watch", "--json", "--count", "1"});
  ASSERT_EQ(wj.rc, kExitOk) << wj.err;
  EXPECT_TRUE(clean(wj.out)) << wj.out;
  // The coordinator's refusal, printed as it said it, but harmless.
  answer_ = FailedPreconditionError("resize: no\n\x1b[2Jmorphctl: resize: accepted");
  CtlRun rs = Ctl({"--addr", addr_, "--token", kToken, "resize", "6"});
  EXPECT_EQ(rs.rc, kExitRefused);
  EXPECT_EQ(
      rs.err,
      "morphctl: resize: refused by the coordinator (HTTP 409): resize: no\\n\\x1b[2Jmorphctl: "
      "resize: accepted\n");
  {
    RawServer metrics(
        "HTTP/1.1 200 OK\r\nContent-Length: 26\r\nConnection: close\r\n\r\n"
        "morph_step 1\n\x1b[2Jforged 2\n");
    CtlRun m = Ctl({"--addr", metrics.addr(), "--timeout-ms", "3000", "metrics"});
    EXPECT_EQ(m.rc, kExitOk) << m.err;
    EXPECT_EQ(m.out, "morph_step 1\n\\x1b[2Jforged 2\n");
  }
  {
    RawServer refusal(
        "HTTP/1.1 500 Oops\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
        "a\x1b[2J\nb\rc!");
    CtlRun e = Ctl({"--addr", refusal.addr(), "--timeout-ms", "3000", "status"});
    EXPECT_EQ(e.rc, kExitRefused);
    EXPECT_TRUE(clean(e.err)) << e.err;
    EXPECT_THAT(e.err, HasSubstr("(HTTP 500): a\\x1b[2J\\nb\\rc!\n"));
  }
}

// A reply that is not JSON is an unexpected reply (exit 1) for every --json command too.
TEST_F(MorphctlTest, JsonCommandsRefuseAReplyThatIsNotJson) {
  const std::string reply =
      "HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nnot json \x1b[m";
  for (const std::vector<std::string>& cmd :
       {std::vector<std::string>{"watch", "--json", "--count", "1"},
        std::vector<std::string>{"status", "--json"}}) {
    RawServer server(reply);
    std::vector<std::string> args = {"--addr", server.addr(), "--timeout-ms", "3000"};
    args.insert(args.end(), cmd.begin(), cmd.end());
    CtlRun r = Ctl(args);
    EXPECT_EQ(r.rc, kExitError) << cmd[0] << ": " << r.out;
    EXPECT_EQ(r.out, "") << cmd[0];
    EXPECT_THAT(r.err, HasSubstr("morphctl: " + cmd[0] + ": the reply is not JSON: ")) << cmd[0];
    EXPECT_THAT(r.err, Not(HasSubstr("\x1b"))) << cmd[0];
  }
}

TEST_F(MorphctlTest, MalformedArguments) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  std::vector<Case> cases = {
      {{}, "morphctl: no command given\n"},
      {{"frobnicate"}, "morphctl: unknown command \"frobnicate\"\n"},
      {{"--addr", addr_, "resize"}, "morphctl: \"resize\" takes one world size, got 0\n"},
      {{"--addr", addr_, "resize", "4", "5"}, "\"resize\" takes one world size, got 2"},
      {{"--addr", addr_, "remove"}, "\"remove\" takes at least one worker id, got 0"},
      {{"--addr", addr_, "status", "extra"}, "\"status\" takes no arguments, got 1"},
      {{"--addr", addr_, "--token", kToken, "resize", "four"},
       "morphctl: resize: world_size: \"four\" is not an integer\n"},
      {{"--addr", addr_, "--token", kToken, "remove", "3", "x"}, "remove: \"x\" is not an integer"},
      {{"--addr", addr_, "status", "--interval-ms", "10"},
       "--interval-ms: not a flag of \"status\""},
      {{"--addr", addr_, "watch", "--interval-ms", "1"}, "--interval-ms: must be in [10, "},
      {{"--addr", addr_, "watch", "--count", "0"}, "--count: must be in [1, "},
      {{"--addr", addr_, "--bogus", "status"}, "morphctl: unknown flag --bogus\n"},
      {{"--addr"}, "morphctl: --addr: missing value\n"},
      {{"--addr", "localhost", "status"},
       "morphctl: status: --addr: \"localhost\" has no port (expected host:port)\n"},
      {{"--addr", "127.0.0.1:99999", "status"}, "has no port in [1, 65535]"},
      {{"--addr", "::1:80", "status"}, "is an IPv6 address without brackets"},
      {{"status"},
       "morphctl: status: no scheduler API address: pass --addr host:port or set "
       "MORPH_API_PORT"},
      {{"--addr", addr_, "--timeout-ms", "-3", "status"}, "--timeout-ms: must be in [1, "},
      {{"--addr", addr_, "--token=", "status"}, "--token: empty"},
  };
  for (const Case& c : cases) {
    CtlRun r = Ctl(c.args);
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    EXPECT_EQ(r.rc, kExitUsage) << joined << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << joined;
    EXPECT_EQ(r.out, "") << joined;
  }
  setenv("MORPH_API_PORT", "http", 1);
  CtlRun env = Ctl({"status"});
  EXPECT_EQ(env.rc, kExitUsage);
  EXPECT_THAT(env.err, HasSubstr("MORPH_API_PORT"));
  EXPECT_TRUE(Calls().empty());
  CtlRun help = Ctl({"--help"});
  EXPECT_EQ(help.rc, kExitOk);
  EXPECT_THAT(help.out, HasSubstr("usage: morphctl"));
}

TEST_F(MorphctlTest, ReadsNeedTheTokenWhenTheServerSaysSo) {
  // A server that requires the token on reads: morphctl sends it when it has one.
  asio::io_context io;
  HttpServerOptions o;
  o.token = kToken;
  o.token_for_reads = true;
  HttpServer strict(io, o,
                    {.resize =
                         [](ResizeCall, HttpServer::Answer a) {
                           a(Status::Ok());
                           return int64_t{1};
                         },
                     .snapshot = SampleSnapshot});
  ASSERT_TRUE(strict.Start().ok());
  std::string addr = "127.0.0.1:" + std::to_string(strict.port());
  std::thread t([&] { io.run_for(std::chrono::seconds(20)); });
  CtlRun without = Ctl({"--addr", addr, "status"});
  CtlRun with = Ctl({"--addr", addr, "--token", kToken, "status"});
  asio::post(io, [&] {
    strict.Stop();
    io.stop();
  });
  t.join();
  EXPECT_EQ(without.rc, kExitRefused);
  EXPECT_THAT(without.err, HasSubstr("(HTTP 401): Authorization: missing"));
  EXPECT_EQ(with.rc, kExitOk) << with.err;
}

TEST(WatchView, PrintsChangesAndEachReconfiguration) {
  WatchView view;
  CoordinatorSnapshot s = SampleSnapshot();
  auto lines = [&] {
    auto l = view.Update(json::parse(RenderStatusJson(s)));
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? *l : std::vector<std::string>{};
  };
  EXPECT_EQ(lines(), (std::vector<std::string>{
                         "step 1234  world 4  dp=2 tp=2 pp=1  generation 3 stable",
                         "last reconfiguration: generation 2 -> 3, world 6 -> 4 in 760.0 ms "
                         "(stall 450.0 ms): agree 12.5 ms, communicators 300.0 ms, plan 4.0 "
                         "ms, transfer 410.0 ms, resume 20.0 ms; kept tp=2; dp 3 -> 2"}));
  EXPECT_TRUE(lines().empty());  // nothing changed
  s.step = 1235;
  EXPECT_EQ(lines(),
            (std::vector<std::string>{"step 1235  world 4  dp=2 tp=2 pp=1  generation 3 stable"}));
  s.resize_in_progress = true;
  s.pending_generation = 4;
  s.phase = "preparing";
  EXPECT_EQ(lines(), (std::vector<std::string>{"step 1235  world 4  dp=2 tp=2 pp=1  generation "
                                               "3 preparing  (resize in progress: "
                                               "generation 4)"}));
  s = SampleSnapshot();
  s.generation = 4;
  s.step = 1240;
  s.members.resize(2);
  s.config.dp = 1;
  s.reconfigurations = 3;
  s.last_reconfiguration = ReconfigurationRecord{.from_generation = 3,
                                                 .to_generation = 4,
                                                 .from_world = 4,
                                                 .to_world = 2,
                                                 .agree_ms = 1,
                                                 .communicators_ms = 2,
                                                 .plan_ms = 3,
                                                 .transfer_ms = 4,
                                                 .resume_ms = 5,
                                                 .total_ms = 15,
                                                 .stall_ms = 9.25};
  EXPECT_EQ(lines(), (std::vector<std::string>{
                         "step 1240  world 2  dp=1 tp=2 pp=1  generation 4 stable",
                         "reconfiguration: generation 3 -> 4, world 4 -> 2 in 15.0 ms (stall "
                         "9.2 ms): agree 1.0 ms, communicators 2.0 ms, plan 3.0 ms, transfer "
                         "4.0 ms, resume 5.0 ms"}));
  auto bad = view.Update(json::parse(R"({"generation": 1})"));
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(bad.status().message(), HasSubstr("step missing"));
}

TEST_F(MorphctlTest, WatchFollowsTheJob) {
  std::atomic<bool> stop{false};
  std::thread changer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    CoordinatorSnapshot s = SampleSnapshot();
    s.step = 1300;
    s.generation = 4;
    s.reconfigurations = 3;
    s.last_reconfiguration->from_generation = 3;
    s.last_reconfiguration->to_generation = 4;
    SetSnapshot(s);
  });
  CtlRun r = Ctl({"--addr", addr_, "watch", "--interval-ms", "20", "--count", "30"}, &stop);
  changer.join();
  ASSERT_EQ(r.rc, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("  step 1234  world 4  dp=2 tp=2 pp=1  generation 3 stable\n"));
  EXPECT_THAT(r.out, HasSubstr("  last reconfiguration: generation 2 -> 3"));
  EXPECT_THAT(r.out, HasSubstr("  step 1300  world 4  dp=2 tp=2 pp=1  generation 4 stable\n"));
  EXPECT_THAT(r.out, HasSubstr("  reconfiguration: generation 3 -> 4, world 6 -> 4"));
  // Interrupted: returns promptly with 0 whatever --count says.
  stop = true;
  auto start = std::chrono::steady_clock::now();
  CtlRun i = Ctl({"--addr", addr_, "watch", "--interval-ms", "60000"}, &stop);
  EXPECT_EQ(i.rc, kExitOk);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

// ---- the binary ----

// Runs `sh -c "<binary> <args>"` (args may end in a shell snippet) with stdout and stderr kept.
CtlRun RunBinary(const std::string& args, bool background_then_sigint = false) {
  const char* bin = std::getenv("MORPHCTL_BINARY");
  std::string binary = bin == nullptr ? "" : bin;
  char dir[] = "/tmp/morphctl_test_XXXXXX";
  if (mkdtemp(dir) == nullptr) return {};
  std::string out = std::string(dir) + "/out", err = std::string(dir) + "/err";
  std::string cmd = "timeout 20 " + binary + " " + args + " >" + out + " 2>" + err;
  if (background_then_sigint) {
    cmd = binary + " " + args + " >" + out + " 2>" + err +
          " & pid=$!; sleep 1; kill -INT $pid; wait $pid";
  }
  int status = std::system(cmd.c_str());
  CtlRun r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  auto slurp = [](const std::string& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  r.out = slurp(out);
  r.err = slurp(err);
  std::filesystem::remove_all(dir);
  return r;
}

TEST_F(MorphctlTest, BinaryExitCodes) {
  ASSERT_NE(std::getenv("MORPHCTL_BINARY"), nullptr) << "ctest sets MORPHCTL_BINARY";
  CtlRun ok = RunBinary("--addr " + addr_ + " status");
  EXPECT_EQ(ok.rc, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("generation 3 (stable), step 1234"));
  CtlRun zero = RunBinary("--addr " + addr_ + " --token " + kToken + " resize 0");
  EXPECT_EQ(zero.rc, 3);
  EXPECT_THAT(zero.err, HasSubstr("(HTTP 400): world_size: must be in [1, 64], got 0"));
  CtlRun usage = RunBinary("resize");
  EXPECT_EQ(usage.rc, 2);
  EXPECT_THAT(usage.err, HasSubstr("usage: morphctl"));
  CtlRun dead = RunBinary("--addr 127.0.0.1:" + std::to_string(DeadPort()) + " status");
  EXPECT_EQ(dead.rc, 4);
  EXPECT_THAT(dead.err, HasSubstr("coordinator unreachable"));
  // SIGINT ends watch with 0 (--count bounds it if the signal were lost).
  CtlRun watch = RunBinary("--addr " + addr_ + " watch --interval-ms 50 --count 400", true);
  EXPECT_EQ(watch.rc, 0) << watch.err;
  EXPECT_THAT(watch.out, HasSubstr("step 1234  world 4"));
}

}  // namespace
}  // namespace morph
