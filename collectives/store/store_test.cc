#include "collectives/store/store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "base/testing.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "s3cret-token";

// Makes stores of one job for a generation, in memory or over TCP.
class StoreFactory {
 public:
  explicit StoreFactory(bool tcp) : tcp_(tcp) {
    if (tcp_) {
      auto server = TcpStoreServer::Start("127.0.0.1", 0, kToken);
      server.status().CheckOk("starting store server");
      server_ = *std::move(server);
      table_ = server_->table();
    } else {
      table_ = std::make_shared<KvTable>();
    }
  }
  std::unique_ptr<Store> Make(int64_t generation) {
    if (!tcp_) return std::make_unique<MemoryStore>(table_, generation);
    auto client =
        TcpStoreClient::Connect(server_->address(), kToken, generation, Deadline::AfterMs(5000));
    client.status().CheckOk("connecting");
    return *std::move(client);
  }
  KvTable& table() { return *table_; }
  std::unique_ptr<TcpStoreServer>& server() { return server_; }

 private:
  bool tcp_;
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<KvTable> table_;
};

class StoreTest : public ::testing::TestWithParam<bool> {
 protected:
  StoreFactory f_{GetParam()};
};

TEST_P(StoreTest, SetGetOverwrite) {
  auto s = f_.Make(0);
  MORPH_ASSERT_OK(s->Set("a", "1", Deadline::AfterMs(1000)));
  MORPH_ASSERT_OK(s->Set("a", std::string("x\0y", 3), Deadline::AfterMs(1000)));
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v, s->Get("a", Deadline::AfterMs(1000)));
  EXPECT_EQ(v, std::string("x\0y", 3));
}

TEST_P(StoreTest, GetBlocksUntilSetByAnotherClient) {
  auto reader = f_.Make(0);
  auto writer = f_.Make(0);
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    writer->Set("late", "here", Deadline::AfterMs(1000)).CheckOk("set");
  });
  StatusOr<std::string> v = reader->Get("late", Deadline::AfterMs(5000));
  t.join();
  MORPH_ASSERT_OK(v);
  EXPECT_EQ(*v, "here");
}

