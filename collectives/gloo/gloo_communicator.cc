#include "collectives/gloo/gloo_communicator.h"

#include <net/if.h>

#include "collectives/gloo/gloo_communicator_impl.h"

namespace morph {
namespace {

using gloo_support::GlooStoreAdapter;
using gloo_support::ScopedSigpipeBlock;

using std::chrono::milliseconds;

// How long Wait lets an aborted operation leave Gloo before returning anyway.
constexpr auto kAbortDrain = milliseconds(900);

}  // namespace

StatusOr<GlooOptions> GlooOptions::FromEnv() {
  GlooOptions o;
  MORPH_ASSIGN_OR_RETURN(o.hostname, params::GlooHostname());
  MORPH_ASSIGN_OR_RETURN(o.iface, params::GlooIface());
  MORPH_ASSIGN_OR_RETURN(o.unbind_threads, params::GlooUnbindThreads());
  MORPH_ASSIGN_OR_RETURN(o.shared_memory, params::GlooShm());
  MORPH_ASSIGN_OR_RETURN(int64_t spin_us, params::GlooShmSpinUs());
  o.shm_spin = std::chrono::microseconds(spin_us);
  MORPH_ASSIGN_OR_RETURN(int64_t yield_us, params::GlooShmYieldUs());
  o.shm_yield = std::chrono::microseconds(yield_us);
  return o;
}

// ---- device -------------------------------------------------------------------------------

StatusOr<std::shared_ptr<GlooDevice>> GlooDevice::Create(const GlooOptions& options) {
  // A peer that dies while it connects must not end this process on Gloo's event thread.
  if (!gloo_support::AcceptGuardLinked()) LOG(WARNING) << "gloo: getpeername guard inactive";
  gloo::transport::tcp::attr attr;
  std::string what;
  if (!options.iface.empty()) {
    attr.iface = options.iface;
    what = "interface '" + options.iface + "'";
    // Gloo throws for an unknown interface without freeing its getifaddrs list (LSan).
    if (if_nametoindex(options.iface.c_str()) == 0) {
      return InvalidArgumentError("gloo device on " + what + ": no such network interface");
    }
  } else {
    attr.hostname = options.hostname;
    what = "host '" + options.hostname + "'";
  }
  auto impl = std::make_unique<Impl>();
  impl->unbind_threads = options.unbind_threads;
  impl->shm = {
      .enable = options.shared_memory, .spin = options.shm_spin, .yield = options.shm_yield};
  try {
    ScopedSigpipeBlock no_sigpipe;  // Gloo's event thread inherits the blocked SIGPIPE
    gloo_support::ScopedUnbind unbind(options.unbind_threads);  // ... and the CPU binding
    impl->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return InvalidArgumentError("gloo device on " + what + ": " + e.what());
  }
  return std::shared_ptr<GlooDevice>(new GlooDevice(std::move(impl)));
}

GlooDevice::GlooDevice(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GlooDevice::~GlooDevice() = default;

// ---- communicator -------------------------------------------------------------------------

namespace {

class GlooWork : public Work {
 public:
  GlooWork(std::shared_ptr<GlooCommunicator::Impl> comm,
           std::shared_ptr<GlooCommunicator::Impl::Task> task)
      : comm_(std::move(comm)), task_(std::move(task)) {}

  Status Wait(Deadline deadline) override {
    if (result_) return *result_;
    std::unique_lock<std::mutex> lock(task_->mu);
    // Wakes every 10 ms to notice an Abort() from another thread.
    while (!task_->done) {
      if (comm_->aborted_.load()) break;
      if (deadline.Expired()) break;
      if (Status lost = comm_->PeerLossPastGrace(); !lost.ok()) {
        lock.unlock();
        comm_->FailWith(lost);  // wakes every wait of the context; error_ is now `lost`
        lock.lock();
        break;
      }
      auto slice = Min(deadline, Deadline::AfterMs(10));
      task_->cv.wait_until(lock, slice.when());
    }
    if (task_->done) {
      result_ = task_->status;
      return *result_;
    }
    Status why;
    if (comm_->aborted_.load()) {
      lock.unlock();
      std::lock_guard<std::mutex> comm_lock(comm_->mu_);
      why = comm_->error_;
    } else {
      why = DeadlineExceededError(comm_->Describe() + ": " + comm_->KindName(task_->op) +
                                  " did not finish in time");
      lock.unlock();
      // The peers are out of step now: the communicator cannot be used again.
      comm_->FailWith(why);
    }
    // The buffers are the caller's again only once the op thread has left them (Work::Wait's
    // contract; the reshard executor frees them right after). The abort woke Gloo's waits, so
    // this is quick; and those waits end at the op's own timeout anyway, which bounds it.
    lock.lock();
    if (!task_->cv.wait_for(lock, kAbortDrain, [&] { return task_->done; })) {
      task_->cv.wait_for(lock, task_->op.timeout, [&] { return task_->done; });
    }
    result_ = why;
    return why;
  }

  bool Done() const override {
    std::lock_guard<std::mutex> lock(task_->mu);
    return task_->done || comm_->aborted_.load();
  }

 private:
  std::shared_ptr<GlooCommunicator::Impl> comm_;
  std::shared_ptr<GlooCommunicator::Impl::Task> task_;
  std::optional<Status> result_;
};

}  // namespace

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    Store& store, std::string_view name, int rank, int size, std::shared_ptr<GlooDevice> device,
    Deadline deadline) {
  if (name.empty()) return InvalidArgumentError("gloo communicator name is empty");
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgumentError("gloo communicator '" + std::string(name) + "': rank " +
                                std::to_string(rank) + " of size " + std::to_string(size) +
                                " out of range");
  }
  if (device == nullptr) {
    MORPH_ASSIGN_OR_RETURN(device, GlooDevice::Create(GlooOptions{}));
  }
  auto impl = std::make_shared<Impl>(std::string(name), rank, size, store.generation());
  impl->device_ = device;
  auto start = std::chrono::steady_clock::now();
  PrefixedStore scoped(&store, "gloo/" + std::string(name));
  GlooStoreAdapter adapter(&scoped, deadline);
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    // Gloo waits up to 5x the context timeout for a pair's first connection (tcp/pair.h
    // waitUntil), one pair after another: a fifth of what is left keeps the whole rendezvous
    // inside `deadline` when a peer published its address and died before connecting.
    // Operations carry their own timeouts (CollectiveOp::timeout), never this default.
    const milliseconds left = std::chrono::duration_cast<milliseconds>(
        Min(deadline, Deadline::AfterMs(3600000)).Remaining());
    context->setTimeout(std::max(milliseconds(1), left / 5));
    ScopedSigpipeBlock no_sigpipe;
    context->connectFullMesh(adapter, device->impl()->device);
    impl->context_ = std::move(context);
  } catch (const std::exception& e) {
    if (!adapter.error().ok()) {
      return adapter.error().WithContext(impl->Describe() + ": rendezvous");
    }
    std::string what = e.what();
    if (ClassifyGlooError(what) == GlooErrorKind::kTimeout) {
      return DeadlineExceededError(impl->Describe() + ": connecting: " + what);
    }
    return UnavailableError(impl->Describe() + ": connecting: " + what);
  }
  // Posting the mailboxes and sentinels receives on every pair: a peer that already gave up
  // (its own connect failed, it was killed) makes Gloo throw here, which must not escape.
  try {
    ScopedSigpipeBlock no_sigpipe;
    impl->StartThreads();
  } catch (const std::exception& e) {
    impl->Shutdown();
    return UnavailableError(impl->Describe() + ": a peer connection closed while starting: " +
                            e.what());
  }
  if (size > 1) {
    // Symmetric decision over the TCP path (two small allgathers), before the first operation.
    auto allgather = [&](const void* send, void* recv, size_t bytes) {
      const milliseconds left =
          std::max(milliseconds(1), std::chrono::duration_cast<milliseconds>(deadline.Remaining()));
      ScopedSigpipeBlock no_sigpipe;
      return impl->RunOne(CollectiveOp::Allgather(send, recv, bytes, DType::kU8, left));
    };
    std::string why_not;
    StatusOr<std::unique_ptr<ShmCollectives>> shm = ShmCollectives::Create(
        rank, size, device->impl()->shm, impl->Describe(), allgather, &why_not);
    if (!shm.ok()) {
      impl->Shutdown();
      return shm.status();
    }
    if (*shm == nullptr) {
      MORPH_LOG(INFO, impl->log_) << impl->Describe() << ": collectives over TCP: " << why_not;
    } else {
      std::lock_guard<std::mutex> lock(impl->mu_);
      impl->shm_ = std::move(*shm);
    }
  }
  MORPH_VLOG(1, impl->log_)
      << impl->Describe() << (impl->shm_ != nullptr ? " (collectives in shared memory)" : "")
      << " connected in "
      << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()
      << " ms";
  return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(std::move(impl)));
}

