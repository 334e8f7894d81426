#include "runtime/state/undo.h"

#include <algorithm>
#include <cstring>

namespace morph {
namespace {

// Per memcpy: large enough that glibc streams it past the cache (non-temporal stores), small
// enough that Cancel stops a copy quickly.
constexpr size_t kChunk = size_t{64} << 20;

}  // namespace

UndoCopy::~UndoCopy() { Cancel(); }

Status UndoCopy::Prepare(const StateStore& state, Slot& slot, std::vector<Source>& tensors) {
  const size_t n = state.tensors().size();
  slot.tensors.resize(n);
  tensors.clear();
  for (size_t i = 0; i < n; ++i) {
    const State::TensorRef t = state.TensorAt(i);
    if (t.data.bytes > 0 && t.data.kind != MemoryKind::kHost) {
      return FailedPreconditionError("MORPH_UNDO_COPY: tensor '" + t.spec->name +
                                     "' is not in host memory");
    }
    slot.tensors[i].resize(t.data.bytes);
    tensors.push_back({static_cast<const std::byte*>(t.data.data), t.data.bytes});
  }
  slot.scalars.resize(state.scalars().size());
  for (size_t i = 0; i < slot.scalars.size(); ++i) {
    const std::span<const std::byte> v = state.ScalarAt(i);
    slot.scalars[i].assign(v.begin(), v.end());  // small: copied here, not in Fill
  }
  return Status::Ok();
}

bool UndoCopy::Fill(const std::vector<Source>& tensors, Slot& slot) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t done = 0; done < tensors[i].bytes; done += kChunk) {
      if (cancel_.load(std::memory_order_relaxed)) return false;
      const size_t n = std::min(kChunk, tensors[i].bytes - done);
      std::memcpy(slot.tensors[i].data() + done, tensors[i].data + done, n);
    }
  }
  return true;
}

void UndoCopy::Cancel() {
  if (!in_flight_) return;
  cancel_.store(true);
  if (worker_.joinable()) worker_.join();
  cancel_.store(false);
  in_flight_ = false;
}

Status UndoCopy::Begin(const StateStore& state, int64_t step, int64_t generation) {
  Cancel();
  const int spare = taken_ == 0 ? 1 : 0;
  Slot& slot = slots_[static_cast<size_t>(spare)];
  slot.step = -1;
  std::vector<Source> tensors;
  MORPH_RETURN_IF_ERROR(Prepare(state, slot, tensors));
  in_flight_ = true;
  in_flight_slot_ = spare;
  in_flight_ok_ = false;
  in_flight_step_ = step;
  in_flight_generation_ = generation;
  worker_ = std::thread([this, tensors = std::move(tensors), target = &slot] {
    in_flight_ok_ = Fill(tensors, *target);
  });
  return Status::Ok();
}

Status UndoCopy::Take(StateStore& state, int64_t step, int64_t generation) {
  if (in_flight_ && in_flight_step_ == step && in_flight_generation_ == generation) {
    worker_.join();
    in_flight_ = false;
    if (in_flight_ok_) {
      Slot& slot = slots_[static_cast<size_t>(in_flight_slot_)];
      slot.step = step;
      slot.generation = generation;
      taken_ = in_flight_slot_;
      return Status::Ok();
    }
  }
  Cancel();
  const int spare = taken_ == 0 ? 1 : 0;
  Slot& slot = slots_[static_cast<size_t>(spare)];
  slot.step = -1;
  std::vector<Source> tensors;
  if (Status s = Prepare(state, slot, tensors); !s.ok()) {
    taken_ = -1;  // the previous copy is not of the step before this update
    return s;
  }
  (void)Fill(tensors, slot);  // nothing can cancel it here
  slot.step = step;
  slot.generation = generation;
  taken_ = spare;
  return Status::Ok();
}

int64_t UndoCopy::StepFor(StateStore& state, int64_t generation) {
  Cancel();
  if (taken_ < 0) return -1;
  const Slot& slot = slots_[static_cast<size_t>(taken_)];
  if (slot.step < 0 || slot.generation != generation ||
      slot.tensors.size() != state.tensors().size()) {
    return -1;
  }
  for (size_t i = 0; i < slot.tensors.size(); ++i) {
    if (state.TensorAt(i).data.bytes != slot.tensors[i].size()) return -1;
  }
  return slot.step;
}

void UndoCopy::PutBack(StateStore& state) {
  Cancel();
  const Slot& slot = slots_[static_cast<size_t>(taken_)];
  for (size_t i = 0; i < slot.tensors.size(); ++i) {
    State::TensorRef t = state.TensorAt(i);
    if (t.data.bytes > 0) std::memcpy(t.data.data, slot.tensors[i].data(), t.data.bytes);
  }
  for (size_t i = 0; i < slot.scalars.size(); ++i) {
    std::span<std::byte> v = state.MutableScalarAt(i);
    std::memcpy(v.data(), slot.scalars[i].data(), v.size());
  }
  state.MarkWhole();
}

}  // namespace morph
