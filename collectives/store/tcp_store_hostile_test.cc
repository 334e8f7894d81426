// The TCP store against clients that misbehave, on a small scale: each test reproduces one
// attack from issue 8 §1 with raw sockets and checks that the server stays bounded and keeps
// serving an honest client.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/testing.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "hostile-test-token";

int64_t VmRssBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return 0;
}

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutStr(std::string& out, std::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out.append(s);
}
std::string Framed(std::string_view body) {
  std::string out;
  PutU32(out, static_cast<uint32_t>(body.size()));
  out.append(body);
  return out;
}
// A request body as the client encodes it (op codes as KvTable::Op).
std::string RequestBody(uint8_t op, int64_t generation, int64_t timeout_ms,
                        const std::vector<std::string>& keys, std::string_view value = "",
                        int64_t number = 0) {
  std::string b;
  b.push_back(static_cast<char>(op));
  PutU64(b, static_cast<uint64_t>(generation));
  PutU64(b, static_cast<uint64_t>(timeout_ms));
  PutU32(b, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) PutStr(b, k);
  PutStr(b, value);
  b.push_back(0);
  PutStr(b, "");
  PutU64(b, static_cast<uint64_t>(number));
  return b;
}

// A client that speaks the wire format by hand (or not at all).
class RawConn {
 public:
  explicit RawConn(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~RawConn() { Close(); }
  RawConn(RawConn&& o) noexcept : fd_(o.fd_), connected_(o.connected_) { o.fd_ = -1; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool connected() const { return connected_; }
  bool Send(std::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  // Reads exactly n bytes; false on EOF, error or timeout.
  bool Recv(size_t n, std::string& out, int timeout_ms) {
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    out.resize(n);
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::recv(fd_, out.data() + got, n - got, 0);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  }
  // One response: (status code, message, value); nullopt if none came in time.
  struct Reply {
    int code;
    std::string message, value;
  };
  std::optional<Reply> ReadReply(int timeout_ms) {
    std::string h, body;
    if (!Recv(4, h, timeout_ms)) return std::nullopt;
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= uint32_t{static_cast<uint8_t>(h[i])} << (8 * i);
    if (!Recv(n, body, timeout_ms)) return std::nullopt;
    Reply r{static_cast<uint8_t>(body[0]), "", ""};
    size_t at = 1;
    auto str = [&](std::string& s) {
      uint32_t len = 0;
      for (int i = 0; i < 4; ++i) len |= uint32_t{static_cast<uint8_t>(body[at + i])} << (8 * i);
      s = body.substr(at + 4, len);
      at += 4 + len;
    };
    str(r.message);
    str(r.value);
    return r;
  }
  // True if the server closed the connection (EOF or reset) within the timeout.
  bool ClosedByServer(int timeout_ms) {
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char c;
    while (true) {
      ssize_t r = ::recv(fd_, &c, 1, 0);
      if (r == 0) return true;
      if (r < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
    }
  }
  bool Authenticate(std::string_view token) {
    std::string hello;
    PutStr(hello, token);
    if (!Send(Framed(hello))) return false;
    std::optional<Reply> r = ReadReply(5000);
    return r && r->code == 0;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

template <typename F>
bool Eventually(F f, int timeout_ms = 3000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return f();
}

void ExpectHonestClientServed(const TcpStoreServer& server) {
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto client, TcpStoreClient::Connect(server.address(), kToken, 0, Deadline::AfterMs(5000)));
  MORPH_ASSERT_OK(client->Set("honest", "yes", Deadline::AfterMs(2000)));
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v, client->Get("honest", Deadline::AfterMs(2000)));
  EXPECT_EQ(v, "yes");
}

TEST(TcpStoreHostileTest, UnauthenticatedBigFrameAnnouncementsAreClosedNotAllocated) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  const int64_t rss_before = VmRssBytes();
  std::vector<RawConn> conns;
  for (int i = 0; i < 8; ++i) {
    conns.emplace_back(server->port());
    ASSERT_TRUE(conns.back().connected());
    std::string header;
    PutU32(header, 64u << 20);  // announces a 64 MiB token frame, then stalls
    ASSERT_TRUE(conns.back().Send(header));
  }
  for (RawConn& c : conns) EXPECT_TRUE(c.ClosedByServer(2000));
  EXPECT_LT(VmRssBytes() - rss_before, int64_t{64} << 20);
  ExpectHonestClientServed(*server);
}

TEST(TcpStoreHostileTest, AuthenticatedStalledBigFrameHoldsOnlyWhatArrived) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  const int64_t rss_before = VmRssBytes();
  std::vector<RawConn> conns;
  for (int i = 0; i < 8; ++i) {
    conns.emplace_back(server->port());
    ASSERT_TRUE(conns.back().Authenticate(kToken));
    std::string partial;
    PutU32(partial, 60u << 20);  // announces 60 MiB ...
    partial.append(1024, 'x');   // ... sends 1 KiB of it and stalls
    ASSERT_TRUE(conns.back().Send(partial));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LT(VmRssBytes() - rss_before, int64_t{64} << 20);
  // What arrived plus at most two read chunks (64 KiB) per connection, not 8 x 60 MiB.
  EXPECT_LT(server->stats().buffered_bytes, int64_t{8} * (256 << 10));
  ExpectHonestClientServed(*server);
}

TEST(TcpStoreHostileTest, IdleUnauthenticatedConnectionsTimeOut) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken,
                                                                 {.auth_timeout_ms = 200}));
  std::vector<RawConn> conns;
  for (int i = 0; i < 10; ++i) conns.emplace_back(server->port());
  for (RawConn& c : conns) EXPECT_TRUE(c.ClosedByServer(3000));
  EXPECT_TRUE(Eventually([&] { return server->connections() == 0; }));
  // An authenticated idle connection stays.
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto client, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  MORPH_EXPECT_OK(client->Set("still", "here", Deadline::AfterMs(2000)));
}