TEST_P(StoreTest, OneClientServesABlockedGetAndASetConcurrently) {
  auto s = f_.Make(0);
  StatusOr<std::string> v = std::string();
  std::thread t([&] { v = s->Get("x", Deadline::AfterMs(5000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  MORPH_ASSERT_OK(s->Set("x", "from the same client", Deadline::AfterMs(1000)));
  t.join();
  MORPH_ASSERT_OK(v);
  EXPECT_EQ(*v, "from the same client");
}

TEST_P(StoreTest, GetTimesOutNamingTheKey) {
  auto s = f_.Make(0);
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(s->Get("never", Deadline::AfterMs(100)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("'never'")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  // The client is still usable after a timeout.
  MORPH_EXPECT_OK(s->Set("k", "v", Deadline::AfterMs(1000)));
}

TEST_P(StoreTest, WaitForSeveralKeys) {
  auto s = f_.Make(0);
  std::vector<std::string> keys{"w1", "w2"};
  EXPECT_THAT(s->Wait(keys, Deadline::AfterMs(50)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("'w1' (and 1 more)")));
  MORPH_ASSERT_OK(s->Set("w1", "", Deadline::AfterMs(1000)));
  EXPECT_THAT(s->Wait(keys, Deadline::AfterMs(50)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("key 'w2'")));
  MORPH_ASSERT_OK(s->Set("w2", "", Deadline::AfterMs(1000)));
  MORPH_EXPECT_OK(s->Wait(keys, Deadline::AfterMs(1000)));
}

TEST_P(StoreTest, AddSemantics) {
  auto s = f_.Make(0);
  MORPH_ASSERT_OK_AND_ASSIGN(int64_t a, s->Add("n", 5, Deadline::AfterMs(1000)));
  EXPECT_EQ(a, 5);
  MORPH_ASSERT_OK_AND_ASSIGN(int64_t b, s->Add("n", -7, Deadline::AfterMs(1000)));
  EXPECT_EQ(b, -2);
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v, s->Get("n", Deadline::AfterMs(1000)));
  EXPECT_EQ(v, "-2");
  MORPH_ASSERT_OK(s->Set("text", "12abc", Deadline::AfterMs(1000)));
  EXPECT_THAT(s->Add("text", 1, Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("key 'text' holds '12abc'")));
  MORPH_ASSERT_OK(s->Set("big", std::to_string(INT64_MAX), Deadline::AfterMs(1000)));
  EXPECT_THAT(s->Add("big", 1, Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST_P(StoreTest, ConcurrentAddsAreAtomic) {
  constexpr int kThreads = 4, kEach = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto s = f_.Make(0);
      for (int i = 0; i < kEach; ++i) s->Add("ctr", 1, Deadline::AfterMs(5000)).status().CheckOk();
    });
  }
  for (auto& t : threads) t.join();
  auto s = f_.Make(0);
  MORPH_ASSERT_OK_AND_ASSIGN(int64_t v, s->Add("ctr", 0, Deadline::AfterMs(1000)));
  EXPECT_EQ(v, kThreads * kEach);
}

TEST_P(StoreTest, CompareAndSetSemantics) {
  auto s = f_.Make(0);
  // Absent key, expected absent: swaps.
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v1,
                             s->CompareAndSet("c", std::nullopt, "one", Deadline::AfterMs(1000)));
  EXPECT_EQ(v1, "one");
  // Present key, expected absent: no swap, returns current.
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v2,
                             s->CompareAndSet("c", std::nullopt, "two", Deadline::AfterMs(1000)));
  EXPECT_EQ(v2, "one");
  // Mismatch: no swap.
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v3,
                             s->CompareAndSet("c", "zzz", "two", Deadline::AfterMs(1000)));
  EXPECT_EQ(v3, "one");
  // Match: swap.
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v4,
                             s->CompareAndSet("c", "one", "two", Deadline::AfterMs(1000)));
  EXPECT_EQ(v4, "two");
  // Absent key with an expected value.
  EXPECT_THAT(s->CompareAndSet("nokey", "x", "y", Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kNotFound, HasSubstr("key 'nokey' is not set")));
}

TEST_P(StoreTest, GenerationsAreSeparateAndOldOnesRejected) {
  auto g3 = f_.Make(3);
  auto g4 = f_.Make(4);
  MORPH_ASSERT_OK(g3->Set("addr", "old", Deadline::AfterMs(1000)));
  // A fresh namespace per generation.
  EXPECT_THAT(g4->Get("addr", Deadline::AfterMs(50)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("'addr'")));
  // A g3 call blocked in Get is woken by the advance with kAborted.
  StatusOr<std::string> blocked = std::string();
  std::thread t([&] { blocked = g3->Get("never", Deadline::AfterMs(10000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto start = std::chrono::steady_clock::now();
  if (f_.server() != nullptr) {
    // Over TCP only the server's owner skips generations (0 -> 4); see TcpStoreHostileTest.
    f_.server()->AdvanceGeneration(4);
  } else {
    MORPH_ASSERT_OK(g4->AdvanceGeneration(4, Deadline::AfterMs(1000)));
  }
  t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_THAT(blocked, StatusIs(StatusCode::kAborted,
                                HasSubstr("generation 3 is older than the store's current "
                                          "generation 4")));
  EXPECT_THAT(g3->Set("addr", "x", Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kAborted, HasSubstr("generation 3")));
  EXPECT_THAT(g3->AdvanceGeneration(9, Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kAborted, HasSubstr("generation 3")));
  // The old generation's keys are gone; advancing backwards is a no-op.
  EXPECT_EQ(f_.table().size(), 0u);
  MORPH_ASSERT_OK(g4->AdvanceGeneration(2, Deadline::AfterMs(1000)));
  EXPECT_EQ(f_.table().min_generation(), 4);
  MORPH_EXPECT_OK(g4->Set("addr", "new", Deadline::AfterMs(1000)));
}

TEST_P(StoreTest, BarrierReleasesAllAtOnce) {
  constexpr int kN = 4;
  std::vector<std::thread> threads;
  std::vector<Status> results(kN);
  for (int r = 0; r < kN; ++r) {
    threads.emplace_back([&, r] {
      auto s = f_.Make(1);
      results[r] = StoreBarrier(*s, "b", kN, Deadline::AfterMs(5000));
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) MORPH_EXPECT_OK(s);
  auto s = f_.Make(1);
  EXPECT_THAT(StoreBarrier(*s, "lonely", 2, Deadline::AfterMs(50)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("barrier 'lonely'")));
}

INSTANTIATE_TEST_SUITE_P(MemoryAndTcp, StoreTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Tcp" : "Memory"; });

TEST(KvTableTest, AWaitResumesAtItsFirstMissingKey) {
  KvTable t;
  auto set = [&](const char* k) {
    ASSERT_TRUE(t.TryApply({.op = KvTable::Op::kSet, .keys = {k}}).has_value());
  };
  const KvTable::Request wait{.op = KvTable::Op::kWait, .keys = {"a", "b", "c"}};
  set("a");
  size_t at = 0;
  EXPECT_FALSE(t.TryApply(wait, &at).has_value());
  EXPECT_EQ(at, 1u);
  set("c");
  EXPECT_FALSE(t.TryApply(wait, &at).has_value());
  EXPECT_EQ(at, 1u);  // still waiting for "b"
  set("b");
  EXPECT_TRUE(t.TryApply(wait, &at).has_value());
  // Reads create no per-generation state.
  EXPECT_FALSE(t.TryApply({.op = KvTable::Op::kGet, .generation = 99, .keys = {"x"}}, &at));
  EXPECT_EQ(at, 0u);
  EXPECT_EQ(t.size(), 3u);
}

TEST(TcpStoreTest, WrongTokenIsRefusedAndDisconnected) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  EXPECT_THAT(TcpStoreClient::Connect(server->address(), "wrong", 0, Deadline::AfterMs(2000)),
              StatusIs(StatusCode::kUnauthenticated, HasSubstr("token was refused")));
  EXPECT_THAT(TcpStoreClient::Connect(server->address(), "", 0, Deadline::AfterMs(2000)),
              StatusIs(StatusCode::kUnauthenticated, HasSubstr("token was refused")));
  // The server closed those connections.
  for (int i = 0; i < 200 && server->connections() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(server->connections(), 0);
}

TEST(TcpStoreTest, JobTokenFromEnvironment) {
  ::setenv("MORPH_TOKEN", "from-env", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(std::string t, JobTokenFromEnv());
  EXPECT_EQ(t, "from-env");
  ::unsetenv("MORPH_TOKEN");
  ::unsetenv("MORPH_TOKEN_FILE");
  EXPECT_THAT(JobTokenFromEnv(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no job token")));
  std::string path = ::testing::TempDir() + "/morph_token";
  { std::ofstream(path) << "  file-token\n"; }
  ::setenv("MORPH_TOKEN_FILE", path.c_str(), 1);
  MORPH_ASSERT_OK_AND_ASSIGN(std::string f, JobTokenFromEnv());
  EXPECT_EQ(f, "file-token");
  ::setenv("MORPH_TOKEN_FILE", "/nonexistent/morph_token", 1);
  EXPECT_THAT(JobTokenFromEnv(),
              StatusIs(StatusCode::kNotFound, HasSubstr("/nonexistent/morph_token")));
  ::unsetenv("MORPH_TOKEN_FILE");
  EXPECT_THAT(TcpStoreServer::Start("127.0.0.1", 0, ""),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("job token is empty")));
}

TEST(TcpStoreTest, BadAddresses) {
  EXPECT_THAT(TcpStoreClient::Connect("nohost", kToken, 0, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("expected host:port")));
  EXPECT_THAT(TcpStoreClient::Connect("127.0.0.1:99999", kToken, 0, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("bad port '99999'")));
  EXPECT_THAT(TcpStoreClient::Connect("no-such-host.invalid:80", kToken, 0,
                                      Deadline::AfterMs(100)),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("host 'no-such-host.invalid' is not known")));
  EXPECT_THAT(TcpStoreServer::Start("not-an-ip", 0, kToken),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("'not-an-ip'")));
}

TEST(TcpStoreTest, ServerDeathIsUnavailable) {
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  std::string address = server->address();
  MORPH_ASSERT_OK_AND_ASSIGN(auto client,
                             TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(2000)));
  MORPH_ASSERT_OK(client->Set("k", "v", Deadline::AfterMs(1000)));
  // A Get blocked in the server when it dies.
  StatusOr<std::string> blocked = std::string();
  auto other = *TcpStoreClient::Connect(address, kToken, 0, Deadline::AfterMs(2000));
  std::thread t([&] { blocked = other->Get("never", Deadline::AfterMs(10000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  server.reset();
  t.join();
  EXPECT_THAT(blocked, StatusIs(StatusCode::kUnavailable, HasSubstr(address)));
  EXPECT_THAT(client->Set("k", "v", Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kUnavailable, HasSubstr(address)));
  // Reconnecting to a dead server is reported at once, not at the deadline.
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(client->Get("k", Deadline::AfterMs(5000)),
              StatusIs(StatusCode::kUnavailable, HasSubstr(address)));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

}  // namespace
}  // namespace morph
