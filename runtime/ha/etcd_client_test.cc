// The etcd client and the election against a real 3-member etcd cluster (EtcdCluster). Skipped
// with the reason where no etcd binary is installed.
#include "runtime/ha/etcd_client.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "base/testing.h"
#include "runtime/ha/election.h"
#include "runtime/ha/etcd_testutil.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

TEST(Base64, RoundTripsEveryLength) {
  std::string bytes;
  for (int n = 0; n < 70; ++n) {
    std::string enc = Base64Encode(bytes);
    MORPH_ASSERT_OK_AND_ASSIGN(std::string dec, Base64Decode(enc));
    EXPECT_EQ(dec, bytes);
    bytes.push_back(static_cast<char>(n * 37 + 200));
  }
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_THAT(Base64Decode("Zm9"), StatusIs(StatusCode::kDataLoss, HasSubstr("length")));
  EXPECT_THAT(Base64Decode("Z!9v"), StatusIs(StatusCode::kDataLoss, HasSubstr("character")));
}

TEST(EtcdOptions, ParsesTheList) {
  MORPH_ASSERT_OK_AND_ASSIGN(EtcdOptions o, EtcdOptions::Parse("http://a:1,b:2/, [::1]:3"));
  EXPECT_EQ(o.endpoints, (std::vector<std::string>{"a:1", "b:2", "[::1]:3"}));
  EXPECT_THAT(EtcdOptions::Parse(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_ETCD")));
  EXPECT_THAT(EtcdOptions::Parse("a"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_ETCD")));
}

TEST(EtcdClient, NothingListeningIsUnavailable) {
  EtcdOptions o;
  o.endpoints = {"127.0.0.1:" + std::to_string(FreeLoopbackPort())};
  o.timeout = std::chrono::milliseconds(300);
  EtcdClient etcd(o);
  EXPECT_THAT(etcd.Get("k").status(), StatusIs(StatusCode::kUnavailable, HasSubstr("127.0.0.1")));
}

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StatusOr<std::unique_ptr<EtcdCluster>> c = EtcdCluster::Start(3);
    if (!c.ok() && c.status().code() == StatusCode::kNotFound) GTEST_SKIP() << c.status();
    MORPH_ASSERT_OK(c.status());
    cluster_ = *std::move(c);
  }
  std::unique_ptr<EtcdCluster> cluster_;
};

TEST_F(EtcdTest, KeysLeasesAndTransactions) {
  EtcdClient etcd(cluster_->options());
  MORPH_ASSERT_OK(etcd.Put("/j/a", std::string("bin\0ary", 7)));
  MORPH_ASSERT_OK(etcd.Put("/j/b", "2"));
  MORPH_ASSERT_OK(etcd.Put("/k", "3"));
  MORPH_ASSERT_OK_AND_ASSIGN(std::optional<EtcdKv> a, etcd.Get("/j/a"));
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->value, std::string("bin\0ary", 7));
  MORPH_ASSERT_OK_AND_ASSIGN(std::optional<EtcdKv> none, etcd.Get("/nope"));
  EXPECT_FALSE(none.has_value());
  MORPH_ASSERT_OK_AND_ASSIGN(std::vector<EtcdKv> j, etcd.GetPrefix("/j/"));
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[1].key, "/j/b");

  MORPH_ASSERT_OK_AND_ASSIGN(int64_t lease, etcd.LeaseGrant(5));
  MORPH_ASSERT_OK_AND_ASSIGN(bool won, etcd.CreateIfAbsent("/j/leader", "me", lease));
  EXPECT_TRUE(won);
  MORPH_ASSERT_OK_AND_ASSIGN(won, etcd.CreateIfAbsent("/j/leader", "you", 0));
  EXPECT_FALSE(won);
  MORPH_ASSERT_OK_AND_ASSIGN(int64_t ttl, etcd.LeaseKeepAlive(lease));
  EXPECT_GT(ttl, 0);

  EtcdFence fence{.key = "/j/leader", .value = "me", .lease = lease};
  MORPH_ASSERT_OK(etcd.FencedPut(fence, {{"/j/state", "s1"}}, {"/j/b"}));
  MORPH_ASSERT_OK_AND_ASSIGN(std::optional<EtcdKv> b, etcd.Get("/j/b"));
  EXPECT_FALSE(b.has_value());
  // The wrong value, or the right value on another lease: refused, nothing written.
  EXPECT_THAT(etcd.FencedPut(EtcdFence{.key = "/j/leader", .value = "you", .lease = lease},
                             {{"/j/state", "s2"}}),
              StatusIs(StatusCode::kAborted, HasSubstr("fence lost")));
  EXPECT_THAT(etcd.FencedPut(EtcdFence{.key = "/j/leader", .value = "me", .lease = lease + 1},
                             {{"/j/state", "s2"}}),
              StatusIs(StatusCode::kAborted, HasSubstr("fence lost")));
  // Revoked: the leader key goes with the lease, and so does the fence.
  MORPH_ASSERT_OK(etcd.LeaseRevoke(lease));
  EXPECT_THAT(etcd.LeaseKeepAlive(lease), StatusIs(StatusCode::kNotFound, HasSubstr("expired")));
  EXPECT_THAT(etcd.FencedPut(fence, {{"/j/state", "s3"}}), StatusIs(StatusCode::kAborted, HasSubstr("fence")));
  MORPH_ASSERT_OK_AND_ASSIGN(std::optional<EtcdKv> s, etcd.Get("/j/state"));
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->value, "s1");
  MORPH_ASSERT_OK(etcd.DeletePrefix("/j/"));
  MORPH_ASSERT_OK_AND_ASSIGN(j, etcd.GetPrefix("/j/"));
  EXPECT_TRUE(j.empty());
}