TEST(TcpStoreHostileTest, ConnectionCapKeepsServingHonestClients) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken,
                                                                 {.max_connections = 16}));
  std::vector<RawConn> idle;
  for (int i = 0; i < 40; ++i) idle.emplace_back(server->port());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LE(server->connections(), 16);
  ExpectHonestClientServed(*server);
  EXPECT_LE(server->connections(), 16);
}

TEST(TcpStoreHostileTest, ManyEmptyKeysAreRejectedNamingTheCount) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  RawConn c(server->port());
  ASSERT_TRUE(c.Authenticate(kToken));
  // A 1 MiB body that announces 1,000,000 empty keys (4 bytes each would need 4 MB).
  std::string body;
  body.push_back(5);  // kWait
  PutU64(body, 0);
  PutU64(body, 0);
  PutU32(body, 1000000);
  body.append((1u << 20) - body.size(), '\0');
  ASSERT_TRUE(c.Send(Framed(body)));
  std::optional<RawConn::Reply> r = c.ReadReply(5000);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_THAT(r->message, HasSubstr("1000000 keys"));
  ExpectHonestClientServed(*server);
}

TEST(TcpStoreHostileTest, HugeTimeoutIsClampedAndWaitsProperly) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  RawConn c(server->port());
  ASSERT_TRUE(c.Authenticate(kToken));
  ASSERT_TRUE(c.Send(Framed(RequestBody(2, 0, int64_t{1} << 62, {"later"}))));  // kGet
  // It waits (no "timed out" at once) ...
  EXPECT_FALSE(c.ReadReply(300).has_value());
  // ... until the key is set.
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto writer, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  MORPH_ASSERT_OK(writer->Set("later", "v", Deadline::AfterMs(2000)));
  std::optional<RawConn::Reply> r = c.ReadReply(5000);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, 0) << r->message;
  EXPECT_EQ(r->value, "v");
}