GlooCommunicator::GlooCommunicator(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
GlooCommunicator::~GlooCommunicator() { impl_->Shutdown(); }

int GlooCommunicator::rank() const { return impl_->rank_; }
int GlooCommunicator::size() const { return impl_->size_; }
int64_t GlooCommunicator::generation() const { return impl_->generation_; }

Capabilities GlooCommunicator::capabilities() const {
  Capabilities c;
  c.backend = "gloo";
  c.host_memory = true;
  c.point_to_point = true;
  c.reduce_types = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16,
                    DType::kI32, DType::kI64, DType::kU8, DType::kI8};
  c.reduce_ops = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};
  return c;
}

StatusOr<std::unique_ptr<Work>> GlooCommunicator::Start(CollectiveOp op) {
  MORPH_RETURN_IF_ERROR(ValidateOp(op, capabilities())) << impl_->Describe();
  return std::unique_ptr<Work>(new GlooWork(impl_, impl_->Enqueue(std::move(op))));
}

Status GlooCommunicator::Run(CollectiveOp op) {
  MORPH_RETURN_IF_ERROR(ValidateOp(op, capabilities())) << impl_->Describe();
  if (std::optional<Status> s = impl_->TryRunInline(op)) return *s;
  return Communicator::Run(std::move(op));  // behind operations started before it
}

void GlooCommunicator::Abort() { impl_->Abort("Abort() called"); }
bool GlooCommunicator::broken() const { return impl_->broken_.load(); }
bool GlooCommunicator::shared_memory() const { return impl_->shm_ != nullptr; }

}  // namespace morph
