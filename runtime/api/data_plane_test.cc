// The data-plane backend choice (runtime/api/data_plane.h, Options::backend): which factory
// builds which communicator, the CUDA device a worker picks, and the exact error of
// MORPH_BACKEND=nccl where it cannot work (a build without CUDA, a machine without a GPU: this
// one), from MakeDataPlane and from Runtime::Start.
#include "runtime/api/data_plane.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "base/testing.h"
#include "collectives/gloo/gloo_communicator.h"
#include "morph/runtime.h"
#include "runtime/plan/manifest.h"
#include "runtime/protocol/wire.h"

#if MORPH_WITH_CUDA
#include "collectives/nccl/nccl_communicator.h"
#endif

namespace morph {
namespace {

using ::morph::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

bool HaveGpu(std::string* why) {
#if MORPH_WITH_CUDA
  return CudaDeviceAvailable(why);
#else
  *why = "a build without CUDA";
  return false;
#endif
}

TEST(DataPlaneTest, StepGroupsAreWorldDpTpPp) {
  for (const char* n : {"world", "dp/p0t0", "tp/p1d0", "pp/d0t1"}) EXPECT_TRUE(IsStepGroup(n)) << n;
  for (const char* n : {"change", "snapshot", "worldx", "dp", ""})
    EXPECT_FALSE(IsStepGroup(n)) << n;
}

TEST(DataPlaneTest, RouteSendsStepGroupsToOneFactoryAndTheRestToTheOther) {
  std::vector<std::string> steps, control;
  auto record = [](std::vector<std::string>* into) -> CommunicatorFactory {
    return [into](Store&, std::string_view name, int, int,
                  Deadline) -> StatusOr<std::unique_ptr<Communicator>> {
      into->emplace_back(name);
      return UnavailableError("recorded");
    };
  };
  CommunicatorFactory f = RouteStepGroups(record(&steps), record(&control));
  MemoryStore store(std::make_shared<KvTable>(), 0);
  for (const char* n : {"change", "world", "dp/p0t0", "tp/p0d0", "pp/d0t0"}) {
    EXPECT_THAT(f(store, n, 0, 1, Deadline::AfterMs(1000)).status(),
                StatusIs(StatusCode::kUnavailable, HasSubstr("recorded")));
  }
  EXPECT_THAT(steps, ElementsAre("world", "dp/p0t0", "tp/p0d0", "pp/d0t0"));
  EXPECT_THAT(control, ElementsAre("change"));
}

TEST(DataPlaneTest, CudaDeviceFromRequestOrLocalRank) {
  EXPECT_EQ(*ChooseCudaDevice(-1, -1, 8), 0);
  EXPECT_EQ(*ChooseCudaDevice(-1, 5, 8), 5);
  EXPECT_EQ(*ChooseCudaDevice(-1, 9, 8), 1);  // two workers per GPU past 8 local ranks
  EXPECT_EQ(*ChooseCudaDevice(3, 5, 8), 3);
  EXPECT_THAT(ChooseCudaDevice(3, 0, 2).status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("MORPH_CUDA_DEVICE=3: this machine has 2 CUDA devices")));
  EXPECT_THAT(ChooseCudaDevice(1, 0, 1).status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       HasSubstr("MORPH_CUDA_DEVICE=1: this machine has 1 CUDA device")));
  EXPECT_THAT(ChooseCudaDevice(-1, 0, 0).status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("no CUDA device")));
}

TEST(DataPlaneTest, FromEnvReadsBackendDeviceAndLocalRank) {
  {
    ScopedEnv b("MORPH_BACKEND", nullptr), d("MORPH_CUDA_DEVICE", nullptr),
        l("OMPI_COMM_WORLD_LOCAL_RANK", nullptr), s("SLURM_LOCALID", nullptr),
        m("MORPH_LAUNCH_INDEX", nullptr);
    MORPH_ASSERT_OK_AND_ASSIGN(Options o, Options::FromEnv());
    EXPECT_EQ(o.backend, Backend::kGloo);
    EXPECT_EQ(o.cuda_device, -1);
    EXPECT_EQ(o.launcher_local_rank, -1);
  }
  {
    ScopedEnv b("MORPH_BACKEND", "nccl"), d("MORPH_CUDA_DEVICE", "2"),
        l("OMPI_COMM_WORLD_LOCAL_RANK", "3"), s("SLURM_LOCALID", "5"), m("MORPH_LAUNCH_INDEX", "7");
    MORPH_ASSERT_OK_AND_ASSIGN(Options o, Options::FromEnv());
    EXPECT_EQ(o.backend, Backend::kNccl);
    EXPECT_STREQ(BackendName(o.backend), "nccl");
    EXPECT_EQ(o.cuda_device, 2);
    EXPECT_EQ(o.launcher_local_rank, 3);  // mpirun's first
  }
  {
    ScopedEnv l("OMPI_COMM_WORLD_LOCAL_RANK", nullptr), s("SLURM_LOCALID", nullptr),
        m("MORPH_LAUNCH_INDEX", "7");
    MORPH_ASSERT_OK_AND_ASSIGN(Options o, Options::FromEnv());
    EXPECT_EQ(o.launcher_local_rank, 7);  // morphrun
  }
  {
    ScopedEnv b("MORPH_BACKEND", "mpi");
    EXPECT_THAT(Options::FromEnv().status(),
                StatusIs(StatusCode::kInvalidArgument,
                         HasSubstr("MORPH_BACKEND=mpi: not a backend (gloo or nccl)")));
  }
  {
    ScopedEnv d("MORPH_CUDA_DEVICE", "-2");
    EXPECT_THAT(Options::FromEnv().status(),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("MORPH_CUDA_DEVICE")));
  }
}

