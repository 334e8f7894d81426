#include "runtime/coordinator/process_watch.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

namespace morph {
namespace {

TEST(ProcessWatchTest, ParsesStatPastACommandNameWithSpacesAndParentheses) {
  // Fields: pid (comm) state ppid pgrp session tty tpgid flags ... starttime (22nd).
  const std::string line =
      "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 7 0 98765 1000 200 "
      "18446744073709551615\n";
  std::optional<ProcStat> s = ParseProcStat(line);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->state, 'S');
  EXPECT_EQ(s->flags, 4194560u);
  EXPECT_EQ(s->start_time, 98765u);
  EXPECT_FALSE(ParseProcStat("4242 (a) S 1 2").has_value());
  EXPECT_FALSE(ParseProcStat("no parenthesis at all").has_value());
}

TEST(ProcessWatchTest, FindsTheInodeOfTheConnectionWithBothEnds) {
  // 127.0.0.1:40000 -> 127.0.0.1:8080 and the reverse socket, as /proc/net/tcp prints them.
  const std::string table =
      "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
      "timeout inode\n"
      "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0  "
      "      0 111 1 0000000000000000 100 0 0 10 0\n"
      "   1: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0  "
      "      0 222 1 0000000000000000 20 4 30 10 -1\n"
      "   2: 0100007F:1F90 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0  "
      "      0 333 1 0000000000000000 20 4 30 10 -1\n";
  SocketEnd a{.address = std::string("\x7f\x00\x00\x01", 4), .port = 40000};
  SocketEnd b{.address = std::string("\x7f\x00\x00\x01", 4), .port = 8080};
  EXPECT_EQ(FindTcpInode(table, a, b), std::optional<uint64_t>(222));
  EXPECT_EQ(FindTcpInode(table, b, a), std::optional<uint64_t>(333));
  SocketEnd c{.address = std::string("\x7f\x00\x00\x01", 4), .port = 40001};
  EXPECT_FALSE(FindTcpInode(table, c, b).has_value());
}

SocketEnd EndOf(const sockaddr_in& a) {
  return SocketEnd{.address = std::string(reinterpret_cast<const char*>(&a.sin_addr), 4),
                   .port = ntohs(a.sin_port)};
}

// A child connected to a socket this test listens on; the grandchild it forks holds the same
// connection, so the connection outlives the child (as it does, for a moment, a SIGKILLed
// process whose memory the kernel is still freeing).
struct ConnectedChild {
  pid_t child = -1, grandchild = -1;
  int accepted = -1;
  sockaddr_in ours{}, theirs{};
  ~ConnectedChild() {
    if (grandchild > 0) kill(grandchild, SIGKILL);
    if (child > 0) {
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
    }
    if (accepted >= 0) close(accepted);
  }
};

void Start(ConnectedChild& cc) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  cc.child = fork();
  ASSERT_GE(cc.child, 0);
  if (cc.child == 0) {
    close(pipefd[0]);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(1);
    pid_t g = fork();
    if (g == 0) {
      for (;;) pause();
    }
    (void)!write(pipefd[1], &g, sizeof(g));
    for (;;) pause();
  }
  close(pipefd[1]);
  cc.accepted = accept(listener, nullptr, nullptr);
  close(listener);
  ASSERT_GE(cc.accepted, 0);
  ASSERT_EQ(read(pipefd[0], &cc.grandchild, sizeof(cc.grandchild)),
            static_cast<ssize_t>(sizeof(cc.grandchild)));
  close(pipefd[0]);
  len = sizeof(cc.ours);
  ASSERT_EQ(getsockname(cc.accepted, reinterpret_cast<sockaddr*>(&cc.ours), &len), 0);
  len = sizeof(cc.theirs);
  ASSERT_EQ(getpeername(cc.accepted, reinterpret_cast<sockaddr*>(&cc.theirs), &len), 0);
}

TEST(ProcessWatchTest, ProvesThePeerProcessAndSeesItDieWhileItsConnectionStaysOpen) {
  ConnectedChild cc;
  ASSERT_NO_FATAL_FAILURE(Start(cc));
  std::optional<WatchedProcess> w = VerifyPeerProcess(cc.child, EndOf(cc.ours), EndOf(cc.theirs));
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->pid, cc.child);
  EXPECT_FALSE(ProcessGone(*w));
  // A process that does not hold the connection (this one: it holds the other end), the ends
  // swapped, and no process at all are not proven.
  EXPECT_FALSE(VerifyPeerProcess(getpid(), EndOf(cc.ours), EndOf(cc.theirs)).has_value());
  EXPECT_FALSE(VerifyPeerProcess(cc.child, EndOf(cc.theirs), EndOf(cc.ours)).has_value());
  EXPECT_FALSE(VerifyPeerProcess(0, EndOf(cc.ours), EndOf(cc.theirs)).has_value());

  ASSERT_EQ(kill(cc.child, SIGKILL), 0);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!ProcessGone(*w) && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(ProcessGone(*w)) << "a killed, unreaped child";
  // The connection is still open: the grandchild holds it, nothing arrived, no end of file.
  char byte;
  EXPECT_EQ(recv(cc.accepted, &byte, 1, MSG_DONTWAIT), -1);
  EXPECT_EQ(errno, EAGAIN);
  ASSERT_EQ(waitpid(cc.child, nullptr, 0), cc.child);
  cc.child = -1;
  EXPECT_TRUE(ProcessGone(*w)) << "reaped";
  // A different start time is another process that got the pid.
  WatchedProcess reused{.pid = getpid(), .start_time = 1};
  EXPECT_TRUE(ProcessGone(reused));
}

TEST(ProcessWatchTest, AThreadGroupWhoseLeaderExitedLivesOn) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipefd[0]);
    pthread_t t;
    pthread_create(
        &t, nullptr,
        [](void*) -> void* {
          for (;;) pause();
        },
        nullptr);
    (void)!write(pipefd[1], "x", 1);
    // The leader thread alone ends (the raw exit: pthread_exit would unwind into gtest) and
    // becomes a zombie; the process goes on.
    syscall(SYS_exit, 0);
  }
  close(pipefd[1]);
  char x;
  ASSERT_EQ(read(pipefd[0], &x, 1), 1);
  close(pipefd[0]);
  // Its start time, read before the leader exits is not guaranteed: take it from a live look.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::optional<ProcStat> before;
  {
    FILE* f = fopen(("/proc/" + std::to_string(child) + "/stat").c_str(), "r");
    ASSERT_NE(f, nullptr);
    char buf[1024] = {};
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    before = ParseProcStat(std::string_view(buf, n));
  }
  ASSERT_TRUE(before.has_value());
  WatchedProcess w{.pid = child, .start_time = before->start_time};
  EXPECT_FALSE(ProcessGone(w)) << "leader state " << before->state;
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_TRUE(ProcessGone(w));
}

}  // namespace
}  // namespace morph
