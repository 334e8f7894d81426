#include "runtime/switch/live_groups.h"

namespace morph {

LiveGroups::~LiveGroups() { Reset(); }

void LiveGroups::JoinReaper() {
  if (reaper_.joinable()) reaper_.join();
}

void LiveGroups::Adopt(std::unique_ptr<GroupSet> next, std::shared_ptr<void> keep_until_torn_down) {
  JoinReaper();
  std::unique_ptr<GroupSet> old;
  {
    std::lock_guard<std::mutex> l(mu_);
    old = std::move(groups_);
    groups_ = std::move(next);
    can_shrink_.store(groups_ && groups_->world().capabilities().shrink);
  }
  reaper_ = std::thread([old = std::move(old), done = std::move(keep_until_torn_down)]() mutable {
    old.reset();
    done.reset();
  });
}

std::unique_ptr<GroupSet> LiveGroups::Take() {
  std::lock_guard<std::mutex> l(mu_);
  can_shrink_.store(false);
  return std::move(groups_);
}

LiveGroups::Aborted LiveGroups::AbortAll(int64_t generation) {
  std::lock_guard<std::mutex> l(mu_);
  if (!groups_) return Aborted::kNone;
  if (generation >= 0 && groups_->generation() != generation) return Aborted::kOtherGeneration;
  groups_->AbortAll();
  return Aborted::kAborted;
}

void LiveGroups::Reset() {
  JoinReaper();
  std::lock_guard<std::mutex> l(mu_);
  groups_.reset();
}

}  // namespace morph
