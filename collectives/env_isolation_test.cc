// The collectives library reads no MORPH_* variable at call time: a program reads the
// environment once, at the top, into options values (GlooOptions::FromEnv,
// TcpStoreServerOptions::FromEnv, ...) and passes them; calls without options use the
// documented defaults. Here every MORPH_* variable holds a value that does not parse (or names
// no host or interface) while the library is called: the calls are unaffected, and only the
// explicit FromEnv readers see the bad values.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/params.h"
#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "collectives/groups.h"
#include "collectives/testing/rank_harness.h"
#include "collectives/store/tcp_store.h"

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kToken[] = "env-isolation-token";

// Sets every declared MORPH_* parameter to a bad value for the lifetime of the object and
// restores the previous values after. Set before any thread of the test starts.
class PoisonedEnvironment {
 public:
  PoisonedEnvironment() {
    for (const params::ParamInfo& p : params::All()) {
      const char* old = ::getenv(p.env_name);
      saved_.push_back({p.env_name, old ? std::optional<std::string>(old) : std::nullopt});
      ::setenv(p.env_name, Poison(p.type), 1);
    }
  }
  ~PoisonedEnvironment() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name, value->c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  }

 private:
  static const char* Poison(params::ParamType type) {
    switch (type) {
      case params::ParamType::kBool:
        return "maybe";
      case params::ParamType::kInt64:
      case params::ParamType::kDouble:
        return "not-a-number";
      case params::ParamType::kBytes:
        return "lots";
      case params::ParamType::kString:
        return "no-such-host.invalid";  // as a host, an interface, a coordinator address
    }
    return "?";
  }
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