TEST(DataPlaneTest, GlooBackendBuildsEverythingOnGloo) {
  Options o;
  MORPH_ASSERT_OK_AND_ASSIGN(DataPlane dp, MakeDataPlane(o, nullptr));
  EXPECT_EQ(dp.cuda_device, -1);
  MemoryStore store(std::make_shared<KvTable>(), 0);
  MORPH_ASSERT_OK_AND_ASSIGN(auto world,
                             dp.factory(store, "world", 0, 1, Deadline::AfterMs(10000)));
  EXPECT_TRUE(world->capabilities().host_memory);
}

// The error names the variable and says why; on a machine with a GPU the backend is built.
TEST(DataPlaneTest, NcclWithoutGpuIsFailedPrecondition) {
  std::string why;
  Options o;
  o.backend = Backend::kNccl;
  StatusOr<DataPlane> dp = MakeDataPlane(o, nullptr);
  std::printf("MakeDataPlane(backend=nccl): %s\n", dp.status().ToString().c_str());
  if (HaveGpu(&why)) {
    MORPH_ASSERT_OK(dp.status());
    EXPECT_EQ(dp->cuda_device, 0);
    std::printf("gpu-note: MORPH_BACKEND=nccl data plane on CUDA device %d\n", dp->cuda_device);
    return;
  }
#if MORPH_WITH_CUDA
  EXPECT_THAT(dp.status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       StartsWith("MORPH_BACKEND=nccl: no CUDA device found (cudaGetDeviceCount")));
#else
  EXPECT_THAT(dp.status(),
              StatusIs(StatusCode::kFailedPrecondition,
                       StartsWith("MORPH_BACKEND=nccl: morph was built without CUDA")));
#endif
}

TEST(DataPlaneTest, RuntimeStartWithNcclWithoutGpuFailsBeforeJoining) {
  std::string why;
  if (HaveGpu(&why)) GTEST_SKIP() << "a GPU is present: Start would succeed";
  Options o;
  o.bootstrap = Bootstrap::kHost;
  o.model = {.num_layers = 1, .global_batch = 4};
  o.dataset_samples = 8;
  o.heartbeat_ms = 50;
  o.start_timeout_ms = 10000;
  o.handle_sigterm = false;
  o.backend = Backend::kNccl;
  auto rt = Runtime::Start(
      o, [](State& s) { return s.AddTensor("x", {4}, DType::kF32, Layout::Layer(0)); });
  EXPECT_THAT(rt.status(),
              StatusIs(StatusCode::kFailedPrecondition, HasSubstr("MORPH_BACKEND=nccl: ")));
}

// Every worker of a job must use one backend (a group cannot mix Gloo and NCCL): the backend
// travels in the registration's manifest, and a worker whose backend differs is refused with
// the field named instead of timing out in the first rendezvous.
TEST(DataPlaneTest, BackendIsPartOfTheRegistrationAgreement) {
  JobManifest a;
  a.model.global_batch = 4;
  JobManifest b = a;
  b.backend = "nccl";
  EXPECT_EQ(FirstDifference(a, a), "");
  EXPECT_EQ(FirstDifference(a, b), "backend (MORPH_BACKEND): gloo vs nccl");
  MORPH_ASSERT_OK_AND_ASSIGN(WireMessage m,
                             DecodeFrame(EncodeFrame(WireMessage{RegisterMsg{.manifest = b}})));
  ASSERT_TRUE(std::holds_alternative<RegisterMsg>(m));
  EXPECT_EQ(std::get<RegisterMsg>(m).manifest.backend, "nccl");
  b.backend = "mpi";
  EXPECT_THAT(ValidateManifest(b), StatusIs(StatusCode::kInvalidArgument,
                                            HasSubstr("backend: 'mpi' is not gloo or nccl")));
}

}  // namespace
}  // namespace morph
