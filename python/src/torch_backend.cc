// morph._torch_backend: a torch.distributed backend ("morph", c10d::Backend) over the
// generation's morph communicators (docs/torch.md "Process groups"). Built against the torch
// the package runs with (its headers and pybind11; python/CMakeLists.txt), beside the nanobind
// extension, and linked to the same libmorph, so that a morph::Communicator handed over as an
// address is the runtime's own object.
//
// Why a backend of our own rather than torch's Gloo groups: morph builds a generation's
// communicators during the prepare, while the old generation trains, so the torch groups over
// them cost no connection at the switch step; and when a peer fails the runtime aborts them,
// so a torch collective in flight raises at once on every survivor (a Gloo group ends it only
// when one of its own connections closes, else at its timeout).
//
// Every operation is started on the communicator (its ops run in order on its own thread) and
// returns a Work that Wait-s on it: async_op=True overlaps as with torch's Gloo. An op's buffers
// live until the communicator is done with them, whether or not the program keeps its Work (the
// backend keeps every op in flight); get_future() returns at once and a thread of the backend
// completes the future. A group's ops come from the thread that runs the steps (the one that
// built the groups): another thread's op raises before anything is sent, since two threads'
// ops would pair up in different orders on different ranks. CPU tensors of
// the dtypes morph reduces (f32, f64, f16, bf16, i32, i64, i8, u8; bool moved as u8 where
// nothing is reduced); sum, avg, max, min. Point-to-point ops between a coalescing start and
// end progress together (batch_isend_irecv), as morph's SendRecv does.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "morph/communicator.h"
#include "torch_ext.h"

namespace morph_torch {
namespace {

using c10d::OpType;
using morph::CollectiveOp;
using morph::DType;

[[noreturn]] void Fail(const morph::Status& s, const std::string& what) {
  std::string msg = "morph backend: " + what + ": " + s.ToString();
  switch (s.code()) {
    case morph::StatusCode::kInvalidArgument:  // the program's call (ranks that differ, ...)
      TORCH_CHECK_VALUE(false, msg);
    case morph::StatusCode::kDeadlineExceeded:
      TORCH_CHECK_WITH(DistBackendError, false, msg + " (Timed out)");
    default:
      TORCH_CHECK_WITH(DistNetworkError, false, msg);
  }
}

DType DTypeOf(const at::Tensor& t, bool reduced) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kDouble: return DType::kF64;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    case at::kChar: return DType::kI8;
    case at::kByte: return DType::kU8;
    case at::kBool:
      if (!reduced) return DType::kU8;
      break;
    default:
      break;
  }
  TORCH_CHECK(false, "morph backend: dtype ", t.scalar_type(),
              reduced ? " is not reduced by morph's communicators"
                      : " is not moved by morph's communicators");
}

void CheckTensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "morph backend: ", what, " is on ", t.device(),
              " (the morph backend moves CPU tensors; CUDA groups use NCCL)");
  TORCH_CHECK(t.is_contiguous(), "morph backend: ", what, " is not contiguous");
  TORCH_CHECK(!t.is_sparse(), "morph backend: ", what, " is sparse");
}

// A started morph operation and what completes the torch op after it (copies out, AVG's
// division). Shared by its Work, which the program may drop, and the backend's ops in flight,
// so that its buffers live until the communicator is done with them. Completes once; later
// calls report that outcome. Complete from one thread at a time (mu_).
class Pending {
 public:
  Pending(std::unique_ptr<morph::Work> work, std::vector<at::Tensor> outputs,
          std::function<void()> finish, std::chrono::milliseconds timeout, std::string what,
          std::vector<at::Tensor> inputs)
      : work_(std::move(work)), outputs_(std::move(outputs)), inputs_(std::move(inputs)),
        finish_(std::move(finish)), timeout_(timeout), what_(std::move(what)) {}

