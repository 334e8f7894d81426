// gloo_support's pair signal against a Gloo pair whose peer is a raw socket this test drives
// byte by byte, so that the pair is caught exactly where Gloo's own signal falls short: in the
// middle of a receive's payload (tcp::Pair::rx_) or of a send's payload that the peer does not
// read (tcp::Pair::tx_). Gloo's signalException wakes only buffers with operations still
// queued; PairAccess::Signal must wake these too, at once, not at the wait's timeout.
// (Found as a CI flake: a survivor of a kill sat in a 4 MB allreduce for its whole timeout.)
#include "collectives/gloo/gloo_support.h"

#include <arpa/inet.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/context.h>
#include <gloo/transport/tcp/device.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace morph::gloo_support {
namespace {

namespace tcp = gloo::transport::tcp;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kSlot = 7;
constexpr milliseconds kWaitTimeout(20000);

// Rank 0 is a real Gloo context on 127.0.0.1; rank 1 is `peer_`, a socket on 127.0.0.2.
// Gloo orders the two addresses to pick who connects: 127.0.0.1 < 127.0.0.2, so rank 0's pair
// listens and the test's socket connects to it.
class RawPeer : public ::testing::Test {
 protected:
  void SetUp() override {
    tcp::attr attr("127.0.0.1");
    device_ = tcp::CreateDevice(attr);
    context_ = std::make_shared<tcp::Context>(std::static_pointer_cast<tcp::Device>(device_), 0, 2);
    context_->setTimeout(kWaitTimeout);
    auto& pair = context_->createPair(1);
    pair_ = dynamic_cast<tcp::Pair*>(pair.get());
    ASSERT_NE(pair_, nullptr);

    peer_ = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(peer_, 0);
    sockaddr_in self{};
    self.sin_family = AF_INET;
    self.sin_port = 0;
    ASSERT_EQ(inet_pton(AF_INET, "127.0.0.2", &self.sin_addr), 1);
    ASSERT_EQ(bind(peer_, reinterpret_cast<sockaddr*>(&self), sizeof(self)), 0)
        << std::strerror(errno);
    socklen_t len = sizeof(self);
    ASSERT_EQ(getsockname(peer_, reinterpret_cast<sockaddr*>(&self), &len), 0);

    // Pair::connect blocks until the listening side accepted: run it beside our connect.
    sockaddr_storage peer_ss{};
    std::memcpy(&peer_ss, &self, sizeof(self));
    const std::vector<char> peer_bytes = tcp::Address(peer_ss).bytes();
    auto connected = std::async(std::launch::async, [&] { pair_->connect(peer_bytes); });
    const sockaddr_storage& listening = pair_->address().getSockaddr();
    ASSERT_EQ(::connect(peer_, reinterpret_cast<const sockaddr*>(&listening), sizeof(sockaddr_in)),
              0)
        << std::strerror(errno);
    ASSERT_EQ(connected.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    connected.get();
  }

  void TearDown() override {
    if (peer_ >= 0) close(peer_);
  }

  // Gloo's framing: one preamble per operation (tcp::Op::preamble), then the payload.
  static tcp::Op Preamble(tcp::Op::Opcode opcode, size_t payload) {
    tcp::Op op;
    op.preamble.nbytes =
        sizeof(op.preamble) + (opcode == tcp::Op::SEND_UNBOUND_BUFFER ? payload : 0);
    op.preamble.opcode = opcode;
    op.preamble.slot = kSlot;
    op.preamble.length = payload;
    return op;
  }
  void WriteAll(const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      ssize_t n = ::send(peer_, p, bytes, MSG_NOSIGNAL);
      ASSERT_GT(n, 0) << std::strerror(errno);
      p += n;
      bytes -= static_cast<size_t>(n);
    }
  }
  void WritePreamble(tcp::Op::Opcode opcode, size_t payload) {
    tcp::Op op = Preamble(opcode, payload);
    WriteAll(&op.preamble, sizeof(op.preamble));
  }
  // Reads one preamble that rank 0 sent and checks its opcode.
  void ExpectPreamble(tcp::Op::Opcode opcode) {
    tcp::Op op;
    char* p = reinterpret_cast<char*>(&op.preamble);
    size_t left = sizeof(op.preamble);
    while (left > 0) {
      ssize_t n = ::recv(peer_, p, left, 0);
      ASSERT_GT(n, 0) << std::strerror(errno);
      p += n;
      left -= static_cast<size_t>(n);
    }
    EXPECT_EQ(op.preamble.opcode, static_cast<size_t>(opcode));
    EXPECT_EQ(op.preamble.slot, kSlot);
  }

  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<tcp::Context> context_;
  tcp::Pair* pair_ = nullptr;
  int peer_ = -1;
};

// How long `wait` (a waitRecv or waitSend) takes to throw after the pair is signalled.
template <typename Wait>
double SecondsToWake(tcp::Pair* pair, Wait wait, std::string* what) {
  auto waiting = std::async(std::launch::async, [&]() -> std::string {
    try {
      wait();
      return "returned without an error";
    } catch (const std::exception& e) {
      return e.what();
    }
  });
  // Let the wait start (a wait that begins after the signal throws at once anyway).
  std::this_thread::sleep_for(milliseconds(100));
  const auto signalled = Clock::now();
  PairAccess::Signal(pair, std::string(kGlooLocalSignalPrefix) + " test");
  *what = waiting.get();
  return std::chrono::duration<double>(Clock::now() - signalled).count();
}

TEST_F(RawPeer, SignalWakesAReceiveInTheMiddleOfItsPayload) {
  constexpr size_t kBytes = size_t{8} << 20;
  std::vector<uint8_t> memory(kBytes, 0);
  auto buf = context_->createUnboundBuffer(memory.data(), kBytes);
  buf->recv(1, kSlot, 0, kBytes);
  ASSERT_NO_FATAL_FAILURE(ExpectPreamble(tcp::Op::NOTIFY_RECV_READY));
  // Announce the send, start its payload, deliver half of it and stall.
  ASSERT_NO_FATAL_FAILURE(WritePreamble(tcp::Op::NOTIFY_SEND_READY, kBytes));
  ASSERT_NO_FATAL_FAILURE(WritePreamble(tcp::Op::SEND_UNBOUND_BUFFER, kBytes));
  std::vector<uint8_t> half(kBytes / 2, 0xAB);
  ASSERT_NO_FATAL_FAILURE(WriteAll(half.data(), half.size()));
  const auto arrived = Clock::now() + std::chrono::seconds(10);
  while (std::atomic_ref<uint8_t>(memory[kBytes / 2 - 1]).load() != 0xAB) {
    ASSERT_LT(Clock::now(), arrived) << "the first half never arrived";
    std::this_thread::sleep_for(milliseconds(1));
  }
  std::string what;
  const double seconds = SecondsToWake(
      pair_, [&] { buf->waitRecv(nullptr, kWaitTimeout); }, &what);
  EXPECT_LT(seconds, 2.0) << what;
  EXPECT_NE(what.find("test"), std::string::npos) << what;
}

TEST_F(RawPeer, SignalWakesASendWhosePayloadThePeerDoesNotRead) {
  // Far more than the kernel buffers of both ends hold, so that the write stays queued (tx_).
  constexpr size_t kBytes = size_t{256} << 20;
  std::vector<uint8_t> memory(kBytes, 0xCD);
  auto buf = context_->createUnboundBuffer(memory.data(), kBytes);
  buf->send(1, kSlot, 0, kBytes);
  ASSERT_NO_FATAL_FAILURE(ExpectPreamble(tcp::Op::NOTIFY_SEND_READY));
  // Ready to receive: rank 0 starts writing the payload, which this socket never reads.
  ASSERT_NO_FATAL_FAILURE(WritePreamble(tcp::Op::NOTIFY_RECV_READY, kBytes));
  std::this_thread::sleep_for(milliseconds(200));
  std::string what;
  const double seconds = SecondsToWake(
      pair_, [&] { buf->waitSend(nullptr, kWaitTimeout); }, &what);
  EXPECT_LT(seconds, 2.0) << what;
  EXPECT_NE(what.find("test"), std::string::npos) << what;
}

// The pair's own lock: while the test holds it, Gloo's event thread leaves the pair's events for
// later (handleEvents only try-locks), so a connection can be made and reset before Gloo
// accepts it.
struct PairLock : tcp::Pair {
  static std::mutex& Of(tcp::Pair* pair) { return pair->*(&PairLock::m_); }
};

// A peer that connects and resets its connection before Gloo accepted it: accept(2) still hands
// the connection out, getpeername(2) on it fails with ENOTCONN, and Gloo's handleConnected
// enforced that on its event thread, which ended the process. With gloo_accept_guard.cc the
// pair fails like any closed connection: its connect throws, the process lives.
TEST(AcceptGuard, APeerThatResetsBeforeGlooAcceptsFailsThePairNotTheProcess) {
  ASSERT_TRUE(AcceptGuardLinked());
  tcp::attr attr("127.0.0.1");
  auto device = tcp::CreateDevice(attr);
  auto context =
      std::make_shared<tcp::Context>(std::static_pointer_cast<tcp::Device>(device), 0, 2);
  context->setTimeout(milliseconds(5000));
  auto* pair = dynamic_cast<tcp::Pair*>(context->createPair(1).get());
  ASSERT_NE(pair, nullptr);
  // A peer address above ours (127.0.0.2), so that this pair is the listening side.
  sockaddr_in fake{};
  fake.sin_family = AF_INET;
  fake.sin_port = htons(1);
  ASSERT_EQ(inet_pton(AF_INET, "127.0.0.2", &fake.sin_addr), 1);
  sockaddr_storage fake_ss{};
  std::memcpy(&fake_ss, &fake, sizeof(fake));
  const std::vector<char> peer_bytes = tcp::Address(fake_ss).bytes();
  const sockaddr_storage listening = pair->address().getSockaddr();
  std::string what;
  {
    std::lock_guard<std::mutex> hold(PairLock::Of(pair));
    int s = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(s, 0);
    ASSERT_EQ(::connect(s, reinterpret_cast<const sockaddr*>(&listening), sizeof(sockaddr_in)), 0)
        << std::strerror(errno);
    linger reset{.l_onoff = 1, .l_linger = 0};
    ASSERT_EQ(setsockopt(s, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset)), 0);
    close(s);  // RST: the connection waits, reset, in the backlog
    std::this_thread::sleep_for(milliseconds(100));
  }
  // Gloo accepts now, and finds the connection reset when it reads it.
  std::this_thread::sleep_for(milliseconds(300));
  auto connecting = std::async(std::launch::async, [&]() -> std::string {
    try {
      pair->connect(peer_bytes);
      return "connected";
    } catch (const std::exception& e) {
      return e.what();
    }
  });
  ASSERT_EQ(connecting.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  what = connecting.get();
  EXPECT_NE(what, "connected");
  std::fprintf(stderr, "the pair failed with: %s\n", what.c_str());
}

}  // namespace
}  // namespace morph::gloo_support
