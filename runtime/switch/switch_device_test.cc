// The switch's device path on CPUs (switch.h "Device path", "Device memory"): device-resident
// tensors live on fake GPUs (collectives/fake_nccl.h) and move over the fake NCCL union
// communicator, host tensors over Gloo; every byte really moves and every shard is checked
// bitwise. Also: device bytes by phase against each fake GPU's own count, old shards staged to
// host when the device is short, a process killed mid-transfer, an abort from another thread.
#include <gmock/gmock.h>

#include <atomic>

#include "collectives/fake_nccl.h"
#include "runtime/switch/switch_testutil.h"

namespace morph::switch_testing {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int kProcesses = 32;  // worker ids are fake NCCL process numbers

// Workers whose tensors marked in `on_device` are adopted on a fake GPU of their own (one node:
// the hub sees every GPU's memory), the rest morph-owned host memory.
class DeviceCluster {
 public:
  explicit DeviceCluster(std::vector<bool> on_device)
      : on_device_(std::move(on_device)),
        node_(std::make_shared<FakeDevice>()),
        hub_(std::make_shared<FakeNcclHub>(kProcesses, node_)) {}

  void Register(const std::vector<WorkerId>& workers) {
    for (WorkerId w : workers) {
      if (c_.states_.count(w)) continue;
      auto gpu = std::make_shared<FakeDevice>(-1, node_);
      gpus_[w] = gpu;
      auto s = std::make_unique<StateStore>();
      for (size_t i = 0; i < c_.manifest_.tensors.size(); ++i) {
        const TensorSpec& t = c_.manifest_.tensors[i];
        if (on_device_[i]) {
          ASSERT_TRUE(s->AdoptTensor(t.name, t.shape, t.dtype, t.layout, Adopt(gpu)).ok());
        } else {
          ASSERT_TRUE(s->AddTensor(t.name, t.shape, t.dtype, t.layout).ok());
        }
      }
      for (const ScalarSpec& sc : c_.manifest_.scalars) {
        ASSERT_TRUE(s->AddScalar(sc.name, sc.bytes).ok());
      }
      c_.states_[w] = std::move(s);
    }
  }

  SwitchOptions Options(WorkerId w) {
    SwitchOptions o = Cluster::Defaults();
    o.device.tensors = on_device_;
    o.device.factory = hub_->Factory(static_cast<int>(w));
    o.device.new_world_on_device = new_world_on_device_;
    std::shared_ptr<FakeDevice> gpu = gpus_.at(w);
    o.device.memory = [gpu]() -> StatusOr<std::unique_ptr<DeviceMemory>> { return gpu->Memory(); };
    if (free_bytes_ >= 0) o.device.free_bytes = [f = free_bytes_] { return f; };
    o.device.pinned_host = HostAllocator();
    return o;
  }

  // Decide and run a change with the device path on every participant.
  std::map<WorkerId, WorkerResult> Run(
      const ParallelConfig& config, const std::vector<WorkerId>& candidates,
      const std::function<void(WorkerId, SwitchOptions&, std::unique_ptr<PreparedSwitch>*)>& extra =
          nullptr) {
    Register(candidates);
    for (auto& [w, g] : gpus_) g->ResetPeak();
    auto p = c_.Decide(config, candidates);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return {};
    prepare_ = *p;
    return c_.Run(*p, [&](WorkerId w, SwitchOptions& o, std::unique_ptr<PreparedSwitch>* sw) {
      o = Options(w);
      if (extra) extra(w, o, sw);
    });
  }