TEST(TcpStoreHostileTest, DisconnectedWaitersAreDropped) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  {
    std::vector<RawConn> conns;
    for (int i = 0; i < 20; ++i) {
      conns.emplace_back(server->port());
      ASSERT_TRUE(conns.back().Authenticate(kToken));
      ASSERT_TRUE(
          conns.back().Send(Framed(RequestBody(2, 0, 60000, {"never/" + std::to_string(i)}))));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }  // all 20 close while their Gets wait
  EXPECT_TRUE(Eventually([&] { return server->connections() == 0; }))
      << server->connections() << " connections left";
  EXPECT_EQ(server->stats().pending_waits, 0);
  ExpectHonestClientServed(*server);
}

TEST(TcpStoreHostileTest, ASetWakesOnlyItsOwnWaiters) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  constexpr int kN = 64;
  std::vector<RawConn> waiters;
  for (int i = 0; i < kN; ++i) {
    waiters.emplace_back(server->port());
    ASSERT_TRUE(waiters.back().Authenticate(kToken));
    ASSERT_TRUE(waiters.back().Send(Framed(RequestBody(2, 0, 60000, {"k/" + std::to_string(i)}))));
  }
  // One more waits for three keys: it is re-examined once per key, not once per set.
  RawConn multi(server->port());
  ASSERT_TRUE(multi.Authenticate(kToken));
  ASSERT_TRUE(multi.Send(Framed(RequestBody(5, 0, 60000, {"k/0", "k/1", "k/2"}))));
  ASSERT_TRUE(Eventually([&] { return server->stats().pending_waits == kN + 1; }));
  const int64_t checks_before = server->stats().waiter_checks;
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto writer, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  for (int i = 0; i < kN; ++i) {
    MORPH_ASSERT_OK(writer->Set("k/" + std::to_string(i), "v", Deadline::AfterMs(2000)));
  }
  for (RawConn& w : waiters) {
    std::optional<RawConn::Reply> r = w.ReadReply(5000);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->code, 0) << r->message;
  }
  std::optional<RawConn::Reply> r = multi.ReadReply(5000);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, 0) << r->message;
  // kN single-key waiters once each, the three-key waiter three times (before the index:
  // every set re-examined every waiter, ~kN^2 / 2).
  EXPECT_EQ(server->stats().waiter_checks - checks_before, kN + 3);
  EXPECT_EQ(server->stats().pending_waits, 0);
}

TEST(TcpStoreHostileTest, TheOwnerAdvancesAnyDistanceAndAbortsOlderWaiters) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  RawConn waiter(server->port());
  ASSERT_TRUE(waiter.Authenticate(kToken));
  ASSERT_TRUE(waiter.Send(Framed(RequestBody(2, 0, 60000, {"never"}))));
  ASSERT_TRUE(Eventually([&] { return server->stats().pending_waits == 1; }));
  server->AdvanceGeneration(7);
  std::optional<RawConn::Reply> r = waiter.ReadReply(5000);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, static_cast<int>(StatusCode::kAborted));
  EXPECT_THAT(r->message, HasSubstr("current generation 7"));
  server->AdvanceGeneration(3);  // never backwards
  EXPECT_EQ(server->table()->min_generation(), 7);
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto g7, TcpStoreClient::Connect(server->address(), kToken, 7, Deadline::AfterMs(5000)));
  EXPECT_THAT(g7->AdvanceGeneration(9, Deadline::AfterMs(2000)),
              StatusIs(StatusCode::kPermissionDenied, HasSubstr("current generation 7 + 1")));
  MORPH_EXPECT_OK(g7->AdvanceGeneration(8, Deadline::AfterMs(2000)));
}

TEST(TcpStoreHostileTest, OversizedFrameAfterAuthenticationIsRefusedNamingTheLimit) {
  TcpStoreServerOptions options;
  options.max_frame_bytes = 1024;
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken, options));
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto client, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  EXPECT_THAT(client->Set("big", std::string(4096, 'x'), Deadline::AfterMs(2000)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("exceeds the limit of 1024")));
  MORPH_EXPECT_OK(client->Set("small", "x", Deadline::AfterMs(2000)));
}