TEST(EnvIsolationTest, TheReadersSeeThePoison) {
  PoisonedEnvironment env;
  EXPECT_THAT(TcpStoreServerOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_STORE_MAX_CONNECTIONS")));
  EXPECT_THAT(GlooOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_GLOO_UNBIND_THREADS")));
  ::setenv("MORPH_GLOO_UNBIND_THREADS", "0", 1);
  EXPECT_THAT(GlooOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_GLOO_SHM")));
  ::setenv("MORPH_GLOO_SHM", "0", 1);
  EXPECT_THAT(GlooOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_GLOO_SHM_SPIN_US")));
  ::setenv("MORPH_GLOO_SHM_SPIN_US", "5", 1);
  EXPECT_THAT(GlooOptions::FromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_GLOO_SHM_YIELD_US")));
  ::setenv("MORPH_GLOO_SHM_YIELD_US", "7", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(GlooOptions gloo, GlooOptions::FromEnv());
  EXPECT_EQ(gloo.iface, "no-such-host.invalid");
  EXPECT_FALSE(gloo.unbind_threads);
  EXPECT_FALSE(gloo.shared_memory);
  EXPECT_EQ(gloo.shm_spin, std::chrono::microseconds(5));
  EXPECT_EQ(gloo.shm_yield, std::chrono::microseconds(7));
  EXPECT_THAT(GlooDevice::Create(gloo).status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("no-such-host.invalid")));
  EXPECT_THAT(CollectiveTimeoutFromEnv().status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_COLLECTIVE_TIMEOUT_MS")));
}

// The defaults of the options structs are the documented defaults of their variables.
TEST(EnvIsolationTest, OptionDefaultsAreTheParameterDefaults) {
  for (const params::ParamInfo& p : params::All()) ::unsetenv(p.env_name);
  MORPH_ASSERT_OK_AND_ASSIGN(TcpStoreServerOptions store, TcpStoreServerOptions::FromEnv());
  TcpStoreServerOptions store_defaults;
  EXPECT_EQ(store.max_connections, store_defaults.max_connections);
  EXPECT_EQ(store.max_frame_bytes, store_defaults.max_frame_bytes);
  EXPECT_EQ(store.auth_timeout_ms, store_defaults.auth_timeout_ms);
  MORPH_ASSERT_OK_AND_ASSIGN(GlooOptions gloo, GlooOptions::FromEnv());
  EXPECT_EQ(gloo.hostname, GlooOptions{}.hostname);
  EXPECT_EQ(gloo.iface, GlooOptions{}.iface);
  EXPECT_EQ(gloo.unbind_threads, GlooOptions{}.unbind_threads);
  EXPECT_EQ(gloo.shared_memory, GlooOptions{}.shared_memory);
  EXPECT_EQ(gloo.shm_spin, GlooOptions{}.shm_spin);
}

TEST(EnvIsolationTest, StoreServerWithoutOptionsUsesTheDefaults) {
  PoisonedEnvironment env;
  MORPH_ASSERT_OK_AND_ASSIGN(auto server, TcpStoreServer::Start("127.0.0.1", 0, kToken));
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto client, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  MORPH_ASSERT_OK(client->Set("k", "v", Deadline::AfterMs(2000)));
  MORPH_ASSERT_OK_AND_ASSIGN(std::string v, client->Get("k", Deadline::AfterMs(2000)));
  EXPECT_EQ(v, "v");
}

// Options read before the environment changed stay in force.
TEST(EnvIsolationTest, OptionsReadOnceStayInForce) {
  ::setenv("MORPH_STORE_MAX_FRAME_BYTES", "1KiB", 1);
  MORPH_ASSERT_OK_AND_ASSIGN(TcpStoreServerOptions options, TcpStoreServerOptions::FromEnv());
  ::unsetenv("MORPH_STORE_MAX_FRAME_BYTES");
  PoisonedEnvironment env;
  MORPH_ASSERT_OK_AND_ASSIGN(auto server,
                             TcpStoreServer::Start("127.0.0.1", 0, kToken, options));
  MORPH_ASSERT_OK_AND_ASSIGN(
      auto client, TcpStoreClient::Connect(server->address(), kToken, 0, Deadline::AfterMs(5000)));
  MORPH_EXPECT_OK(client->Set("small", "v", Deadline::AfterMs(2000)));
  EXPECT_FALSE(client->Set("big", std::string(4096, 'x'), Deadline::AfterMs(2000)).ok());
}

Status AllreduceOnce(Communicator& comm) {
  std::vector<float> x(16, static_cast<float>(comm.rank() + 1));
  MORPH_RETURN_IF_ERROR(
      comm.Allreduce(x.data(), x.size(), DType::kF32, ReduceOp::kSum, std::chrono::seconds(20)));
  const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  for (float v : x) {
    if (v != want) return InternalError("allreduce gave " + std::to_string(v));
  }
  return Status::Ok();
}

TEST(EnvIsolationTest, GlooCommunicatorWithoutDeviceUsesTheDefaults) {
  PoisonedEnvironment env;
  auto table = std::make_shared<KvTable>();
  std::vector<std::unique_ptr<GlooCommunicator>> comms(2);
  MORPH_EXPECT_OK(FirstError(RunRankThreads(2, [&](int rank) -> Status {
    MemoryStore store(table, 0);
    MORPH_ASSIGN_OR_RETURN(comms[rank], GlooCommunicator::Create(store, "world", rank, 2, nullptr,
                                                                 Deadline::AfterMs(20000)));
    return AllreduceOnce(*comms[rank]);
  })));
}

TEST(EnvIsolationTest, GroupBuilderFactoriesUseTheirOptions) {
  PoisonedEnvironment env;
  auto table = std::make_shared<KvTable>();
  int64_t generation = 0;
  for (CommunicatorFactory factory : {GlooFactory(nullptr), GlooFactory(GlooOptions{})}) {
    GroupBuilder builder(factory);
    // The sets outlive both ranks' calls: a rank that tears down while its peer still reads
    // the last message may reset the connection under it.
    std::vector<std::unique_ptr<GroupSet>> sets(2);
    MORPH_EXPECT_OK(FirstError(RunRankThreads(2, [&](int rank) -> Status {
      MemoryStore store(table, generation);
      MORPH_ASSIGN_OR_RETURN(sets[rank], builder.Build(store, ParallelConfig{.dp = 2}, rank, 2,
                                                       Deadline::AfterMs(20000)));
      MORPH_RETURN_IF_ERROR(AllreduceOnce(sets[rank]->world()));
      return AllreduceOnce(sets[rank]->dp());
    })));
    ++generation;
  }
}

}  // namespace
}  // namespace morph