  // Waits up to `timeout` (kNoTimeout: the op's own) and completes. Its error, if any.
  std::exception_ptr Complete(std::chrono::milliseconds timeout) {
    c10::intrusive_ptr<c10::ivalue::Future> mark;
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!done_) {
        auto t = timeout == ::kNoTimeout ? timeout_ : timeout;
        morph::Status s = work_ ? work_->Wait(morph::Deadline::After(t)) : morph::Status();
        try {
          if (!s.ok()) Fail(s, what_);
          if (finish_) finish_();
        } catch (...) {
          error_ = std::current_exception();
        }
        work_.reset();
        inputs_.clear();
        finish_ = nullptr;
        done_ = true;
      }
      error = error_;
      if (future_ && !future_marked_) {
        future_marked_ = true;
        mark = future_;
      }
    }
    if (mark) Mark(mark, error);  // outside the lock: its callbacks may wait on this op
    return error;
  }
  // Completing would not block.
  bool Done() {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);  // a wait in progress: not yet
    return lock.owns_lock() && (done_ || !work_ || work_->Done());
  }
  bool completed() const { return done_; }
  bool succeeded() const { return done_ && !error_; }
  std::exception_ptr error() const { return done_ ? error_ : nullptr; }
  const std::vector<at::Tensor>& outputs() const { return outputs_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // The op's future; when `needs_completer` comes back true, a thread must Complete it.
  c10::intrusive_ptr<c10::ivalue::Future> Future(bool* needs_completer) {
    std::exception_ptr error;
    c10::intrusive_ptr<c10::ivalue::Future> mark;
    {
      std::lock_guard<std::mutex> lock(mu_);
      *needs_completer = false;
      if (future_) return future_;
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()));
      if (!done_) {
        *needs_completer = true;
        return future_;
      }
      future_marked_ = true;
      mark = future_;
      error = error_;
    }
    Mark(mark, error);
    return mark;
  }

 private:
  void Mark(const c10::intrusive_ptr<c10::ivalue::Future>& f, std::exception_ptr error) {
    if (error) {
      f->setError(error);
    } else {
      f->markCompleted(c10::IValue(outputs_));
    }
  }

  std::mutex mu_;
  std::unique_ptr<morph::Work> work_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> inputs_;  // alive until the op is over (a temporary's storage)
  std::function<void()> finish_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool future_marked_ = false;
};

// A backend's ops in flight, oldest first (the communicator runs them in that order). Ops whose
// Work the program dropped are completed here: at the next op, after any wait, and when the
// backend goes (then waited for, so that no buffer is freed under the communicator).
class InFlight {
 public:
  void Add(std::shared_ptr<Pending> p) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_.push_back(std::move(p));
  }
  // Completes the oldest ops that are done.
  void Reap() {
    while (true) {
      std::shared_ptr<Pending> p;
      {
        std::lock_guard<std::mutex> lock(mu_);
        while (!ops_.empty() && ops_.front()->completed()) ops_.pop_front();
        if (ops_.empty() || !ops_.front()->Done()) return;
        p = std::move(ops_.front());
        ops_.pop_front();
      }
      p->Complete(std::chrono::milliseconds(0));
    }
  }
  // Completes every op (each within its own timeout).
  void Drain() {
    std::deque<std::shared_ptr<Pending>> ops;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops.swap(ops_);
    }
    for (auto& p : ops) p->Complete(::kNoTimeout);
  }

 private:
  std::mutex mu_;
  std::deque<std::shared_ptr<Pending>> ops_;
};

// The thread that completes the futures of a backend's ops (get_future() returns at once, as
// with torch's own backends; DDP overlaps its reductions with the backward pass through them).
// Their callbacks run on it.
class Completer {
 public:
  ~Completer() { Stop(); }
  void Add(std::shared_ptr<Pending> p) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(p));
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
    cv_.notify_one();
  }
  // Completes what is queued, then ends the thread.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::shared_ptr<Pending> p = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      p->Complete(::kNoTimeout);
      p.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

class MorphWork : public c10d::Work {
 public:
  MorphWork(OpType type, std::shared_ptr<Pending> p, std::shared_ptr<InFlight> in_flight,
            std::shared_ptr<Completer> completer)
      : c10d::Work(-1, type), p_(std::move(p)), in_flight_(std::move(in_flight)),
        completer_(std::move(completer)) {}

  bool isCompleted() override {
    if (!p_->completed() && p_->Done()) p_->Complete(std::chrono::milliseconds(0));
    return p_->completed();
  }
  bool isSuccess() const override { return p_->succeeded(); }
  std::exception_ptr exception() const override { return p_->error(); }
  std::vector<at::Tensor> result() override { return p_->outputs(); }

