#include "runtime/api/bootstrap.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/testing.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

TEST(BootstrapTest, FirstSlurmHost) {
  EXPECT_EQ(*FirstSlurmHost("node07"), "node07");
  EXPECT_EQ(*FirstSlurmHost("a,b,c"), "a");
  EXPECT_EQ(*FirstSlurmHost("node[01-04,07],gpu5"), "node01");
  EXPECT_EQ(*FirstSlurmHost("n[3]"), "n3");
  EXPECT_EQ(*FirstSlurmHost("n[12-13]-ib,x"), "n12-ib");
  EXPECT_THAT(FirstSlurmHost(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(FirstSlurmHost("n[1-2"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("']'")));
  EXPECT_THAT(FirstSlurmHost("n[a-b]"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("does not start with a number")));
}

TEST(BootstrapTest, TheHostWritesItsAddressAndTokenToTheCoordinatorFile) {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("morph-bootstrap-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  Options o;
  o.bootstrap = Bootstrap::kHost;
  o.coordinator_file = (dir / "coordinator").string();
  {
    std::ofstream old(o.coordinator_file);  // a stale file, world-readable: replaced
    old << "stale\n";
  }
  chmod(o.coordinator_file.c_str(), 0644);
  StatusOr<BootstrapResult> r = ResolveBootstrap(o, Deadline::AfterMs(5000));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE(r->coordinator, nullptr);
  std::ifstream in(o.coordinator_file);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), r->coordinator->control_address() + "\n" + r->token + "\n");
  struct stat st;
  ASSERT_EQ(stat(o.coordinator_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  r->coordinator->Stop();

  o.coordinator_file = (dir / "missing-dir" / "coordinator").string();
  EXPECT_THAT(ResolveBootstrap(o, Deadline::AfterMs(5000)),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("MORPH_COORDINATOR_FILE=" + o.coordinator_file +
                                 ": cannot create")));
  std::filesystem::remove_all(dir);
}

TEST(BootstrapTest, JoiningNeedsAToken) {
  Options o;
  o.coordinator = "127.0.0.1:1";
  EXPECT_THAT(ResolveBootstrap(o, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("MORPH_TOKEN")));
  o.token = "t";
  StatusOr<BootstrapResult> r = ResolveBootstrap(o, Deadline::AfterMs(100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mode, Bootstrap::kJoin);
  EXPECT_EQ(r->coordinator_address, "127.0.0.1:1");
  EXPECT_EQ(r->coordinator, nullptr);
}

TEST(BootstrapTest, SlurmNeedsASharedToken) {
  Options o;
  o.launcher_rank = 1;
  o.launcher_size = 4;
  o.slurm_nodelist = "node[3-6]";
  o.host = "node4";
  EXPECT_THAT(ResolveBootstrap(o, Deadline::AfterMs(100)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("export MORPH_TOKEN")));
  o.token = "t";
  StatusOr<BootstrapResult> r = ResolveBootstrap(o, Deadline::AfterMs(100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mode, Bootstrap::kSlurm);
  EXPECT_EQ(r->coordinator_address, "node3:29400");
  EXPECT_EQ(r->data_hostname, "node4");
  EXPECT_EQ(r->coordinator, nullptr);  // only task 0 hosts
}

// morphrun --slurm's workers: one step each (SLURM_PROCID 0 in every one), the coordinator's
// address given. They join, and their data plane listens on the host's name, not loopback.
TEST(BootstrapTest, ASlurmStepJoiningAJobListensOnItsHostName) {
  Options o;
  o.coordinator = "batchhost:4000";
  o.token = "t";
  o.launcher_rank = 0;
  o.launcher_size = 1;
  o.slurm_nodelist = "node5";
  o.host = "node5";
  o.data_hostname = "127.0.0.1";  // the default
  StatusOr<BootstrapResult> r = ResolveBootstrap(o, Deadline::AfterMs(100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mode, Bootstrap::kJoin);
  EXPECT_EQ(r->coordinator_address, "batchhost:4000");
  EXPECT_EQ(r->coordinator, nullptr);  // SLURM_PROCID 0 does not host when told whom to join
  EXPECT_EQ(r->data_hostname, "node5");
  o.data_hostname = "10.1.2.3";  // an explicit choice stays
  r = ResolveBootstrap(o, Deadline::AfterMs(100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->data_hostname, "10.1.2.3");
}

TEST(BootstrapTest, WritePrivateFileNamesWhatItWrites) {
  std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("morph-private-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::string path = (dir / "token").string();
  ASSERT_TRUE(WritePrivateFile(path, "secret\n", "token file").ok());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "secret\n");
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::string bad = (dir / "no" / "token").string();
  EXPECT_THAT(WritePrivateFile(bad, "x", "token file"),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("token file=" + bad + ": cannot create")));
  std::filesystem::remove_all(dir);
}

TEST(BootstrapTest, RandomTokensDiffer) {
  StatusOr<std::string> a = RandomToken(), b = RandomToken();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 32u);
  EXPECT_NE(*a, *b);
}

// Candidates hosted by workers (MORPH_ETCD, no MORPH_COORDINATOR): what needs no etcd to check.
TEST(BootstrapTest, EtcdWithoutACoordinatorPicksHostedCandidates) {
  Options o;
  o.etcd = "127.0.0.1:1";
  o.etcd_prefix = "/morph/bootstrap-test";
  // No token: a candidate cannot make one up, the others must use the same.
  EXPECT_THAT(ResolveBootstrap(o, Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("MORPH_TOKEN")));
  o.token = "bootstrap-test-token";
  // Past the first MORPH_ETCD_CANDIDATES workers (or not launched by anyone): no candidate here,
  // the leader comes from etcd.
  o.launch_index = 3;
  StatusOr<BootstrapResult> r = ResolveBootstrap(o, Deadline::AfterMs(1000));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mode, Bootstrap::kEtcd);
  EXPECT_TRUE(r->leader_from_etcd);
  EXPECT_EQ(r->coordinator, nullptr);
  EXPECT_EQ(r->coordinator_address, "");
  // Under morphrun --slurm every worker is task 0 of its own step: morphrun's index decides.
  o.launcher_rank = 0;
  o.launcher_size = 1;
  r = ResolveBootstrap(o, Deadline::AfterMs(1000));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, nullptr);
  o.launcher_rank = -1;
  o.launcher_size = -1;
  o.launch_index = -1;
  r = ResolveBootstrap(o, Deadline::AfterMs(1000));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->coordinator, nullptr);
  // A given coordinator wins (workers of morphd candidates may start with the leader's address).
  o.coordinator = "127.0.0.1:2";
  r = ResolveBootstrap(o, Deadline::AfterMs(1000));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mode, Bootstrap::kJoin);
  EXPECT_FALSE(r->leader_from_etcd);
  o.coordinator.clear();
  o.etcd = "";
  o.bootstrap = Bootstrap::kEtcd;
  EXPECT_THAT(ResolveBootstrap(o, Deadline::AfterMs(1000)),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_ETCD")));
}

TEST(BootstrapTest, FindLeaderGivesUpAtItsDeadline) {
  StatusOr<EtcdOptions> eo = EtcdOptions::Parse("127.0.0.1:1");
  ASSERT_TRUE(eo.ok()) << eo.status();
  eo->timeout = std::chrono::milliseconds(100);
  EtcdClient etcd(*eo);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THAT(FindLeader(etcd, "/morph/nobody", Deadline::AfterMs(300)),
              StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("no coordinator leads /morph/nobody")));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

}  // namespace
}  // namespace morph
