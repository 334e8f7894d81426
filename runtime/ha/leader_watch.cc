#include "runtime/ha/leader_watch.h"

#include "runtime/ha/election.h"

namespace morph {

LeaderWatch::LeaderWatch(EtcdOptions options, std::string prefix,
                         std::chrono::milliseconds interval)
    : etcd_(std::move(options)), key_(LeaderKey(prefix)), interval_(interval) {
  thread_ = std::thread([this] { Loop(); });
}

LeaderWatch::~LeaderWatch() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void LeaderWatch::Follow(std::string value) {
  std::lock_guard<std::mutex> l(mu_);
  followed_ = value;
  seen_ = std::move(value);  // the freshest read there is; a read in flight is older
  ++epoch_;
}

bool LeaderWatch::Moved() const {
  std::lock_guard<std::mutex> l(mu_);
  return followed_ && seen_ && *seen_ != *followed_;
}

void LeaderWatch::Loop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    const uint64_t epoch = epoch_;
    l.unlock();
    StatusOr<std::optional<EtcdKv>> kv = etcd_.Get(key_);
    l.lock();
    if (kv.ok() && kv->has_value() && epoch == epoch_) {
      seen_ = (*kv)->value;
      if (!followed_) followed_ = seen_;
    }
    cv_.wait_for(l, interval_, [&] { return stop_; });
  }
}

}  // namespace morph