// One member killed: every call still goes through (the client moves to another member).
TEST_F(EtcdTest, OneMemberDownChangesNothing) {
  EtcdClient etcd(cluster_->options());
  MORPH_ASSERT_OK(etcd.Put("/m", "1"));
  cluster_->Kill(0);
  for (int i = 0; i < 20; ++i) {
    MORPH_ASSERT_OK(etcd.Put("/m", std::to_string(i)));
    MORPH_ASSERT_OK_AND_ASSIGN(std::optional<EtcdKv> kv, etcd.Get("/m"));
    ASSERT_TRUE(kv.has_value());
    EXPECT_EQ(kv->value, std::to_string(i));
  }
}

struct Candidate {
  std::atomic<int> elected{0}, deposed{0};
  std::unique_ptr<Election> election;
};

std::unique_ptr<Candidate> Campaign(const EtcdOptions& o, const std::string& value) {
  auto c = std::make_unique<Candidate>();
  Candidate* p = c.get();
  auto e = Election::Start(ElectionOptions{.etcd = o, .prefix = "/job", .value = value, .ttl_s = 1},
                           Election::Callbacks{.elected = [p](const EtcdFence&) { ++p->elected; },
                                               .deposed = [p](const Status&) { ++p->deposed; }});
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) c->election = *std::move(e);
  return c;
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

// One of three candidates leads; when it resigns another leads at once, and when it stops
// renewing (a crash: its lease left to expire) another leads within two TTLs; the old fence is
// refused.
TEST_F(EtcdTest, ElectionHasOneLeaderAndASuccessor) {
  EtcdOptions o = cluster_->options();
  std::vector<std::unique_ptr<Candidate>> c;
  for (int i = 0; i < 3; ++i) c.push_back(Campaign(o, "cand" + std::to_string(i)));
  auto leaders = [&] {
    int n = 0;
    for (auto& x : c) n += x->election && x->election->leading();
    return n;
  };
  ASSERT_TRUE(WaitFor([&] { return leaders() == 1; }, std::chrono::seconds(5)));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(leaders(), 1);
  int first = 0;
  while (!c[first]->election->leading()) ++first;
  EtcdFence old = c[first]->election->fence();
  EtcdClient etcd(o);
  MORPH_ASSERT_OK_AND_ASSIGN(std::optional<std::string> who, LookupLeader(etcd, "/job"));
  ASSERT_TRUE(who.has_value());
  EXPECT_EQ(*who, "cand" + std::to_string(first));
  MORPH_ASSERT_OK(etcd.FencedPut(old, {{"/job/state", "a"}}));

  // Resigning: a successor at once (no TTL to wait out).
  const auto t0 = Clock::now();
  c[first]->election->Stop();
  EXPECT_EQ(c[first]->deposed.load(), 1);
  ASSERT_TRUE(WaitFor([&] { return leaders() == 1; }, std::chrono::seconds(3)));
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1000));
  EXPECT_THAT(etcd.FencedPut(old, {{"/job/state", "b"}}), StatusIs(StatusCode::kAborted, HasSubstr("fence")));

  // A crash: the second leader's lease is revoked behind its back (as if it had stopped
  // renewing): it steps down and the third leads.
  int second = 0;
  while (!c[second]->election || !c[second]->election->leading() || second == first) ++second;
  const auto t1 = Clock::now();
  MORPH_ASSERT_OK(etcd.LeaseRevoke(c[second]->election->fence().lease));
  ASSERT_TRUE(WaitFor([&] { return c[second]->deposed.load() == 1; }, std::chrono::seconds(2)));
  ASSERT_TRUE(WaitFor([&] { return leaders() == 1 && !c[second]->election->leading(); },
                      std::chrono::seconds(2)));
  EXPECT_EQ(c[second]->elected.load(), 1);  // a deposed candidate waits a TTL before campaigning
  EXPECT_LT(Clock::now() - t1, std::chrono::milliseconds(2000));
}

}  // namespace
}  // namespace morph