  // A change that must succeed: every shard bitwise, device figures against the fake GPUs.
  void Change(const ParallelConfig& config, const std::vector<WorkerId>& candidates,
              const char* union_source) {
    std::map<WorkerId, WorkerResult> r = Run(config, candidates);
    int64_t device_sent = 0;
    for (auto& [w, res] : r) {
      ASSERT_TRUE(res.status.ok()) << "worker " << w << ": " << res.status;
      const SwitchStats::Device& d = res.stats.device;
      SCOPED_TRACE("worker " + std::to_string(w));
      EXPECT_EQ(d.union_source, union_source);
      device_sent += d.bytes_sent;
      EXPECT_GE(res.stats.bytes_sent, d.bytes_sent);
      EXPECT_EQ(d.prepare_bytes, d.old_bytes);
      EXPECT_EQ(d.resume_bytes, d.new_bytes);
      // The switch's count covers what the fake GPU saw allocated (its staging included).
      EXPECT_LE(gpus_.at(w)->peak_bytes(), d.transfer_peak_bytes);
      if (res.stats.sign_consistent && d.staged_bytes == 0) {
        EXPECT_LE(d.transfer_peak_bytes, d.bound_bytes);
      }
      std::fprintf(
          stderr,
          "gen %lld worker %lld (%s): device old %lld new %lld batch %lld staging %lld "
          "bound %lld peak %lld (fake GPU %lld) staged %lld sent %lld of %lld\n",
          static_cast<long long>(prepare_.next.id), static_cast<long long>(w),
          d.union_source.c_str(), static_cast<long long>(d.old_bytes),
          static_cast<long long>(d.new_bytes), static_cast<long long>(d.largest_batch_bytes),
          static_cast<long long>(d.staging_bytes), static_cast<long long>(d.bound_bytes),
          static_cast<long long>(d.transfer_peak_bytes),
          static_cast<long long>(gpus_.at(w)->peak_bytes()), static_cast<long long>(d.staged_bytes),
          static_cast<long long>(d.bytes_sent), static_cast<long long>(res.stats.bytes_sent));
    }
    EXPECT_GT(device_sent, 0);
    c_.Verify(1);
  }

  Cluster c_;
  std::vector<bool> on_device_;
  std::shared_ptr<FakeDevice> node_;
  std::shared_ptr<FakeNcclHub> hub_;
  std::map<WorkerId, std::shared_ptr<FakeDevice>> gpus_;
  bool new_world_on_device_ = false;
  int64_t free_bytes_ = -1;
  PrepareMsg prepare_;

 private:
  // Storage of an adopted tensor on `gpu`: the buffers live until released.
  static TensorAllocator Adopt(std::shared_ptr<FakeDevice> gpu) {
    auto held = std::make_shared<std::map<void*, Buffer>>();
    auto mu = std::make_shared<std::mutex>();
    return {[gpu, held, mu](int64_t bytes) -> StatusOr<BufferView> {
              MORPH_ASSIGN_OR_RETURN(Buffer b, gpu->Allocate(static_cast<size_t>(bytes)));
              BufferView v = b.view();
              std::lock_guard<std::mutex> l(*mu);
              (*held)[v.data] = std::move(b);
              return v;
            },
            [held, mu](BufferView v) {
              std::lock_guard<std::mutex> l(*mu);
              held->erase(v.data);
            }};
  }
};

std::vector<bool> AllOnDevice() { return std::vector<bool>(Tensors().size(), true); }
std::vector<bool> Alternate() {
  std::vector<bool> v(Tensors().size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = i % 2 == 0;
  return v;
}

TEST(SwitchDeviceTest, DeviceStateMovesOverAFreshUnionWhenMembersLeave) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11, 12, 13});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(4, 1, 1), {10, 11, 12, 13}));
  const int64_t delivered = d.hub_->bytes_delivered();
  ASSERT_NO_FATAL_FAILURE(d.Change(Config(2, 1, 1), {10, 11}, "fresh"));
  EXPECT_GT(d.hub_->bytes_delivered(), delivered);
  // And back: joiners receive everything over a fresh union.
  ASSERT_NO_FATAL_FAILURE(d.Change(Config(2, 2, 1), {10, 11, 12, 13}, "fresh"));
}

