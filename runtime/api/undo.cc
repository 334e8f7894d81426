#include "runtime/api/undo.h"

#include <cstring>

namespace morph {

Status UndoCopy::Take(State& state, int64_t step, int64_t generation) {
  step_ = -1;
  const size_t n = state.tensors().size();
  tensors_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    State::TensorRef t = state.TensorAt(i);
    if (t.data.bytes > 0 && t.data.kind != MemoryKind::kHost) {
      return FailedPreconditionError("MORPH_UNDO_COPY: tensor '" + t.spec->name +
                                     "' is not in host memory");
    }
    tensors_[i].resize(t.data.bytes);
    if (t.data.bytes > 0) std::memcpy(tensors_[i].data(), t.data.data, t.data.bytes);
  }
  scalars_.resize(state.scalars().size());
  for (size_t i = 0; i < scalars_.size(); ++i) {
    std::span<const std::byte> v = state.ScalarAt(i);
    scalars_[i].assign(v.begin(), v.end());
  }
  step_ = step;
  generation_ = generation;
  return Status();
}

int64_t UndoCopy::StepFor(State& state, int64_t generation) {
  if (step_ < 0 || generation_ != generation || tensors_.size() != state.tensors().size()) {
    return -1;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (state.TensorAt(i).data.bytes != tensors_[i].size()) return -1;
  }
  return step_;
}

void UndoCopy::PutBack(State& state) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    State::TensorRef t = state.TensorAt(i);
    if (t.data.bytes > 0) std::memcpy(t.data.data, tensors_[i].data(), t.data.bytes);
  }
  for (size_t i = 0; i < scalars_.size(); ++i) {
    std::span<std::byte> v = state.MutableScalarAt(i);
    std::memcpy(v.data(), scalars_[i].data(), v.size());
  }
  state.MarkWhole();
}

}  // namespace morph
