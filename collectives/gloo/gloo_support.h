// Pieces of the Gloo backend that deal with Gloo itself rather than with our operations:
// Gloo's rendezvous store over ours, waking a tcp::Pair's waiters, keeping SIGPIPE from
// killing the process and launcher CPU bindings from Gloo's threads. Internal to collectives/
// (not installed): gloo_communicator.cc and gloo_support_test.cc include it, with gloo_compat/
// on their path.
#ifndef MORPH_COLLECTIVES_GLOO_SUPPORT_H_
#define MORPH_COLLECTIVES_GLOO_SUPPORT_H_

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/pair.h>
#include <gloo/transport/tcp/unbound_buffer.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <vector>

#include "morph/deadline.h"
#include "morph/status.h"
#include "collectives/gloo/gloo_errors.h"
#include "collectives/store/store.h"

namespace morph::gloo_support {

// Whether gloo_accept_guard.cc's getpeername is in this program (it keeps a peer that dies while
// connecting from ending the process through Gloo's event thread). Calling it links it in.
bool AcceptGuardLinked();

// Gloo's store interface over ours, blocking up to a real deadline. Gloo wants exceptions;
// the Status behind the last one is kept so our boundary reports the real code.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(::morph::Store* store, Deadline deadline) : store_(store), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_->Set(key, std::string_view(data.data(), data.size()), deadline_));
  }
  std::vector<char> get(const std::string& key) override {
    StatusOr<std::string> v = store_->Get(key, deadline_);
    Check(v.status().ok() ? Status::Ok() : v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  // Gloo waits for a key, then gets it. Our Get blocks until the key is set, so a wait for one
  // key is left to the get that follows: one store round trip per peer instead of two.
  void wait(const std::vector<std::string>& keys) override {
    if (keys.size() != 1) Check(store_->Wait(keys, deadline_));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    if (keys.size() == 1) return;
    Deadline d = timeout.count() > 0 ? Min(deadline_, Deadline::After(timeout)) : deadline_;
    Check(store_->Wait(keys, d));
  }

  const Status& error() const { return error_; }

 private:
  void Check(const Status& s) {
    if (s.ok()) return;
    error_ = s;
    throw gloo::IoException(s.ToString());
  }
  ::morph::Store* store_;
  Deadline deadline_;
  Status error_;
};

// tcp::Pair::signalExceptionExternal is what Gloo itself calls when a wait times out: it
// records an error on the pair, wakes every buffer waiting on it and closes the socket. It is
// protected; this names it through a derived class, which C++ permits.
// Gloo's signal wakes the buffers with operations still queued on the pair, but not the one
// whose payload the pair is reading (rx_) or writing (tx_) at that moment: a receive caught
// mid-payload would sit until its own timeout. Signal wakes those too, with the pair's error.
struct UnboundBufferAccess : gloo::transport::tcp::UnboundBuffer {
  static void Signal(gloo::transport::tcp::UnboundBuffer* buf, std::exception_ptr ex) {
    auto fn = &UnboundBufferAccess::signalException;
    (buf->*fn)(std::move(ex));
  }
};

struct PairAccess : gloo::transport::tcp::Pair {
  static std::exception_ptr Signal(gloo::transport::tcp::Pair* pair, const std::string& msg) {
    auto fn = &PairAccess::signalExceptionExternal;
    std::exception_ptr ex = (pair->*fn)(msg);
    if (ex != nullptr) WakeInFlight(pair, ex);
    return ex;
  }

  // Fails the buffers of the message being read and of the writes still queued (see
  // UnboundBufferAccess), under the pair's lock as Gloo itself signals buffers. Their weak
  // references keep a buffer that is being destroyed out of reach.
  static void WakeInFlight(gloo::transport::tcp::Pair* pair, const std::exception_ptr& ex) {
    using gloo::transport::tcp::UnboundBuffer;
    std::mutex& mu = pair->*(&PairAccess::m_);
    std::lock_guard<std::mutex> lock(mu);
    auto wake = [&](const gloo::WeakNonOwningPtr<UnboundBuffer>& weak) {
      if (!weak) return;
      gloo::NonOwningPtr<UnboundBuffer> buf(weak);
      if (buf) UnboundBufferAccess::Signal(buf.operator->(), ex);
    };
    wake((pair->*(&PairAccess::rx_)).ubuf);
    for (const gloo::transport::tcp::Op& op : pair->*(&PairAccess::tx_)) wake(op.ubuf);
  }
  // The error Gloo recorded on the pair ("Connection closed by peer ..."), "" if none.
  static std::string Error(gloo::transport::tcp::Pair* pair) {
    std::mutex& mu = pair->*(&PairAccess::m_);
    std::exception_ptr ex;
    {
      std::lock_guard<std::mutex> lock(mu);
      ex = pair->*(&PairAccess::ex_);
    }
    if (ex == nullptr) return "";
    try {
      std::rethrow_exception(ex);
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "unknown error";
    }
  }
};

// The peers whose pair in `context` holds an error that a peer caused (its connection closed
// or failed), leaving out what this rank raised itself (kGlooLocalSignalPrefix) and timeouts.
// The caller must keep `context` alive; takes each pair's own lock briefly.
inline std::vector<int> PeersWithClosedPairs(gloo::rendezvous::Context& context) {
  std::vector<int> peers;
  for (int i = 0; i < context.size; ++i) {
    if (i == context.rank) continue;
    auto* tcp = dynamic_cast<gloo::transport::tcp::Pair*>(context.getPair(i).get());
    if (tcp == nullptr) continue;
    std::string what = PairAccess::Error(tcp);
    if (!what.empty() && ClassifyGlooError(what) == GlooErrorKind::kPeerClosed) {
      peers.push_back(i);
    }
  }
  return peers;
}

// Gloo writes to its sockets with writev, which raises SIGPIPE when the peer died; that
// would kill the process (Python, Gloo's usual host, ignores SIGPIPE; we must not install a
// handler). SIGPIPE from a write goes to the writing thread, so it is blocked in the threads
// that write: ours (the op thread, permanently) and Gloo's event thread (which inherits the
// mask of the thread that creates the device). A caller's thread blocks it only around the
// Gloo calls it makes, then drops a SIGPIPE raised meanwhile before restoring its mask.
class ScopedSigpipeBlock {
 public:
  ScopedSigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~ScopedSigpipeBlock() {
    if (sigismember(&old_, SIGPIPE)) return;  // was blocked already: leave it so
    sigset_t pending;
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE)) {
      timespec zero{0, 0};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  ScopedSigpipeBlock(const ScopedSigpipeBlock&) = delete;
  ScopedSigpipeBlock& operator=(const ScopedSigpipeBlock&) = delete;

 private:
  sigset_t pipe_;
  sigset_t old_;
};

// Widens the calling thread's CPU affinity to every CPU the process may use (the kernel
// intersects the request with the cpuset) while it exists, so that threads it starts do not
// inherit a launcher's binding; restores the binding after. Does nothing when `enable` is
// false or the affinity cannot be read; a failed widening leaves the binding as it was.
class ScopedUnbind {
 public:
  explicit ScopedUnbind(bool enable) {
    if (!enable || pthread_getaffinity_np(pthread_self(), sizeof(old_), &old_) != 0) return;
    cpu_set_t all;
    CPU_ZERO(&all);
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &all);
    changed_ = pthread_setaffinity_np(pthread_self(), sizeof(all), &all) == 0;
  }
  ~ScopedUnbind() {
    if (changed_) pthread_setaffinity_np(pthread_self(), sizeof(old_), &old_);
  }
  ScopedUnbind(const ScopedUnbind&) = delete;
  ScopedUnbind& operator=(const ScopedUnbind&) = delete;

 private:
  cpu_set_t old_;
  bool changed_ = false;
};

inline void BlockSigpipeInThisThread() {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
}

}  // namespace morph::gloo_support

#endif  // MORPH_COLLECTIVES_GLOO_SUPPORT_H_
