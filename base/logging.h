// Log lines that say who is speaking: every worker line carries generation, rank/world and
// component, e.g. "[g4 r5/8 reshard] generation 4: world 8 -> 6, reshard 1.2 GB in 0.41 s".
//
//   LogContext ctx("reshard");
//   ctx.Set(/*generation=*/4, /*rank=*/5, /*world=*/8);
//   MORPH_LOG(INFO, ctx) << "plan has " << n << " transfers";
//   MORPH_VLOG(2, ctx) << "packing " << box;
//
// The library never initializes glog; programs do (InitLogging below is for programs and test
// mains). A LogContext may be updated by one thread while others log with it.
#ifndef MORPH_BASE_LOGGING_H_
#define MORPH_BASE_LOGGING_H_

#include <glog/logging.h>

#include <atomic>
#include <cstdint>
#include <ostream>
#include <string>

namespace morph {

class LogContext {
 public:
  explicit LogContext(std::string component) : component_(std::move(component)) {}
  LogContext(const LogContext& other)
      : component_(other.component_),
        packed_(other.packed_.load(std::memory_order_relaxed)) {}

  // generation < 0 or rank < 0 means "not known yet" and prints as "-".
  void Set(int64_t generation, int rank, int world) {
    packed_.store(Pack(generation, rank, world), std::memory_order_relaxed);
  }
  int64_t generation() const { return Unpack(packed_.load(std::memory_order_relaxed)).g; }
  int rank() const { return Unpack(packed_.load(std::memory_order_relaxed)).r; }
  int world() const { return Unpack(packed_.load(std::memory_order_relaxed)).w; }
  const std::string& component() const { return component_; }

  // "[g4 r5/8 reshard] "
  std::string Prefix() const;

 private:
  struct Fields {
    int64_t g;
    int r;
    int w;
  };
  // generation: 24 bits, rank and world: 20 bits each, so one atomic holds all three and a
  // reader never sees a mix of two Set calls. Values beyond the range print as "-".
  static uint64_t Pack(int64_t g, int r, int w);
  static Fields Unpack(uint64_t v);

  std::string component_;
  std::atomic<uint64_t> packed_{Pack(-1, -1, 0)};
};

std::ostream& operator<<(std::ostream& os, const LogContext& ctx);

// For programs and test mains only: glog to stderr, once per process, no failure signal
// handler (it would swallow SIGTERM, our preemption notice).
void InitLogging(const char* argv0);

}  // namespace morph

#define MORPH_LOG(severity, ctx) LOG(severity) << (ctx)
#define MORPH_VLOG(level, ctx) VLOG(level) << (ctx)

#endif  // MORPH_BASE_LOGGING_H_