// The server in a child whose open-file limit is lowered below its connection cap, so that
// accept() fails with EMFILE: the accept loop backs off instead of spinning and an honest
// client is still served (the oldest unauthenticated connection makes room).
TEST(TcpStoreHostileTest, OutOfDescriptorsBacksOffAndKeepsServing) {
  int to_parent[2], to_child[2];
  ASSERT_EQ(::pipe(to_parent), 0);
  ASSERT_EQ(::pipe(to_child), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken);
    if (!server.ok()) ::_exit(2);
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = 48;
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) ::_exit(3);
    uint16_t port = (*server)->port();
    if (::write(to_parent[1], &port, sizeof(port)) != sizeof(port)) ::_exit(4);
    char done;
    if (::read(to_child[0], &done, 1) != 1) ::_exit(5);
    const TcpStoreServerStats st = (*server)->stats();
    // ~2 s of EMFILE at one accept per 20 ms back-off; a spinning loop makes 10^5 or more.
    std::fprintf(stderr, "child: %lld accept errors, %lld refused\n",
                 static_cast<long long>(st.accept_errors),
                 static_cast<long long>(st.refused_connections));
    ::_exit(st.accept_errors > 0 && st.accept_errors < 400 ? 0 : 6);
  }
  uint16_t port = 0;
  ASSERT_EQ(::read(to_parent[0], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  {
    std::vector<RawConn> idle;
    for (int i = 0; i < 80; ++i) idle.emplace_back(port);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    MORPH_ASSERT_OK_AND_ASSIGN(
        auto client, TcpStoreClient::Connect("127.0.0.1:" + std::to_string(port), kToken, 0,
                                             Deadline::AfterMs(10000)));
    MORPH_EXPECT_OK(client->Set("k", "v", Deadline::AfterMs(5000)));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  ASSERT_EQ(::write(to_child[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) ::close(fd);
}

TEST(TcpStoreHostileTest, WorkerCannotAdvanceBeyondTheNextGeneration) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto g0, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  EXPECT_THAT(g0->AdvanceGeneration(INT64_MAX, Deadline::AfterMs(2000)),
              StatusIs(StatusCode::kPermissionDenied, HasSubstr("9223372036854775807")));
  EXPECT_EQ(server->table()->min_generation(), 0);
  // current + 1 is what a worker may do.
  MORPH_EXPECT_OK(g0->AdvanceGeneration(1, Deadline::AfterMs(2000)));
  EXPECT_EQ(server->table()->min_generation(), 1);
}

TEST(TcpStoreHostileTest, HostNamesResolve) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("localhost", 0, kToken));
  const std::string port = std::to_string(server->port());
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto a, TcpStoreClient::Connect("localhost:" + port, kToken, 0, Deadline::AfterMs(5000)));
  MORPH_ASSERT_OK(a->Set("k", "v", Deadline::AfterMs(2000)));
  EXPECT_THAT(
      TcpStoreClient::Connect("no-such-host.invalid:80", kToken, 0, Deadline::AfterMs(2000)),
      StatusIs(StatusCode::kInvalidArgument, HasSubstr("'no-such-host.invalid'")));
  // The machine's own name, where it resolves (it does in /etc/hosts of most machines and
  // containers; a bare CI runner may lack it).
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  addrinfo* found = nullptr;
  if (::getaddrinfo(host, nullptr, nullptr, &found) != 0) {
    GTEST_SKIP() << "this machine's host name '" << host << "' does not resolve";
  }
  ::freeaddrinfo(found);
  MORPH_ASSERT_OK_AND_ASSIGN(auto server2, TcpStoreServer::Start(host, 0, kToken));
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto b, TcpStoreClient::Connect(std::string(host) + ":" + std::to_string(server2->port()),
                                      kToken, 0, Deadline::AfterMs(5000)));
  MORPH_EXPECT_OK(b->Set("k", "v", Deadline::AfterMs(2000)));
}

}  // namespace
}  // namespace morph