TEST(SwitchDeviceTest, MixedPlanUsesBothTransports) {
  DeviceCluster d(Alternate());
  d.Register({10, 11, 12, 13});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(2, 2, 1), {10, 11, 12, 13}));
  const int64_t delivered = d.hub_->bytes_delivered();
  std::map<WorkerId, WorkerResult> r = d.Run(Config(4, 1, 1), {10, 11, 12, 13});
  int64_t device = 0, all = 0;
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << "worker " << w << ": " << res.status;
    device += res.stats.device.bytes_sent;
    all += res.stats.bytes_sent;
  }
  d.c_.Verify(1);
  EXPECT_GT(device, 0);
  EXPECT_LT(device, all) << "host tensors moved too";
  // What crossed the fake NCCL is the device tensors' payload plus the transport's records.
  EXPECT_GE(d.hub_->bytes_delivered() - delivered, device);
}

TEST(SwitchDeviceTest, EveryParticipantStaysSoTheNewWorldCarriesIt) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11, 12, 13});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(2, 2, 1), {10, 11, 12, 13}));
  // The step groups on the fake NCCL (as the runtime's NCCL backend builds them), the change
  // communicator on Gloo: the next world carries the reshard, nothing more is built.
  d.new_world_on_device_ = true;
  d.c_.factory_of_ = [&](WorkerId w) -> CommunicatorFactory {
    CommunicatorFactory steps = d.hub_->Factory(static_cast<int>(w));
    CommunicatorFactory control = GlooFactory(d.c_.DeviceOf(w));
    return [steps, control](Store& store, std::string_view name, int rank, int size,
                            Deadline deadline) {
      const bool step = name == "world" || name.starts_with("dp/") || name.starts_with("tp/") ||
                        name.starts_with("pp/");
      return (step ? steps : control)(store, name, rank, size, deadline);
    };
  };
  ASSERT_NO_FATAL_FAILURE(d.Change(Config(4, 1, 1), {10, 11, 12, 13}, "new world"));
}

TEST(SwitchDeviceTest, OldShardsStagedToHostWhenTheDeviceIsShort) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(2, 1, 1), {10, 11}));
  d.free_bytes_ = 0;
  std::map<WorkerId, WorkerResult> r = d.Run(Config(1, 2, 1), {10, 11});
  for (auto& [w, res] : r) {
    ASSERT_TRUE(res.status.ok()) << "worker " << w << ": " << res.status;
    const SwitchStats::Device& dev = res.stats.device;
    EXPECT_EQ(dev.free_bytes, 0);
    EXPECT_EQ(dev.staged_bytes, dev.old_bytes);
    // The device then holds the new shards, one batch's old shards back for its exchange and
    // the staging: never old and new state together.
    EXPECT_LE(dev.transfer_peak_bytes,
              dev.new_bytes + 2 * dev.largest_batch_bytes + dev.staging_bytes);
    EXPECT_LE(d.gpus_.at(w)->peak_bytes(), dev.transfer_peak_bytes);
  }
  d.c_.Verify(1);
}

TEST(SwitchDeviceTest, AProcessKilledMidTransferFailsTheSwitchByName) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11, 12, 13});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(4, 1, 1), {10, 11, 12, 13}));
  d.hub_->KillWhenDelivered(13, d.hub_->bytes_delivered() + 2048);
  const auto start = Clock::now();
  std::map<WorkerId, WorkerResult> r = d.Run(Config(1, 2, 1), {10, 11});
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 25.0);
  int named = 0;
  for (auto& [w, res] : r) {
    EXPECT_FALSE(res.status.ok()) << "worker " << w;
    if (w != 13 && res.status.message().find("worker 13") != std::string::npos) ++named;
  }
  EXPECT_GT(named, 0) << "no survivor named the dead worker";
}

