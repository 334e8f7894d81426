// The device half of the switch (switch.h "Device path" and "Device memory"): the union
// communicator and its transport, built in PrepareSwitch; each batch split between the device
// transport (device-resident tensors) and the change transport (the others); the device-memory
// figures and the staging of old device shards to pinned host memory when the device is short.
#include <algorithm>
#include <set>
#include <string>

#include "base/logging.h"
#include "runtime/switch/switch_internal.h"

namespace morph {
namespace {

void Accumulate(ExecutorStats& into, const ExecutorStats& r) {
  into.bytes_sent += r.bytes_sent;
  into.bytes_received += r.bytes_received;
  into.bytes_copied += r.bytes_copied;
  into.messages_sent += r.messages_sent;
  into.messages_received += r.messages_received;
  into.messages_zero_copy += r.messages_zero_copy;
  into.messages_strided += r.messages_strided;
  into.rounds += r.rounds;
  into.copy_seconds += r.copy_seconds;
  into.pack_seconds += r.pack_seconds;
  into.unpack_seconds += r.unpack_seconds;
  into.wait_seconds += r.wait_seconds;
  into.total_seconds += r.total_seconds;
}

// The shards of `all` whose tensor is one of `plan`'s.
template <typename T>
std::vector<T> OfPlan(std::span<const T> all, const LocalPlan& plan) {
  std::set<std::string> names;
  for (const TensorInfo& t : plan.tensors) names.insert(t.name);
  std::vector<T> out;
  for (const T& s : all) {
    if (names.count(s.name)) out.push_back(s);
  }
  return out;
}

}  // namespace

bool DevicePathOn(const SwitchOptions& o) { return !o.device.tensors.empty(); }

bool OnDevice(const PreparedSwitch& sw, size_t t) {
  const std::vector<bool>& d = sw.options_.device.tensors;
  return t < d.size() && d[t];
}

Status CheckDeviceOptions(const SwitchOptions& o, size_t num_tensors, const std::string& gen) {
  if (!DevicePathOn(o)) return Status::Ok();
  const SwitchDeviceOptions& d = o.device;
  std::string what;
  if (d.tensors.size() != num_tensors) {
    what = "device.tensors lists " + std::to_string(d.tensors.size()) + " tensors, the manifest " +
           std::to_string(num_tensors);
  } else if (!d.factory) {
    what = "device.factory is missing (it builds the union communicator)";
  } else if (!d.memory) {
    what = "device.memory is missing (the device's stream and staging)";
  } else if (o.stage_old_in_host) {
    what =
        "stage_old_in_host and the device path exclude each other (the device path stages "
        "old shards itself when device.free_bytes is short)";
  }
  if (what.empty()) return Status::Ok();
  return InvalidArgumentError(gen + ": switch options: " + what);
}

// Every participant derives the same union plan from the prepare: the next generation's world
// when the step groups are on the device and every participant holds a rank in it, else a fresh
// communicator over the participants.
Status PrepareDevicePath(PreparedSwitch& sw, Store& store, Deadline deadline) {
  const SwitchDeviceOptions& d = sw.options_.device;
  const std::string gen = "generation " + std::to_string(sw.next_.id);
  UnionCommInput in;
  in.participants.assign(sw.participants_.begin(), sw.participants_.end());
  if (d.new_world_on_device && !sw.shrink_groups_) {
    in.new_world.assign(sw.next_.ranks.begin(), sw.next_.ranks.end());
  }
  MORPH_ASSIGN_OR_RETURN(UnionCommPlan plan, PlanUnionComm(in), gen << ": device path");
  Communicator* new_world = sw.groups_ ? &sw.groups_->world() : nullptr;
  MORPH_ASSIGN_OR_RETURN(sw.union_,
                         BuildUnionComm(plan, sw.participant_, nullptr, new_world, d.factory, store,
                                        sw.next_.id, deadline),
                         gen << ": device path");
  MORPH_ASSIGN_OR_RETURN(std::unique_ptr<DeviceMemory> memory, d.memory(),
                         gen << ": device path: device memory");
  MORPH_ASSIGN_OR_RETURN(
      sw.device_transport_,
      DeviceTransport::Create(sw.union_.comm, sw.union_.plan.comm_rank_of_participant,
                              std::move(memory), sw.options_.timeout),
      gen << ": device transport");
  sw.planned_.device.union_source = UnionSourceName(plan.source);
  return Status::Ok();
}

// The device figures of "Device memory" for this worker, from its plan and batches.
void PlanDeviceBytes(PreparedSwitch& sw) {
  SwitchStats::Device& dev = sw.planned_.device;
  const LocalPlan& p = sw.plan_;
  dev.old_bytes = dev.new_bytes = dev.largest_batch_bytes = 0;
  for (size_t t = 0; t < p.tensors.size(); ++t) {
    if (!OnDevice(sw, t)) continue;
    dev.old_bytes += ShardBytes(p.old_shards[t], p.tensors[t].dtype);
    dev.new_bytes += ShardBytes(p.new_shards[t], p.tensors[t].dtype);
    sw.grow_offset_[t] = -1;  // device memory is not page-mapped: never grown in place
  }
  for (const auto& batch : sw.batches_) {
    int64_t batch_new = 0;
    for (int32_t t : batch) {
      const size_t i = static_cast<size_t>(t);
      if (OnDevice(sw, i) && !sw.kept_[i]) {
        batch_new += ShardBytes(p.new_shards[i], p.tensors[i].dtype);
      }
    }
    dev.largest_batch_bytes = std::max(dev.largest_batch_bytes, batch_new);
  }
  dev.staging_bytes = static_cast<int64_t>(sw.executor_.staging_bytes);
  dev.bound_bytes =
      std::max(dev.old_bytes, dev.new_bytes) + dev.largest_batch_bytes + dev.staging_bytes;
}

bool ShouldStageOld(PreparedSwitch& sw, SwitchStats& stats) {
  const SwitchDeviceOptions& d = sw.options_.device;
  if (!DevicePathOn(sw.options_) || !d.free_bytes) return false;
  stats.device.free_bytes = d.free_bytes();
  if (stats.device.free_bytes < 0) {
    stats.device.free_bytes = -1;
    return false;
  }
  return stats.device.free_bytes < stats.device.bound_bytes - stats.device.old_bytes;
}

StatusOr<int64_t> StageOldDeviceShards(PreparedSwitch& sw, StateStore& state,
                                       std::vector<ConstBufferView>& old_view,
                                       std::vector<Buffer>& staged, DeviceTally& tally) {
  const Allocator alloc =
      sw.options_.device.pinned_host ? sw.options_.device.pinned_host : PinnedHostAllocator();
  int64_t bytes = 0;
  for (size_t t = 0; t < old_view.size(); ++t) {
    if (!OnDevice(sw, t) || old_view[t].bytes == 0) continue;
    const std::string what = "staging old shard of tensor '" + sw.plan_.tensors[t].name + "' (" +
                             std::to_string(old_view[t].bytes) + " bytes) to pinned host memory";
    MORPH_ASSIGN_OR_RETURN(staged[t], alloc(old_view[t].bytes), what);
    MORPH_RETURN_IF_ERROR(CopyBytes(staged[t].view(), old_view[t])) << what;
    state.ReleaseShard(t);
    tally.Sub(static_cast<int64_t>(old_view[t].bytes));
    bytes += static_cast<int64_t>(old_view[t].bytes);
    old_view[t] = staged[t].view();
  }
  return bytes;
}

Status ReturnStagedForBatch(PreparedSwitch& sw, StateStore& state, size_t t,
                            std::vector<ConstBufferView>& old_view, Buffer& on_device,
                            DeviceTally& tally) {
  const auto bytes = static_cast<int64_t>(old_view[t].bytes);
  MORPH_ASSIGN_OR_RETURN(on_device,
                         state.AllocateShard(t, bytes,
                                             state.AllocationBytes(t, sw.from().config,
                                                                   sw.old_rank(), bytes)),
                         "returning the staged old shard of tensor '" << sw.plan_.tensors[t].name
                                                                      << "' to the device");
  tally.Add(static_cast<int64_t>(on_device.size()));
  MORPH_RETURN_IF_ERROR(CopyBytes(on_device.view(), old_view[t]))
      << "tensor '" << sw.plan_.tensors[t].name << "'";
  old_view[t] = on_device.view();
  return Status::Ok();
}

StatusOr<ExecutorStats> RunBatch(PreparedSwitch& sw, const LocalPlan& run,
                                 const std::vector<int32_t>& global,
                                 std::span<const OldShardData> olds,
                                 std::span<const NewShardData> news, SwitchStats& stats,
                                 int64_t* device_staging, Deadline deadline) {
  *device_staging = 0;
  std::vector<int32_t> dev, host;
  for (size_t j = 0; j < global.size(); ++j) {
    (OnDevice(sw, static_cast<size_t>(global[j])) ? dev : host).push_back(static_cast<int32_t>(j));
  }
  if (!sw.device_transport_ || dev.empty()) {
    return ExecutePlan(run, olds, news, *sw.transport_, sw.executor_, deadline);
  }
  auto on_device = [&](const LocalPlan& part, std::span<const OldShardData> o,
                       std::span<const NewShardData> n) -> StatusOr<ExecutorStats> {
    MORPH_ASSIGN_OR_RETURN(
        ExecutorStats r, ExecutePlan(part, o, n, *sw.device_transport_, sw.executor_, deadline),
        "device transport (union communicator: " << stats.device.union_source << ")");
    stats.device.bytes_sent += r.bytes_sent;
    stats.device.bytes_received += r.bytes_received;
    // The bounce buffers count as staging, in the figure and in its bound.
    const int64_t bounce = sw.device_transport_->bounce_allocated_bytes();
    *device_staging = r.staging_peak_bytes + bounce;
    const int64_t planned = static_cast<int64_t>(sw.executor_.staging_bytes) + bounce;
    stats.device.bound_bytes += planned - stats.device.staging_bytes;
    stats.device.staging_bytes = planned;
    return r;
  };
  if (host.empty()) return on_device(run, olds, news);
  // A mixed batch: one exchange per transport, device first; both ends split alike (the
  // tensors' residence is the same on every participant).
  std::vector<LocalPlan> parts = SplitPlan(run, {dev, host});
  const std::vector<OldShardData> dev_olds = OfPlan(olds, parts[0]),
                                  host_olds = OfPlan(olds, parts[1]);
  const std::vector<NewShardData> dev_news = OfPlan(news, parts[0]),
                                  host_news = OfPlan(news, parts[1]);
  MORPH_ASSIGN_OR_RETURN(ExecutorStats total, on_device(parts[0], dev_olds, dev_news));
  MORPH_ASSIGN_OR_RETURN(
      ExecutorStats h,
      ExecutePlan(parts[1], host_olds, host_news, *sw.transport_, sw.executor_, deadline),
      "change transport");
  Accumulate(total, h);
  total.staging_peak_bytes = std::max(total.staging_peak_bytes, h.staging_peak_bytes);
  return total;
}

}  // namespace morph