  bool wait(std::chrono::milliseconds timeout) override {
    std::exception_ptr error = p_->Complete(timeout);
    if (in_flight_) in_flight_->Reap();  // ops before it are done too: complete dropped ones
    if (error) std::rethrow_exception(error);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    bool needs_completer = false;
    c10::intrusive_ptr<c10::ivalue::Future> f = p_->Future(&needs_completer);
    if (needs_completer) completer_->Add(p_);
    return f;
  }

 private:
  std::shared_ptr<Pending> p_;
  std::shared_ptr<InFlight> in_flight_;
  std::shared_ptr<Completer> completer_;
};

class MorphBackend : public c10d::Backend {
 public:
  MorphBackend(std::shared_ptr<morph::Communicator> comm, std::string name,
               std::chrono::milliseconds timeout)
      : c10d::Backend(comm->rank(), comm->size()), comm_(std::move(comm)), name_(std::move(name)),
        owner_(std::this_thread::get_id()), timeout_(timeout) {}

  // Its ops are over before the buffers go (InFlight::Drain) and the communicator is released
  // without the GIL: freeing one may join threads (this runs when Python drops the group).
  ~MorphBackend() override {
    auto release = [&] {
      completer_->Stop();
      in_flight_->Drain();
      comm_.reset();
    };
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      release();
    } else {
      release();
    }
  }

  const std::string getBackendName() const override { return "morph"; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK(tensors.size() == 1, "morph backend: allreduce of ", tensors.size(),
                " tensors (one per call)");
    at::Tensor& t = tensors[0];
    CheckTensor(t, "allreduce's tensor");
    Premultiplied(opts.reduceOp, t, /*in_place=*/true);
    auto [op, finish] = Reduce(opts.reduceOp, t);
    return Begin(OpType::ALLREDUCE,
                 CollectiveOp::Allreduce(t.data_ptr(), t.numel(), DTypeOf(t, true), op,
                                         Timeout(opts.timeout)),
                 {t}, std::move(finish), "allreduce");
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    c10::intrusive_ptr<c10d::Work> last;
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      last = allreduce(one, opts);
    }
    return Chain(std::move(last), tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    TORCH_CHECK(tensors.size() == 1, "morph backend: broadcast of ", tensors.size(), " tensors");
    at::Tensor& t = tensors[0];
    CheckTensor(t, "broadcast's tensor");
    return Begin(OpType::BROADCAST,
                 CollectiveOp::Broadcast(t.data_ptr(), t.numel(), DTypeOf(t, false),
                                         static_cast<int>(opts.rootRank), Timeout(opts.timeout)),
                 {t}, nullptr, "broadcast");
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    CheckTensor(in, "all_gather's input");
    CheckTensor(out, "all_gather's output");
    TORCH_CHECK(out.numel() == in.numel() * size_ && out.scalar_type() == in.scalar_type(),
                "morph backend: all_gather_into_tensor's output holds ", out.numel(),
                " elements, not world size (", size_, ") x ", in.numel());
    return Begin(OpType::_ALLGATHER_BASE,
                 CollectiveOp::Allgather(in.data_ptr(), out.data_ptr(), in.numel(),
                                         DTypeOf(in, false), Timeout(opts.timeout)),
                 {out}, nullptr, "all_gather", {in});
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(inputs.size() == 1 && outputs.size() == 1 &&
                    static_cast<int>(outputs[0].size()) == size_,
                "morph backend: all_gather takes one input and world size outputs");
    at::Tensor in = inputs[0];
    CheckTensor(in, "all_gather's input");
    for (auto& o : outputs[0]) {
      TORCH_CHECK(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                  "morph backend: all_gather's outputs differ from its input in size or dtype");
    }
    at::Tensor flat = at::empty({in.numel() * size_}, in.options());
    std::vector<at::Tensor> outs = outputs[0];
    auto finish = [flat, outs, n = in.numel()]() mutable {
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n).view(outs[i].sizes()));
      }
    };
    return Begin(OpType::ALLGATHER,
                 CollectiveOp::Allgather(in.data_ptr(), flat.data_ptr(), in.numel(),
                                         DTypeOf(in, false), Timeout(opts.timeout)),
                 outs, finish, "all_gather", {in});
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "morph backend: coalesced all_gather sizes");
    c10::intrusive_ptr<c10d::Work> last;
    for (size_t i = 0; i < inputs.size(); ++i) last = _allgather_base(outputs[i], inputs[i], opts);
    return Chain(std::move(last), outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& opts) override {
    CheckTensor(in, "reduce_scatter's input");
    CheckTensor(out, "reduce_scatter's output");
    TORCH_CHECK(in.numel() == out.numel() * size_ && out.scalar_type() == in.scalar_type(),
                "morph backend: reduce_scatter_tensor's input holds ", in.numel(),
                " elements, not world size (", size_, ") x ", out.numel());
    const at::Tensor input = Premultiplied(opts.reduceOp, in, /*in_place=*/false);
    auto [op, finish] = Reduce(opts.reduceOp, out);
    return Begin(OpType::_REDUCE_SCATTER_BASE,
                 CollectiveOp::ReduceScatter(input.data_ptr(), out.data_ptr(), out.numel(),
                                             DTypeOf(in, true), op, Timeout(opts.timeout)),
                 {out}, std::move(finish), "reduce_scatter", {input});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1 &&
                    static_cast<int>(inputs[0].size()) == size_,
                "morph backend: reduce_scatter takes one output and world size inputs");
    std::vector<at::Tensor> flat_in;
    for (auto& t : inputs[0]) flat_in.push_back(t.reshape({-1}));
    at::Tensor in = at::cat(flat_in);
    at::Tensor out = outputs[0];
    return _reduce_scatter_base(out, in, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "morph backend: coalesced reduce_scatter sizes");
    c10::intrusive_ptr<c10d::Work> last;
    for (size_t i = 0; i < inputs.size(); ++i) {
      last = _reduce_scatter_base(outputs[i], inputs[i], opts);
    }
    return Chain(std::move(last), outputs);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    TORCH_CHECK(tensors.size() == 1, "morph backend: reduce of ", tensors.size(), " tensors");
    // An allreduce; off the root into a copy (torch leaves a non-root's tensor as it was).
    std::vector<at::Tensor> t{rank_ == opts.rootRank ? tensors[0] : tensors[0].clone()};
    c10d::AllreduceOptions ar;
    ar.reduceOp = opts.reduceOp;
    ar.timeout = opts.timeout;
    return allreduce(t, ar);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    TORCH_CHECK(inputs.size() == 1, "morph backend: gather of one input");
    at::Tensor in = inputs[0];
    CheckTensor(in, "gather's input");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<morph::P2POp> ops;
    std::vector<at::Tensor> keep{in};
    if (rank_ == root) {
      TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                  "morph backend: gather's root takes world size outputs");
      for (int r = 0; r < size_; ++r) {
        at::Tensor o = outputs[0][r];
        CheckTensor(o, "gather's output");
        TORCH_CHECK(o.nbytes() == in.nbytes(), "morph backend: gather's outputs differ in size");
        if (r == rank_) {
          o.copy_(in);
        } else {
          ops.push_back({morph::P2POp::Kind::kRecv, r, o.data_ptr(), o.nbytes()});
        }
        keep.push_back(o);
      }
    } else {
      ops.push_back({morph::P2POp::Kind::kSend, root, in.data_ptr(), in.nbytes()});
    }
    return Exchange(OpType::GATHER, std::move(ops), keep, Timeout(opts.timeout), "gather");
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == 1, "morph backend: scatter into one output");
    at::Tensor out = outputs[0];
    CheckTensor(out, "scatter's output");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<morph::P2POp> ops;
    std::vector<at::Tensor> keep{out};
    if (rank_ == root) {
      TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                  "morph backend: scatter's root takes world size inputs");
      for (int r = 0; r < size_; ++r) {
        at::Tensor i = inputs[0][r].contiguous();
        TORCH_CHECK(i.nbytes() == out.nbytes(), "morph backend: scatter's inputs differ in size");
        if (r == rank_) {
          out.copy_(i);
        } else {
          ops.push_back({morph::P2POp::Kind::kSend, r, i.data_ptr(), i.nbytes()});
        }
        keep.push_back(i);
      }
    } else {
      ops.push_back({morph::P2POp::Kind::kRecv, root, out.data_ptr(), out.nbytes()});
    }
    return Exchange(OpType::SCATTER, std::move(ops), keep, Timeout(opts.timeout), "scatter");
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    CheckTensor(in, "all_to_all's input");
    CheckTensor(out, "all_to_all's output");
    auto offsets = [&](const at::Tensor& t, const std::vector<int64_t>& splits,
                       const char* which) {
      const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
      const size_t row_bytes = rows == 0 ? 0 : t.nbytes() / rows;
      TORCH_CHECK_VALUE(splits.empty() || static_cast<int>(splits.size()) == size_,
                        "morph backend: all_to_all's ", which, " split sizes has ", splits.size(),
                        " entries for a group of ", size_);
      TORCH_CHECK_VALUE(!splits.empty() || rows % size_ == 0, "morph backend: all_to_all's ",
                        which, " of ", rows, " rows without split sizes: ", size_,
                        " ranks do not divide it");
      std::vector<std::pair<size_t, size_t>> v;  // (byte offset, bytes) per rank
      int64_t covered = 0;
      for (int r = 0; r < size_; ++r) {
        int64_t n = splits.empty() ? rows / size_ : splits[r];
        TORCH_CHECK_VALUE(n >= 0, "morph backend: all_to_all's ", which, " split size ", n,
                          " for rank ", r);
        v.emplace_back(static_cast<size_t>(covered) * row_bytes, n * row_bytes);
        covered += n;
      }
      TORCH_CHECK_VALUE(covered == rows, "morph backend: all_to_all's ", which,
                        " split sizes add up to ", covered, " rows, the tensor has ", rows);
      return v;
    };
    auto ins = offsets(in, in_splits, "input"), outs = offsets(out, out_splits, "output");
    auto* src = static_cast<char*>(in.data_ptr());
    auto* dst = static_cast<char*>(out.data_ptr());
    std::vector<morph::P2POp> ops;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        TORCH_CHECK(ins[r].second == outs[r].second, "morph backend: all_to_all's own split");
        std::memcpy(dst + outs[r].first, src + ins[r].first, ins[r].second);
        continue;
      }
      ops.push_back({morph::P2POp::Kind::kSend, r, src + ins[r].first, ins[r].second});
      ops.push_back({morph::P2POp::Kind::kRecv, r, dst + outs[r].first, outs[r].second});
    }
    return Exchange(OpType::ALLTOALL_BASE, std::move(ops), {out, in}, Timeout(opts.timeout),
                    "all_to_all");
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    TORCH_CHECK(static_cast<int>(outputs.size()) == size_ &&
                    static_cast<int>(inputs.size()) == size_,
                "morph backend: all_to_all takes world size inputs and outputs");
    std::vector<morph::P2POp> ops;
    std::vector<at::Tensor> keep;
    for (int r = 0; r < size_; ++r) {
      CheckTensor(outputs[r], "all_to_all's output");
      at::Tensor i = inputs[r].contiguous();
      keep.push_back(i);
      keep.push_back(outputs[r]);
      if (r == rank_) {
        outputs[r].copy_(i);
        continue;
      }
      ops.push_back({morph::P2POp::Kind::kSend, r, i.data_ptr(), i.nbytes()});
      ops.push_back({morph::P2POp::Kind::kRecv, r, outputs[r].data_ptr(), outputs[r].nbytes()});
    }
    return Exchange(OpType::ALLTOALL, std::move(ops), keep, Timeout(opts.timeout), "all_to_all");
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return Begin(OpType::BARRIER, CollectiveOp::Barrier(Timeout(opts.timeout)), {}, nullptr,
                 "barrier");
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int /*tag*/) override {
    return PointToPoint(morph::P2POp::Kind::kSend, tensors, dst, OpType::SEND);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int /*tag*/) override {
    return PointToPoint(morph::P2POp::Kind::kRecv, tensors, src, OpType::RECV);
  }

  // batch_isend_irecv: the sends and receives between start and end progress together.
  void startCoalescing() override {
    coalescing_ = true;
    pending_.clear();
    pending_tensors_.clear();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    coalescing_ = false;
    std::vector<morph::P2POp> ops = std::move(pending_);
    std::vector<at::Tensor> tensors = std::move(pending_tensors_);
    pending_.clear();
    pending_tensors_.clear();
    return Exchange(OpType::COALESCED, std::move(ops), std::move(tensors), timeout_, "send/recv");
  }

  void invalidate() { valid_ = false; }
  bool valid() const { return valid_.load(); }

 private:
  std::chrono::milliseconds Timeout(std::chrono::milliseconds t) const {
    return t == c10d::kUnsetTimeout ? timeout_ : t;
  }

  // PREMUL_SUM (FSDP2's reduce-scatter with a gradient divide factor): `in` times the op's
  // factor (a scalar or a one-element tensor), summed afterwards: `in` itself scaled in place
  // (an allreduce's tensor, overwritten by the result anyway) or a scaled copy (the caller's
  // reduce-scatter input stays as it was). Other ops, and a factor of 1 (bitwise SUM): `in`.
  static at::Tensor Premultiplied(const c10d::ReduceOp& op, const at::Tensor& in, bool in_place) {
    if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return in;
    auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(sup != nullptr, "morph backend: PREMUL_SUM without its factor");
    TORCH_CHECK(at::isFloatingType(in.scalar_type()), "morph backend: reduce op PREMUL_SUM of ",
                in.scalar_type(), " (it scales floating-point tensors)");
    at::Tensor f;
    if (sup->tensor_factor.defined()) {
      TORCH_CHECK(sup->tensor_factor.numel() == 1 && !sup->tensor_factor.is_cuda(),
                  "morph backend: PREMUL_SUM's factor is a one-element CPU tensor");
      f = sup->tensor_factor.to(in.scalar_type()).reshape({});
    } else if (sup->double_factor != 1.0) {
      f = at::scalar_tensor(sup->double_factor, in.options().dtype(in.scalar_type()));
    } else {
      return in;
    }
    return in_place ? in.mul_(f) : in.mul(f);
  }

  // morph's reduction for `op` on `out`, and what completes it (AVG: a sum, then / size).
  std::pair<morph::ReduceOp, std::function<void()>> Reduce(const c10d::ReduceOp& op,
                                                           const at::Tensor& out) const {
    switch (op.op_) {
      case c10d::ReduceOp::SUM:
      case c10d::ReduceOp::PREMUL_SUM:  // Premultiplied scaled the inputs
        return {morph::ReduceOp::kSum, nullptr};
      case c10d::ReduceOp::AVG:
        TORCH_CHECK(at::isFloatingType(out.scalar_type()), "morph backend: reduce op AVG of ",
                    out.scalar_type(), " (AVG averages floating-point tensors)");
        return {morph::ReduceOp::kSum, [out, n = size_]() mutable { out.div_(n); }};
      case c10d::ReduceOp::MAX: return {morph::ReduceOp::kMax, nullptr};
      case c10d::ReduceOp::MIN: return {morph::ReduceOp::kMin, nullptr};
      default: {
        static const char* kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR",
                                       "BXOR", "PREMUL_SUM"};
        const int i = static_cast<int>(op.op_);
        TORCH_CHECK(false, "morph backend: reduce op ", i >= 0 && i < 9 ? kNames[i] : "?",
                    " (morph reduces SUM, AVG, MAX, MIN, PREMUL_SUM)");
      }
    }
  }

  morph::Communicator& Comm(const char* what) {
    TORCH_CHECK_WITH(DistBackendError, valid_.load(), "morph backend: ", what, " on ",
                     name_, ", a process group of an earlier generation (after a change use "
                     "step.groups, rebuilt at the change)");
    TORCH_CHECK(std::this_thread::get_id() == owner_, "morph backend: ", what, " on ", name_,
                " from a thread other than the step loop's: a group's collectives come from "
                "the thread that runs the steps, in the same order on every rank (give another "
                "thread a group of its own: dist.new_group)");
    return *comm_;
  }

  c10::intrusive_ptr<c10d::Work> Begin(OpType type, CollectiveOp op, std::vector<at::Tensor> outs,
                                       std::function<void()> finish, const char* what,
                                       std::vector<at::Tensor> inputs = {}) {
    TORCH_CHECK(!coalescing_ || type == OpType::COALESCED,
                "morph backend: only send and recv may be coalesced (batch_isend_irecv)");
    std::chrono::milliseconds timeout = op.timeout;
    morph::Communicator& comm = Comm(what);
    in_flight_->Reap();
    morph::StatusOr<std::unique_ptr<morph::Work>> w = comm.Start(std::move(op));
    if (!w.ok()) Fail(w.status(), what);
    auto p = std::make_shared<Pending>(std::move(*w), std::move(outs), std::move(finish), timeout,
                                       std::string(what) + " on " + name_, std::move(inputs));
    in_flight_->Add(p);
    return c10::make_intrusive<MorphWork>(type, std::move(p), in_flight_, completer_);
  }

  // Sends and receives that progress together (none: a completed Work).
  c10::intrusive_ptr<c10d::Work> Exchange(OpType type, std::vector<morph::P2POp> ops,
                                          std::vector<at::Tensor> keep,
                                          std::chrono::milliseconds timeout, const char* what) {
    if (ops.empty()) return Completed(type, std::move(keep));
    return Begin(type, CollectiveOp::SendRecv(std::move(ops), timeout), std::move(keep), nullptr,
                 what);
  }

  c10::intrusive_ptr<c10d::Work> PointToPoint(morph::P2POp::Kind kind,
                                              std::vector<at::Tensor>& tensors, int peer,
                                              OpType type) {
    TORCH_CHECK(tensors.size() == 1, "morph backend: send/recv of one tensor");
    at::Tensor t = tensors[0];
    CheckTensor(t, kind == morph::P2POp::Kind::kSend ? "send's tensor" : "recv's tensor");
    morph::P2POp p{kind, peer, t.data_ptr(), static_cast<size_t>(t.nbytes())};
    if (coalescing_) {
      pending_.push_back(p);
      pending_tensors_.push_back(t);
      return Completed(type, {t});  // endCoalescing's Work completes it
    }
    return Exchange(type, {p}, {t}, timeout_, kind == morph::P2POp::Kind::kSend ? "send" : "recv");
  }

  // The last of several started ops: the communicator runs them in order, so waiting for the
  // last waits for all (each one's error is also the communicator's, hence the last's).
  c10::intrusive_ptr<c10d::Work> Chain(c10::intrusive_ptr<c10d::Work> last,
                                       std::vector<at::Tensor>& tensors) {
    if (!last) return Completed(OpType::COALESCED, tensors);
    return last;
  }

  // A Work with nothing to wait for (no op, or one another Work completes).
  c10::intrusive_ptr<c10d::Work> Completed(OpType type, std::vector<at::Tensor> tensors) {
    auto p = std::make_shared<Pending>(nullptr, std::move(tensors), nullptr,
                                       std::chrono::milliseconds(0), "completed",
                                       std::vector<at::Tensor>{});
    return c10::make_intrusive<MorphWork>(type, std::move(p), nullptr, completer_);
  }

  // The generation's communicator, shared with the runtime: once the generation is over it is
  // aborted (every op raises), never freed under this backend. The Python layer invalidates the
  // backend when it destroys the generation's groups (a clearer error than the abort's).
  std::shared_ptr<morph::Communicator> comm_;
  std::string name_;
  std::atomic<bool> valid_{true};
  const std::thread::id owner_;  // the step loop's thread, which built the groups
  std::shared_ptr<InFlight> in_flight_ = std::make_shared<InFlight>();
  std::shared_ptr<Completer> completer_ = std::make_shared<Completer>();
  std::chrono::milliseconds timeout_;
  bool coalescing_ = false;
  std::vector<morph::P2POp> pending_;
  std::vector<at::Tensor> pending_tensors_;
};

}  // namespace
}  // namespace morph_torch

PYBIND11_MODULE(_torch_backend, m) {
  using morph_torch::MorphBackend;
  m.doc() = "morph's torch.distributed backend (morph.distributed; docs/torch.md).";
  py::class_<MorphBackend, c10d::Backend, c10::intrusive_ptr<MorphBackend>>(m, "MorphBackend")
      .def("invalidate", &MorphBackend::invalidate,
           "Later calls raise: the generation's communicator is no longer this group's.")
      .def_property_readonly("valid", &MorphBackend::valid);
  m.def(
      "create",
      [](py::capsule comm, const std::string& name, int64_t timeout_ms) {
        return c10::make_intrusive<MorphBackend>(
            morph_torch::SharedFromCapsule<morph::Communicator>(comm, "morph.Communicator"), name,
            std::chrono::milliseconds(timeout_ms));
      },
      py::arg("communicator"), py::arg("name"), py::arg("timeout_ms"),
      "A backend over a generation's morph communicator (morph._morph.Communicator._capsule()).");
  morph_torch::BindStore(m);
}
