// Admission control for a server's connections before they authenticate (the store, the
// coordinator's control channel): how many may wait at once, bounded by the process's
// open-file limit so that idle strangers never take the descriptors the rest of the process
// needs (a training worker hosting the coordinator: its own sockets, the store, the scheduler
// API), and which one goes at the cap (the oldest). And a limit on the warnings a flood causes.
//
//   PreAuthQueue<std::shared_ptr<Conn>> waiting(PreAuthCap(options.max_unauthenticated));
//   if (waiting.full()) Close(waiting.oldest());  // Close calls waiting.Remove(its handle)
//   conn->handle = waiting.Add(conn);
//   ...  // authenticated: waiting.Remove(conn->handle)
//
//   WarningLimiter limiter;  // one line per 10 s at most
//   if (int64_t folded = 0; limiter.Allow(&folded)) LOG(WARNING) << what << Folded(folded);
//
// Not thread-safe: each is used by one server's io thread.
#ifndef MORPH_BASE_CONNECTION_LIMIT_H_
#define MORPH_BASE_CONNECTION_LIMIT_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <list>
#include <string>

namespace morph {

// RLIMIT_NOFILE's soft limit now; INT64_MAX when unlimited or unknown.
int64_t OpenFileLimit();

// How many connections one server may hold before they authenticate: `configured`, but at most
// an eighth of `open_file_limit` (and at least 8). Two flooded servers (store and control
// channel) then hold at most a quarter of the descriptors and the scheduler API 64 more: the
// rest stay with the process (its workers' connections, a hosting worker's own sockets).
int64_t PreAuthCap(int64_t configured, int64_t open_file_limit = OpenFileLimit());

// The connections of one server that have not authenticated yet, oldest first, with a cap.
template <typename T>
class PreAuthQueue {
 public:
  using Handle = typename std::list<T>::iterator;

  explicit PreAuthQueue(int64_t cap = 1) : cap_(std::max<int64_t>(1, cap)) {}
  void set_cap(int64_t cap) { cap_ = std::max<int64_t>(1, cap); }
  int64_t cap() const { return cap_; }

  size_t size() const { return list_.size(); }
  bool empty() const { return list_.empty(); }
  // At the cap: the caller closes oldest() (which removes it) before it adds a newcomer.
  bool full() const { return static_cast<int64_t>(list_.size()) >= cap_; }
  const T& oldest() const { return list_.front(); }  // requires !empty()

  Handle Add(T value) {
    list_.push_back(std::move(value));
    return std::prev(list_.end());
  }
  // Once per Add: when the connection authenticated or closed.
  void Remove(Handle h) { list_.erase(h); }

 private:
  std::list<T> list_;
  int64_t cap_;
};

// A warning a flood would repeat (a refused stranger, a failed accept): at most one line per
// `interval`, which says how many occurrences it stands for.
class WarningLimiter {
 public:
  explicit WarningLimiter(std::chrono::steady_clock::duration interval = std::chrono::seconds(10))
      : interval_(interval) {}
  // True when this occurrence is to be logged; `*folded` is then the number of occurrences
  // since the last logged one that were not.
  bool Allow(int64_t* folded);

 private:
  std::chrono::steady_clock::duration interval_;
  std::chrono::steady_clock::time_point last_{};
  bool logged_ = false;
  int64_t folded_ = 0;
};

// " (and N more like it in the last 10 s)" for N > 0, else "".
std::string Folded(int64_t folded);

}  // namespace morph

#endif  // MORPH_BASE_CONNECTION_LIMIT_H_
