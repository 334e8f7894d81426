// A test double (not installed): a Gloo communicator whose capabilities say it can shrink, as
// NCCL's can. Its Shrink builds the smaller world by a Gloo rendezvous under "shrunk-world" in
// the new generation (over its own KvTable, the double's rendezvous space) and records the call,
// so that a test sees which path GroupBuilder::Rebuild or the runtime's switch took without a
// GPU. Like a real Shrink it releases its parent.
//
//   auto table = std::make_shared<KvTable>();
//   ShrinkLog log;
//   CommunicatorFactory f = ShrinkableGlooFactory(GlooFactory(device), table, device, &log);
#ifndef MORPH_COLLECTIVES_SHRINKABLE_GLOO_H_
#define MORPH_COLLECTIVES_SHRINKABLE_GLOO_H_

#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "collectives/gloo/gloo_communicator.h"
#include "collectives/groups.h"
#include "collectives/store/store.h"

namespace morph {

struct ShrinkLog {
  std::mutex mu;
  std::vector<ShrinkMode> modes;
  std::vector<std::vector<int>> excluded;
};

class ShrinkableGloo : public Communicator {
 public:
  ShrinkableGloo(std::unique_ptr<Communicator> inner, std::shared_ptr<KvTable> table,
                 std::shared_ptr<GlooDevice> device, ShrinkLog* log)
      : inner_(std::move(inner)), table_(std::move(table)), device_(device), log_(log) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  int64_t generation() const override { return inner_->generation(); }
  Capabilities capabilities() const override {
    Capabilities c = inner_->capabilities();
    c.backend = "shrinkable-gloo";
    c.shrink = true;
    return c;
  }
  StatusOr<std::unique_ptr<Work>> Start(CollectiveOp op) override {
    return inner_->Start(std::move(op));
  }
  void Abort() override { inner_->Abort(); }
  bool broken() const override { return inner_->broken(); }
  StatusOr<std::unique_ptr<Communicator>> Shrink(std::span<const int> exclude, ShrinkMode mode,
                                                 int64_t generation, Deadline deadline) override {
    {
      std::lock_guard<std::mutex> lock(log_->mu);
      log_->modes.push_back(mode);
      log_->excluded.emplace_back(exclude.begin(), exclude.end());
    }
    int below = 0;
    for (int r : exclude) below += r < rank() ? 1 : 0;
    MemoryStore store(table_, generation);
    MORPH_ASSIGN_OR_RETURN(
        auto next,
        GlooCommunicator::Create(store, "shrunk-world", rank() - below,
                                 size() - static_cast<int>(exclude.size()), device_, deadline));
    inner_.reset();  // released, as a real Shrink releases its parent
    return std::unique_ptr<Communicator>(
        new ShrinkableGloo(std::move(next), table_, device_, log_));
  }

 private:
  std::unique_ptr<Communicator> inner_;
  std::shared_ptr<KvTable> table_;
  std::shared_ptr<GlooDevice> device_;
  ShrinkLog* log_;
};

// Wraps every communicator `inner` builds in a ShrinkableGloo.
inline CommunicatorFactory ShrinkableGlooFactory(CommunicatorFactory inner,
                                                 std::shared_ptr<KvTable> table,
                                                 std::shared_ptr<GlooDevice> device,
                                                 ShrinkLog* log) {
  return [=](Store& store, std::string_view name, int rank, int size,
             Deadline deadline) -> StatusOr<std::unique_ptr<Communicator>> {
    MORPH_ASSIGN_OR_RETURN(auto c, inner(store, name, rank, size, deadline));
    return std::unique_ptr<Communicator>(new ShrinkableGloo(std::move(c), table, device, log));
  };
}

}  // namespace morph

#endif  // MORPH_COLLECTIVES_SHRINKABLE_GLOO_H_
