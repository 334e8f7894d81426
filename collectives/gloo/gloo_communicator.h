// The Gloo backend of Communicator: CPU buffers over TCP (loopback in tests).
//
// A communicator is one Gloo context, built by a full-mesh rendezvous through our Store under
// "gloo/<name>" in the store's generation — a fresh key space per generation, since Gloo's
// store cannot delete keys. A context is never reused after an error (any Gloo timeout closes
// every pair): the caller builds the next generation's communicator instead.
//
//   MORPH_ASSIGN_OR_RETURN(GlooOptions options, GlooOptions::FromEnv());  // once, at the top
//   MORPH_ASSIGN_OR_RETURN(auto device, GlooDevice::Create(options));
//   MORPH_ASSIGN_OR_RETURN(auto comm, GlooCommunicator::Create(store, "world", rank, world,
//                                                              device, Deadline::AfterMs(30000)));
//   MORPH_RETURN_IF_ERROR(comm->Allreduce(buf, n, DType::kF32, ReduceOp::kSum, 30s));
//
// Started operations run in order on one thread per communicator, so Start returns at once;
// the blocking calls (Allreduce, ..., Run) run on the caller's thread when nothing started
// is still pending (small messages cost two thread wake-ups less). Abort() (any thread) fails
// the operation in progress wherever it runs: it raises an error on every pair of the
// context, which wakes Gloo's waits and closes the connections, so peers fail too.
// Any error does the same. A sentinel receive on every pair notices a peer connection that
// closed while this rank waits on another pair (docs/collectives.md). When every rank is on
// this host, collectives (allreduce, broadcast, allgather, reduce-scatter, barrier; above
// 64 KiB in chunks) and point to point bypass TCP through a shared segment with the same
// failure statuses; reductions there run in rank order at every size (up to 64 KiB the TCP
// path's bits; GlooOptions::shared_memory, shm_collectives.h). SIGPIPE is blocked in
// the threads that write to Gloo's sockets; the library installs no signal handler.
#ifndef MORPH_COLLECTIVES_GLOO_COMMUNICATOR_H_
#define MORPH_COLLECTIVES_GLOO_COMMUNICATOR_H_

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "collectives/communicator.h"
#include "collectives/store/store.h"

namespace morph {

struct GlooOptions {
  // Address this rank listens on; "127.0.0.1" for loopback. Ignored when `iface` is set.
  std::string hostname = "127.0.0.1";
  // Network interface to listen on (e.g. "eth0"), empty: use `hostname`.
  std::string iface;
  // Start the threads that serve Gloo (the device's event thread, a communicator's op and
  // sentinel threads) on every CPU this process may use rather than the creating thread's
  // binding. mpirun binds each rank to one core (np <= 2); a bound event thread then waits for
  // that core behind the training thread at every message (8 B allreduce, 2 ranks, busy host:
  // 3 ms bound, 0.16 ms unbound). The calling thread's binding is left as it is.
  bool unbind_threads = true;
  // Collectives and point to point through shared memory when every rank of a communicator is
  // on this host (decided once at creation, the same on every rank; any rank with false, on
  // another host, or unable to map the segment: TCP, and an INFO line says why).
  // shm_collectives.h; docs/collectives.md, "Same-host shared memory".
  bool shared_memory = true;
  // How long a shared-memory wait busy-polls before it sleeps on a futex; negative: 20 us when
  // the process may use at least as many CPUs as the communicator has ranks, else 0.
  std::chrono::microseconds shm_spin{-1};
  // Then how long it polls between sched_yield() calls before it sleeps (shm_collectives.h).
  std::chrono::microseconds shm_yield{50};

  // MORPH_GLOO_HOSTNAME, MORPH_GLOO_IFACE, MORPH_GLOO_UNBIND_THREADS, MORPH_GLOO_SHM,
  // MORPH_GLOO_SHM_SPIN_US and MORPH_GLOO_SHM_YIELD_US, read now (the defaults above where unset):
  // call once, at the top of a program, and pass the result. kInvalidArgument for an unparsable
  // value. Any thread.
  static StatusOr<GlooOptions> FromEnv();
};

// A Gloo TCP device: the event loop thread that serves every context built on it. Share one
// among the communicators of a process (GroupBuilder does).
class GlooDevice {
 public:
  // kInvalidArgument (naming the host or interface) if Gloo cannot use the address.
  static StatusOr<std::shared_ptr<GlooDevice>> Create(const GlooOptions& options);
  ~GlooDevice();

  class Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  explicit GlooDevice(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class GlooCommunicator : public Communicator {
 public:
  // Allreduce buffers (bytes) and reduce-scatter inputs (bytes, all pieces) up to this size
  // take the one-round algorithms, reduced in rank order; larger ones a ring: ours for
  // reduce-scatter and f16/bf16 allreduce (ring order), Gloo's for other allreduces (Gloo's
  // order). docs/collectives.md, "Reduction algorithms".
  static constexpr size_t kOneShotMaxBytes = size_t{64} << 10;

  // Collective over `size` ranks: every rank calls it with a store of the same generation and
  // the same `name` (unique within the generation, e.g. "world", "dp/3"). kInvalidArgument for
  // rank/size out of range or an empty name; the store's errors (kAborted for a stale
  // generation, kDeadlineExceeded naming the missing rank's key); kUnavailable if a peer
  // cannot be connected. `device` may be null: then one is created for this communicator from
  // the default GlooOptions (loopback); the environment is not read. Any thread.
  static StatusOr<std::unique_ptr<GlooCommunicator>> Create(Store& store, std::string_view name,
                                                            int rank, int size,
                                                            std::shared_ptr<GlooDevice> device,
                                                            Deadline deadline);
  // Aborts what is still running, then releases the context, its sockets and its thread.
  ~GlooCommunicator() override;

  int rank() const override;
  int size() const override;
  int64_t generation() const override;
  Capabilities capabilities() const override;
  StatusOr<std::unique_ptr<Work>> Start(CollectiveOp op) override;
  // The blocking calls run on the calling thread when no started operation is still queued or
  // running (else behind them, as Start + Wait). Statuses as Start + Wait.
  Status Run(CollectiveOp op) override;
  void Abort() override;
  bool broken() const override;
  // Whether collectives go through shared memory (decided in Create, the same on every rank).
  // Any thread.
  bool shared_memory() const;

  class Impl;

 private:
  explicit GlooCommunicator(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace morph

#endif  // MORPH_COLLECTIVES_GLOO_COMMUNICATOR_H_