TEST(SwitchDeviceTest, AbortFromAnotherThreadMidTransfer) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(2, 1, 1), {10, 11}));
  // Paused after the change's first delivered byte: both workers then wait in their first
  // exchange (each needs the other's records), so worker 10's switch is alive when aborted.
  d.hub_->PauseDeliveryAt(d.hub_->bytes_delivered() + 1);
  std::unique_ptr<PreparedSwitch>* of10 = nullptr;
  std::thread aborter;
  std::atomic<bool> abort_returned{false};
  // Worker 10's switch stays alive until Abort() returned on the other thread.
  d.c_.before_release_ = [&](WorkerId w) {
    const Deadline dl = Deadline::AfterMs(30000);
    while (w == 10 && !abort_returned.load() && !dl.Expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  std::map<WorkerId, WorkerResult> r =
      d.Run(Config(1, 2, 1), {10, 11},
            [&](WorkerId w, SwitchOptions&, std::unique_ptr<PreparedSwitch>* sw) {
              if (w != 10) return;
              of10 = sw;
              aborter = std::thread([&] {
                const Deadline dl = Deadline::AfterMs(20000);
                while (!d.hub_->delivery_paused() && !dl.Expired()) {
                  std::this_thread::sleep_for(std::chrono::milliseconds(1));
                }
                (*of10)->Abort();
                abort_returned.store(true);
                d.hub_->ResumeDelivery();
              });
            });
  aborter.join();
  EXPECT_THAT(r[10].status, StatusIs(StatusCode::kAborted, ::testing::_));
  EXPECT_FALSE(r[11].status.ok());
}

TEST(SwitchDeviceTest, ACancelEndsAPrepareStuckInTheUnionCreation) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(2, 1, 1), {10, 11}));
  // Worker 11 is slow to reach the union's creation; worker 10 waits in it until the abort
  // cancels both builds (as ChangeBuilder::AbortFrom does), long before the 30 s deadline.
  std::map<WorkerId, std::shared_ptr<BuildCancel>> cancel = {{10, std::make_shared<BuildCancel>()},
                                                             {11, std::make_shared<BuildCancel>()}};
  std::atomic<bool> go{false};
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (auto& [w, c] : cancel) c->Cancel();
    go.store(true);
  });
  const auto start = Clock::now();
  std::map<WorkerId, WorkerResult> r =
      d.Run(Config(1, 2, 1), {10, 11},
            [&](WorkerId w, SwitchOptions& o, std::unique_ptr<PreparedSwitch>*) {
              o.cancel = cancel.at(w);
              CommunicatorFactory f = d.hub_->Factory(static_cast<int>(w), cancel.at(w));
              if (w == 10) {
                o.device.factory = f;
                return;
              }
              o.device.factory = [f, &go](Store& store, std::string_view name, int rank, int size,
                                          Deadline deadline) {
                while (!go.load() && !deadline.Expired()) {
                  std::this_thread::sleep_for(std::chrono::milliseconds(1));
                }
                return f(store, name, rank, size, deadline);
              };
            });
  canceller.join();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
  for (auto& [w, res] : r) {
    EXPECT_THAT(res.status, StatusIs(StatusCode::kAborted, HasSubstr("cancelled"))) << w;
  }
}

TEST(SwitchDeviceTest, BadDeviceOptionsAreNamed) {
  DeviceCluster d(AllOnDevice());
  d.Register({10, 11});
  ASSERT_NO_FATAL_FAILURE(d.c_.Start(Config(2, 1, 1), {10, 11}));
  std::map<WorkerId, WorkerResult> r = d.Run(
      Config(1, 2, 1), {10, 11}, [](WorkerId, SwitchOptions& o, std::unique_ptr<PreparedSwitch>*) {
        o.device.tensors.pop_back();
      });
  for (auto& [w, res] : r) {
    EXPECT_THAT(res.status, StatusIs(StatusCode::kInvalidArgument,
                                     HasSubstr("device.tensors lists 7 tensors, the manifest 8")));
  }
}

}  // namespace
}  // namespace morph::switch_testing
