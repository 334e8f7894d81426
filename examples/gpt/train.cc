// gpt: an elastic byte-level GPT trained with morph (examples/gpt/README.md).
//
// Data x tensor x pipeline parallel with ZeRO-1 Adam, every tensor (parameters and both Adam
// moments) registered in morph's State, so that a reconfiguration (grow, shrink, preemption,
// a failed worker) moves it; the global batch and the sample order come from the runtime, so the
// loss curve does not depend on the allocation except for the order of float sums.
//
//   morphrun -n 4 -- gpt --steps 300 --out /tmp/gpt
//   mpirun --enable-recovery -np 4 gpt --steps 300 --out /tmp/gpt
//
// Per step on each rank: GPipe over the step's micro-batches (all forwards, then all backwards
// in reverse; activations and their gradients go between stages over step.pp()), the TP
// allreduces inside each layer (model.cc), one DP reduce-scatter of every gradient (each rank
// gets the sums for its ZeRO ranges), the loss summed over the world, then Adam on
// this rank's ZeRO range of each tensor and one DP allgather of the updated parameter ranges,
// then the commit vote (CommitUpdate) and the local writes into the state.
//
// World rank 0 appends one line per step to OUT/metrics.tsv and one per reconfiguration to
// OUT/events.tsv, and prints a progress line; every worker keeps OUT/pids/<pid> while it runs,
// and touches it at every step it trains (a standby spare's stays old).
// --check-dir DIR (tests): every worker saves its shards each step in the layout-free
// checkpoint format, and after each reconfiguration compares its new shards, bitwise, with the
// checkpoint of that step read into the new configuration.
//
// Exit codes: 0 done (or left the job), 2 usage, 3 a check failed, 4 runtime error.
#include <glog/logging.h>
#include <morph/morph.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "device.h"
#include "model.h"

namespace {

namespace fs = std::filesystem;
using morph::DType;
using morph::Layout;
using morph::Status;
using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kTimeout{60000};

struct Args {
  int64_t steps = 200;
  std::string out = ".";
  std::string data = "/usr/share/games/fortunes";
  std::string check_dir;
  uint64_t seed = 1234;
  int64_t global_batch = 16;
  int64_t micro_batch = 2;
  float lr = 2e-3f;
  int64_t device_memory = 0;
  int zero_group = 0;  // Adam moments: 0 plain ZeRO over DP, g > 0 hybrid (dp / g replicas)
  std::vector<int> tp_candidates = {1, 2};
  std::vector<int> pp_candidates = {1, 2};
  gpt::Dims dims;
  bool quiet = false;
  // --backend: the step communicators' (Options::backend); this build's default: NCCL where the
  // state lives on the GPU (gpt_nccl), else what MORPH_BACKEND says (gloo).
  std::string backend;
};

int Fail(int code, const std::string& why) {
  std::fprintf(stderr, "gpt %d: %s\n", getpid(), why.c_str());
  std::fflush(stderr);
  return code;
}

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::atoi(x.c_str()));
  return v;
}

// The corpus: every text file of the fortunes package, concatenated in name order.
std::string LoadCorpus(const std::string& dir, std::string* error) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
    files.push_back(e.path());
  }
  if (ec) {
    *error = "cannot read " + dir + ": " + ec.message() + " (apt-get install fortunes-min)";
    return "";
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const fs::path& p : files) {
    std::ifstream in(p, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), {});
  }
  if (text.size() < 4096) {
    *error = "corpus under " + dir + " has only " + std::to_string(text.size()) + " bytes";
  }
  return text;
}

// One registered parameter and its two Adam moments.
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  Layout layout;
  float init_std = 0;  // 0: ones (norm gains)
  int layer = 0;
  // This step's views (looked up after BeginStep) and the offset of its gradient.
  float* w = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  // CUDA state (gpt_nccl): w/m/v point into these host copies of the shards at dw/dm/dv,
  // refreshed at Bind and written back after the update.
  float *dw = nullptr, *dm = nullptr, *dv = nullptr;
  std::vector<float> hw = {}, hm = {}, hv = {};
  int64_t n = 0;  // TP-local elements
  int64_t zero_begin = 0, zero_end = 0;
  int64_t grad_offset = 0;
  const morph::TensorSpec* spec = nullptr;
};

std::vector<Param> DefineParams(const gpt::Dims& d) {
  const int64_t D = d.d_model, F = d.ffn(), V = d.vocab, T = d.seq;
  const float std0 = 0.02f, std_out = 0.02f / std::sqrt(2.f * d.layers);
  std::vector<Param> p;
  p.push_back({"embed.tok", {V, D}, Layout::Layer(0), std0, 0});
  p.push_back({"embed.pos", {T, D}, Layout::Layer(0), std0, 0});
  for (int l = 0; l < d.layers; ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    p.push_back({pre + "ln1", {D}, Layout::Layer(l), 0, l});
    p.push_back({pre + "qkv", {3 * D, D}, Layout::Layer(l).SplitTPBlocks(0, 3), std0, l});
    p.push_back({pre + "proj", {D, D}, Layout::Layer(l).SplitTP(1), std_out, l});
    p.push_back({pre + "ln2", {D}, Layout::Layer(l), 0, l});
    p.push_back({pre + "up", {F, D}, Layout::Layer(l).SplitTP(0), std0, l});
    p.push_back({pre + "down", {D, F}, Layout::Layer(l).SplitTP(1), std_out, l});
  }
  p.push_back({"head.ln", {D}, Layout::Layer(d.layers - 1), 0, d.layers - 1});
  p.push_back({"head.out", {V, D}, Layout::Layer(d.layers - 1), std0, d.layers - 1});
  return p;
}

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// N(0, 1) as a pure function of (seed, tensor, global element): the same in every layout.
float Normal(uint64_t seed, uint64_t tensor, uint64_t element) {
  uint64_t a = Mix(seed ^ Mix(tensor * 0x100000001b3ULL ^ Mix(element)));
  uint64_t b = Mix(a);
  double u1 = (static_cast<double>(a >> 11) + 0.5) / 9007199254740992.0;
  double u2 = static_cast<double>(b >> 11) / 9007199254740992.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * M_PI * u2));
}

// Global linear index of every local element of a shard (planning view: row-major order is
// the tensor's own).
template <typename Fn>
void ForEachGlobal(const morph::Shard& s, const std::vector<int64_t>& shape, Fn fn) {
  const int rank = s.frame.rank();
  std::vector<int64_t> extent(rank);
  for (int d = 0; d < rank; ++d) extent[d] = s.frame.dim(d).size();
  for (int64_t j = 0; j < s.NumElements(); ++j) {
    int64_t rest = s.flat_begin + j, global = 0, mul = 1;
    for (int d = rank - 1; d >= 0; --d) {
      global += (rest % extent[d] + s.frame.dim(d).begin) * mul;
      rest /= extent[d];
      mul *= shape[d];
    }
    fn(j, global);
  }
}

// One operation's buffers in its communicator's memory: the host buffers themselves (Gloo), or
// device copies (NCCL moves device memory only: MORPH_BACKEND=nccl, gpt_nccl), copied in before
// the operation and out after it. The math stays on the host buffers either way.
class CommMemory {
 public:
  explicit CommMemory(const morph::Communicator& c) : device_(!c.capabilities().host_memory) {}
  // What to hand the communicator for `bytes` at `host`: `in` copies them there now, `out`
  // copies them back in Done().
  morph::StatusOr<void*> Use(void* host, size_t bytes, bool in, bool out) {
    if (!device_ || bytes == 0) return host;
    MORPH_ASSIGN_OR_RETURN(void* dev, gpt::DeviceScratch(next_slot_++, bytes));
    if (in) {
      MORPH_RETURN_IF_ERROR(gpt::Copy(dev, host, bytes));
    }
    if (out) outs_.push_back({host, dev, bytes});
    return dev;
  }
  // After the operation succeeded.
  Status Done() {
    for (const Out& o : outs_) {
      MORPH_RETURN_IF_ERROR(gpt::Copy(o.host, o.dev, o.bytes));
    }
    outs_.clear();
    return Status::Ok();
  }

 private:
  struct Out {
    void* host;
    void* dev;
    size_t bytes;
  };
  bool device_;
  int next_slot_ = 0;
  std::vector<Out> outs_;
};

// In-place allreduce (sum) of host buffer `data` over `c`, in the communicator's memory.
template <typename T>
Status AllreduceSum(morph::Communicator& c, T* data, size_t count, DType dtype) {
  CommMemory mem(c);
  MORPH_ASSIGN_OR_RETURN(void* buf, mem.Use(data, count * sizeof(T), true, true));
  MORPH_RETURN_IF_ERROR(c.Allreduce(buf, count, dtype, morph::ReduceOp::kSum, kTimeout));
  return mem.Done();
}

struct Comm {
  morph::Communicator* c;
  Status* status;
};
bool TpAllreduce(void* ctx, float* data, int64_t count) {
  Comm* cm = static_cast<Comm*>(ctx);
  *cm->status = AllreduceSum(*cm->c, data, static_cast<size_t>(count), DType::kF32);
  return cm->status->ok();
}

Status PpTransfer(morph::Communicator& pp, bool send, int peer, float* data, int64_t count) {
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  CommMemory mem(pp);
  MORPH_ASSIGN_OR_RETURN(void* buf, mem.Use(data, bytes, send, !send));
  morph::P2POp op{send ? morph::P2POp::Kind::kSend : morph::P2POp::Kind::kRecv, peer, buf, bytes};
  MORPH_RETURN_IF_ERROR(pp.SendRecv({op}, kTimeout));
  return mem.Done();
}

void AppendLine(const std::string& path, const std::string& line) {
  std::ofstream f(path, std::ios::app);
  f << line << "\n";
}

class Trainer {
 public:
  Trainer(Args a, std::string corpus)
      : a_(std::move(a)), corpus_(std::move(corpus)), zero_group_(a_.zero_group) {
    params_ = DefineParams(a_.dims);
    for (size_t k = 0; k < params_.size(); ++k) index_[params_[k].name] = k;
    stride_ = a_.dims.seq / 2;
  }
  int64_t dataset_samples() const {
    return (static_cast<int64_t>(corpus_.size()) - a_.dims.seq - 1) / stride_;
  }
  std::vector<Param>& params() { return params_; }

  Status Declare(morph::State& s) {
    for (const Param& p : params_) {
      const morph::MemoryKind mem = gpt::StateMemory();
      MORPH_RETURN_IF_ERROR(s.AddTensor(p.name, p.shape, DType::kF32, p.layout, mem));
      MORPH_RETURN_IF_ERROR(s.AddTensor(p.name + ".adam_m", p.shape, DType::kF32,
                                        p.layout.ZeroShard(zero_group_), mem));
      MORPH_RETURN_IF_ERROR(s.AddTensor(p.name + ".adam_v", p.shape, DType::kF32,
                                        p.layout.ZeroShard(zero_group_), mem));
    }
    return s.AddScalar("tokens", sizeof(int64_t));
  }

  // Looks every tensor up (after BeginStep: a change replaced the shards).
  Status Bind(morph::State& s) {
    int64_t off = 0;
    for (size_t k = 0; k < params_.size(); ++k) {
      Param& p = params_[k];
      MORPH_ASSIGN_OR_RETURN(morph::State::TensorRef w, s.tensor(p.name));
      MORPH_ASSIGN_OR_RETURN(morph::State::TensorRef m, s.tensor(p.name + ".adam_m"));
      MORPH_ASSIGN_OR_RETURN(morph::State::TensorRef v, s.tensor(p.name + ".adam_v"));
      p.spec = w.spec;
      p.w = static_cast<float*>(w.data.data);
      p.m = static_cast<float*>(m.data.data);
      p.v = static_cast<float*>(v.data.data);
      p.n = w.shard.NumElements();
      if (device_state_) {
        const int64_t nm = std::max<int64_t>(m.shard.NumElements(), 0);
        p.dw = p.w;
        p.dm = p.m;
        p.dv = p.v;
        p.hw.resize(static_cast<size_t>(p.n));
        p.hm.resize(static_cast<size_t>(nm));
        p.hv.resize(static_cast<size_t>(nm));
        MORPH_RETURN_IF_ERROR(gpt::Copy(p.hw.data(), p.dw, p.hw.size() * sizeof(float)));
        MORPH_RETURN_IF_ERROR(gpt::Copy(p.hm.data(), p.dm, p.hm.size() * sizeof(float)));
        MORPH_RETURN_IF_ERROR(gpt::Copy(p.hv.data(), p.dv, p.hv.size() * sizeof(float)));
        p.w = p.hw.data();
        p.m = p.hm.data();
        p.v = p.hv.data();
      }
      p.zero_begin = m.shard.flat_begin;
      p.zero_end = std::max(m.shard.flat_begin, m.shard.flat_end);
      if (p.n > 0 && !(m.shard.frame == w.shard.frame)) {
        return morph::InternalError("tensor " + p.name + ": moment frame differs from the param's");
      }
      p.grad_offset = off;
      off += p.n;
    }
    grads_.assign(static_cast<size_t>(off), 0.f);
    return Status::Ok();
  }

  Status Init(morph::State& s) {
    for (size_t k = 0; k < params_.size(); ++k) {
      Param& p = params_[k];
      auto t = s.tensor(p.name);
      if (!t.ok() || t->shard.empty()) continue;
      std::vector<float> w(static_cast<size_t>(t->shard.NumElements()));
      std::vector<int64_t> shape = morph::PlanShape(*t->spec);
      ForEachGlobal(t->shard, shape, [&](int64_t j, int64_t g) {
        w[j] = p.init_std == 0 ? 1.f : p.init_std * Normal(a_.seed, k, g);
      });
      MORPH_RETURN_IF_ERROR(gpt::Copy(t->data.data, w.data(), w.size() * sizeof(float)));
    }
    return Status::Ok();
  }

  // One training step; the loss (mean over the global batch's tokens) in *loss.
  Status Train(morph::Runtime& rt, const morph::Step& step, double* loss) {
    const gpt::Dims& d = a_.dims;
    const morph::ParallelConfig& cfg = step.config();
    const auto coords = step.coords();
    const int stage = coords.p, pp = cfg.pp, tp = cfg.tp, dp = cfg.dp;
    const bool first = stage == 0, last = stage == pp - 1;
    const int D = d.d_model, T = d.seq, V = d.vocab;
    std::vector<int> my_layers;
    for (int l = 0; l < d.layers; ++l) {
      if (cfg.stage_of_layer[l] == stage) my_layers.push_back(l);
    }
    auto find = [&](const std::string& name) -> Param& { return params_[index_.at(name)]; };
    std::vector<gpt::LayerWeights> lw;
    std::vector<gpt::LayerGrads> lg;
    for (int l : my_layers) {
      const std::string pre = "layers." + std::to_string(l) + ".";
      Param *ln1 = &find(pre + "ln1"), *qkv = &find(pre + "qkv"), *proj = &find(pre + "proj"),
            *ln2 = &find(pre + "ln2"), *up = &find(pre + "up"), *down = &find(pre + "down");
      float* g = grads_.data();
      lw.push_back({ln1->w, qkv->w, proj->w, ln2->w, up->w, down->w});
      lg.push_back({g + ln1->grad_offset, g + qkv->grad_offset, g + proj->grad_offset,
                    g + ln2->grad_offset, g + up->grad_offset, g + down->grad_offset});
    }
    gpt::Layer layer(d, tp);
    Status tp_status;
    Comm tp_comm{&step.tp(), &tp_status};
    const float scale = 1.f / static_cast<float>(step.global_batch() * T);
    const auto& mbs = step.batch().micro_batches;
    const int nm = static_cast<int>(mbs.size());
    std::vector<std::vector<gpt::LayerCache>> caches(nm, std::vector<gpt::LayerCache>(lw.size()));
    std::vector<std::vector<float>> head_h(nm), head_r(nm), head_x(nm), dlogits(nm);
    std::vector<std::vector<int>> tokens(nm);
    double loss_sum = 0;
    std::vector<float> act, next;
    // Forward, micro-batch by micro-batch.
    for (int mb = 0; mb < nm; ++mb) {
      const int ns = static_cast<int>(mbs[mb].size());
      const int N = ns * T;
      tokens[mb].resize(static_cast<size_t>(N) + N);  // inputs, then targets
      for (int b = 0; b < ns; ++b) {
        const int64_t off = (mbs[mb][b] * stride_) % (static_cast<int64_t>(corpus_.size()) - T - 1);
        for (int i = 0; i < T; ++i) {
          tokens[mb][b * T + i] = static_cast<unsigned char>(corpus_[off + i]);
          tokens[mb][N + b * T + i] = static_cast<unsigned char>(corpus_[off + i + 1]);
        }
      }
      act.assign(static_cast<size_t>(N) * D, 0.f);
      if (first) {
        const float* tok = find("embed.tok").w;
        const float* pos = find("embed.pos").w;
        for (int i = 0; i < N; ++i) {
          for (int j = 0; j < D; ++j) {
            act[static_cast<size_t>(i) * D + j] =
                tok[static_cast<int64_t>(tokens[mb][i]) * D + j] + pos[(i % T) * D + j];
          }
        }
      } else {
        MORPH_RETURN_IF_ERROR(PpTransfer(step.pp(), false, stage - 1, act.data(), act.size()));
      }
      next.resize(act.size());
      for (size_t i = 0; i < lw.size(); ++i) {
        if (!layer.Forward(lw[i], ns, act.data(), next.data(), caches[mb][i], &TpAllreduce,
                           &tp_comm)) {
          return tp_status;
        }
        act.swap(next);
      }
      if (!last) {
        MORPH_RETURN_IF_ERROR(PpTransfer(step.pp(), true, stage + 1, act.data(), act.size()));
        continue;
      }
      Param& hln = find("head.ln");
      Param& hout = find("head.out");
      head_x[mb] = act;
      head_h[mb].resize(act.size());
      head_r[mb].resize(N);
      gpt::RmsNormForward(N, D, act.data(), hln.w, head_h[mb].data(), head_r[mb].data());
      std::vector<float> logits(static_cast<size_t>(N) * V);
      gpt::Gemm(false, true, N, V, D, 1.f, head_h[mb].data(), D, hout.w, D, 0.f, logits.data(), V);
      dlogits[mb].resize(logits.size());
      loss_sum +=
          gpt::CrossEntropy(N, V, logits.data(), tokens[mb].data() + N, scale, dlogits[mb].data());
    }
    // Backward, in reverse micro-batch order.
    std::vector<float> grad, dx;
    for (int mb = nm - 1; mb >= 0; --mb) {
      const int ns = static_cast<int>(mbs[mb].size());
      const int N = ns * T;
      grad.assign(static_cast<size_t>(N) * D, 0.f);
      if (last) {
        Param& hln = find("head.ln");
        Param& hout = find("head.out");
        std::vector<float> dh(static_cast<size_t>(N) * D);
        gpt::Gemm(true, false, V, D, N, 1.f, dlogits[mb].data(), V, head_h[mb].data(), D, 1.f,
                  grads_.data() + hout.grad_offset, D);
        gpt::Gemm(false, false, N, D, V, 1.f, dlogits[mb].data(), V, hout.w, D, 0.f, dh.data(), D);
        gpt::RmsNormBackward(N, D, head_x[mb].data(), hln.w, head_r[mb].data(), dh.data(),
                             grad.data(), grads_.data() + hln.grad_offset, false);
      } else {
        MORPH_RETURN_IF_ERROR(PpTransfer(step.pp(), false, stage + 1, grad.data(), grad.size()));
      }
      dx.resize(grad.size());
      for (int i = static_cast<int>(lw.size()) - 1; i >= 0; --i) {
        if (!layer.Backward(lw[i], lg[i], ns, caches[mb][i], grad.data(), dx.data(), &TpAllreduce,
                            &tp_comm)) {
          return tp_status;
        }
        grad.swap(dx);
      }
      if (!first) {
        MORPH_RETURN_IF_ERROR(PpTransfer(step.pp(), true, stage - 1, grad.data(), grad.size()));
        continue;
      }
      float* gtok = grads_.data() + find("embed.tok").grad_offset;
      float* gpos = grads_.data() + find("embed.pos").grad_offset;
      for (int i = 0; i < N; ++i) {
        for (int j = 0; j < D; ++j) {
          float gv = grad[static_cast<size_t>(i) * D + j];
          gtok[static_cast<int64_t>(tokens[mb][i]) * D + j] += gv;
          gpos[(i % T) * D + j] += gv;
        }
      }
    }
    // Data parallel, ZeRO-style: one reduce-scatter over the DP group leaves each rank the sum
    // of the gradients of its own ZeRO range of every tensor (the slot: per tensor, a chunk of
    // ceil(n / dp) elements, the last ranks' chunks short or empty, padded with zeros).
    int64_t slot = 0;
    // Hybrid ZeRO (--zero-group g): g ranges, DP rank r holds range r % g; plain: g = dp.
    const int groups = zero_group_ > 0 ? zero_group_ : dp;
    auto range = [&](const Param& p, int r, int64_t* b, int64_t* e) {
      const int64_t chunk = (p.n + groups - 1) / groups, i = r % groups;
      *b = std::min(i * chunk, p.n);
      *e = std::min((i + 1) * chunk, p.n);
    };
    for (const Param& p : params_) slot += (p.n + groups - 1) / groups;
    std::vector<float> reduced;  // this rank's slot, summed over DP
    // Hybrid ZeRO: replicas of a range must stay bitwise equal (a recovery takes any of them),
    // but a ring reduce-scatter sums each block in another order; an allreduce gives every rank
    // the same sums.
    const bool scatter = groups == dp;
    if (dp > 1 && !scatter && !grads_.empty()) {
      MORPH_RETURN_IF_ERROR(AllreduceSum(step.dp(), grads_.data(), grads_.size(), DType::kF32));
    }
    if (dp > 1 && scatter && slot > 0) {
      std::vector<float> send(static_cast<size_t>(slot) * dp, 0.f);
      int64_t off = 0;
      for (const Param& p : params_) {
        const float* g = grads_.data() + p.grad_offset;
        for (int r = 0; r < dp; ++r) {  // block r: the range DP rank r updates
          int64_t b, e;
          range(p, r, &b, &e);
          std::copy(g + b, g + e, send.data() + r * slot + off);
        }
        off += (p.n + groups - 1) / groups;
      }
      reduced.resize(static_cast<size_t>(slot));
      CommMemory mem(step.dp());
      MORPH_ASSIGN_OR_RETURN(void* in, mem.Use(send.data(), send.size() * 4, true, false));
      MORPH_ASSIGN_OR_RETURN(void* out, mem.Use(reduced.data(), reduced.size() * 4, false, true));
      MORPH_RETURN_IF_ERROR(step.dp().ReduceScatter(in, out, static_cast<size_t>(slot), DType::kF32,
                                                    morph::ReduceOp::kSum, kTimeout));
      MORPH_RETURN_IF_ERROR(mem.Done());
    }
    double l = (last && coords.t == 0) ? loss_sum : 0.0;
    MORPH_RETURN_IF_ERROR(AllreduceSum(step.world(), &l, 1, DType::kF64));
    *loss = l / static_cast<double>(step.global_batch() * T);

    // The update, as a transaction: Adam on this rank's ZeRO range into scratch (new moments
    // in `mv`, new parameter values in `mine`, laid out as the allgather's slot), the DP
    // allgather of the new ranges, the commit vote (CommitUpdate), and only then the local
    // writes into the state. A collective that fails (a peer died) thus always leaves the state
    // at the step's values, which the recovery can use; a vote that completed on some ranks
    // only is settled by the recovery (CommitUpdate then returns OK here too, and the update is
    // applied: every rank had voted). No communication happens after CommitUpdate.
    const int64_t t = step.index() + 1;
    const float warm = std::min(1.f, static_cast<float>(t) / 20.f);
    const float lr = a_.lr * warm, b1 = 0.9f, b2 = 0.99f, eps = 1e-8f;
    const float c1 = 1.f - std::pow(b1, static_cast<float>(t));
    const float c2 = 1.f - std::pow(b2, static_cast<float>(t));
    std::vector<float> mine(static_cast<size_t>(slot), 0.f), mv(static_cast<size_t>(slot) * 2);
    int64_t goff = 0;
    for (Param& p : params_) {
      const int64_t chunk = (p.n + groups - 1) / groups;
      int64_t want_b, want_e;
      range(p, coords.d, &want_b, &want_e);
      if (p.zero_begin != want_b || p.zero_end != want_e) {
        return morph::InternalError("tensor " + p.name + ": ZeRO range [" +
                                    std::to_string(p.zero_begin) + ", " +
                                    std::to_string(p.zero_end) + "), the slot's [" +
                                    std::to_string(want_b) + ", " + std::to_string(want_e) + ")");
      }
      // This rank's summed gradient of its range: the reduce-scatter's slot, or the allreduced
      // gradient (hybrid ZeRO, dp = 1).
      const float* g =
          dp > 1 && scatter ? reduced.data() + goff : grads_.data() + p.grad_offset + p.zero_begin;
      for (int64_t j = 0; j < p.zero_end - p.zero_begin; ++j) {
        const float m = b1 * p.m[j] + (1 - b1) * g[j];
        const float v = b2 * p.v[j] + (1 - b2) * g[j] * g[j];
        mv[2 * (goff + j)] = m;
        mv[2 * (goff + j) + 1] = v;
        mine[goff + j] = p.w[p.zero_begin + j] - lr * (m / c1) / (std::sqrt(v / c2) + eps);
      }
      goff += chunk;
    }
    std::vector<float> all;
    if (dp > 1 && slot > 0) {
      all.resize(static_cast<size_t>(slot) * dp);
      CommMemory mem(step.dp());
      MORPH_ASSIGN_OR_RETURN(void* in, mem.Use(mine.data(), mine.size() * 4, true, false));
      MORPH_ASSIGN_OR_RETURN(void* out, mem.Use(all.data(), all.size() * 4, false, true));
      MORPH_RETURN_IF_ERROR(step.dp().Allgather(in, out, mine.size(), DType::kF32, kTimeout));
      MORPH_RETURN_IF_ERROR(mem.Done());
    }
    MORPH_RETURN_IF_ERROR(rt.CommitUpdate());
    int64_t off = 0;
    for (Param& p : params_) {
      const int64_t chunk = (p.n + groups - 1) / groups;
      for (int64_t j = 0; j < p.zero_end - p.zero_begin; ++j) {
        p.m[j] = mv[2 * (off + j)];
        p.v[j] = mv[2 * (off + j) + 1];
      }
      if (dp == 1) {
        std::copy(mine.data() + off, mine.data() + off + p.n, p.w);
      } else {
        for (int r = 0; r < dp; ++r) {  // replicas of a range write the same values
          int64_t b, e;
          range(p, r, &b, &e);
          std::copy(all.data() + r * slot + off, all.data() + r * slot + off + (e - b), p.w + b);
        }
      }
      off += chunk;
    }
    if (device_state_) {  // the host copies' new values into the state
      for (Param& p : params_) {
        MORPH_RETURN_IF_ERROR(gpt::Copy(p.dw, p.hw.data(), p.hw.size() * sizeof(float)));
        MORPH_RETURN_IF_ERROR(gpt::Copy(p.dm, p.hm.data(), p.hm.size() * sizeof(float)));
        MORPH_RETURN_IF_ERROR(gpt::Copy(p.dv, p.hv.data(), p.hv.size() * sizeof(float)));
      }
    }
    return Status::Ok();
  }

 private:
  Args a_;
  std::string corpus_;
  int zero_group_ = 0;
  bool device_state_ = gpt::StateMemory() == morph::MemoryKind::kCuda;
  int64_t stride_ = 32;
  std::vector<Param> params_;
  std::map<std::string, size_t> index_;
  std::vector<float> grads_;
};

// --check-dir: this rank's part of a checkpoint of the state at step `at` (every rank's parts
// together hold each tensor once).
Status SaveCheck(morph::State& s, const morph::Step& step, const std::string& dir, int64_t at) {
  return morph::SaveCheckpoint(dir + "/step-" + std::to_string(at), s, step);
}

// After a change at step S: every shard equals, bitwise, the step-S checkpoint read into the
// new configuration. kDataLoss naming the tensor and element otherwise.
Status CompareCheck(morph::State& s, const std::string& dir, int64_t at, int* compared) {
  const std::string ckpt = dir + "/step-" + std::to_string(at);
  for (const morph::TensorSpec& spec : s.tensors()) {
    MORPH_ASSIGN_OR_RETURN(morph::State::TensorRef t, s.tensor(spec.name));
    if (t.shard.empty()) continue;
    std::vector<float> want(static_cast<size_t>(t.shard.NumElements()));
    MORPH_RETURN_IF_ERROR(morph::ReadCheckpointShard(
        ckpt, s, spec.name, morph::BufferView{want.data(), want.size() * 4}));
    if (std::memcmp(want.data(), t.data.data, want.size() * 4) != 0) {
      const float* got = static_cast<const float*>(t.data.data);
      size_t i = 0;
      while (std::memcmp(&want[i], &got[i], 4) == 0) ++i;
      char vals[96];
      std::snprintf(vals, sizeof vals, " is %.9g, the checkpoint says %.9g", got[i], want[i]);
      return morph::DataLossError("step " + std::to_string(at) + ": tensor " + spec.name +
                                  " local element " + std::to_string(i) + vals);
    }
    ++*compared;
  }
  return Status::Ok();
}

std::string Phases(const morph::Reconfiguration& r) {
  char b[256];
  std::snprintf(b, sizeof b, "%.1f\t%.1f\t%.1f\t%.1f\t%.1f", r.communicators_seconds * 1e3,
                r.plan_seconds * 1e3, r.transfer_seconds * 1e3, r.resume_seconds * 1e3,
                r.stall_seconds * 1e3);
  return b;
}

std::string Cfg(const morph::ParallelConfig& c) {
  return "dp" + std::to_string(c.dp) + "tp" + std::to_string(c.tp) + "pp" + std::to_string(c.pp);
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    if (f == "--quiet") {
      a.quiet = true;
      continue;
    }
    if (i + 1 >= argc) return Fail(2, "flag " + f + " needs a value");
    std::string v = argv[++i];
    if (f == "--steps")
      a.steps = std::atoll(v.c_str());
    else if (f == "--out")
      a.out = v;
    else if (f == "--data")
      a.data = v;
    else if (f == "--check-dir")
      a.check_dir = v;
    else if (f == "--seed")
      a.seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (f == "--global-batch")
      a.global_batch = std::atoll(v.c_str());
    else if (f == "--micro-batch")
      a.micro_batch = std::atoll(v.c_str());
    else if (f == "--lr")
      a.lr = std::strtof(v.c_str(), nullptr);
    else if (f == "--d-model")
      a.dims.d_model = std::atoi(v.c_str());
    else if (f == "--heads")
      a.dims.heads = std::atoi(v.c_str());
    else if (f == "--layers")
      a.dims.layers = std::atoi(v.c_str());
    else if (f == "--seq")
      a.dims.seq = std::atoi(v.c_str());
    else if (f == "--device-memory")
      a.device_memory = std::atoll(v.c_str());
    else if (f == "--zero-group")
      a.zero_group = std::atoi(v.c_str());
    else if (f == "--tp")
      a.tp_candidates = ParseList(v);
    else if (f == "--pp")
      a.pp_candidates = ParseList(v);
    else if (f == "--backend")
      a.backend = v;
    else
      return Fail(2, "unknown flag " + f);
  }
  if (a.steps < 1 || a.global_batch < 1 || a.micro_batch < 1 || a.dims.layers < 1 ||
      a.dims.heads < 1 || a.dims.d_model % a.dims.heads != 0 || a.dims.seq < 2) {
    return Fail(2, "bad sizes: need steps, batch, layers, heads >= 1, heads | d-model, seq >= 2");
  }
  for (int tp : a.tp_candidates) {
    if (tp < 1 || a.dims.heads % tp != 0)
      return Fail(2, "--tp " + std::to_string(tp) + " must divide the heads");
  }
  if (std::string why = gpt::InitStateMemory(); !why.empty()) return Fail(2, why);
  if (std::string why = gpt::InitGemm(); !why.empty()) return Fail(2, why);
  const bool device_state = gpt::StateMemory() == morph::MemoryKind::kCuda;
  if (device_state && !a.check_dir.empty()) {
    return Fail(2,
                "--check-dir: the layout-free checkpoint reads host memory; gpt_nccl keeps "
                "its state on the GPU");
  }
  std::string error;
  std::string corpus = LoadCorpus(a.data, &error);
  if (!error.empty()) return Fail(2, error);
  std::error_code ec;
  fs::create_directories(a.out + "/pids", ec);
  const std::string pid_file = a.out + "/pids/" + std::to_string(getpid());

  auto opts = morph::Options::FromEnv();
  if (!opts.ok()) return Fail(4, opts.status().ToString());
  if (a.backend.empty() && device_state && std::getenv("MORPH_BACKEND") == nullptr) {
    a.backend = "nccl";
  }
  if (!a.backend.empty()) {
    auto b = morph::ParseBackend("--backend", a.backend);
    if (!b.ok()) return Fail(2, b.status().ToString());
    opts->backend = *b;
  }
  if (opts->backend == morph::Backend::kNccl && !device_state) {
    return Fail(2,
                "--backend nccl: NCCL moves device memory and this build keeps its state in "
                "host memory; run gpt_nccl");
  }
  opts->model = {
      .num_layers = a.dims.layers,
      .num_heads = a.dims.heads,
      .tp_candidates = a.tp_candidates,
      .pp_candidates = a.pp_candidates,
      .global_batch = a.global_batch,
      .micro_batches = static_cast<int>(std::max<int64_t>(1, a.global_batch / a.micro_batch)),
      .zero_stage = 1,
      .device_memory_bytes = a.device_memory};
  Trainer trainer(a, std::move(corpus));
  opts->dataset_samples = trainer.dataset_samples();
  opts->dataset_seed = a.seed;
  opts->micro_batch = a.micro_batch;
  auto started = morph::Runtime::Start(*opts, [&](morph::State& s) { return trainer.Declare(s); });
  if (!started.ok()) return Fail(4, "Start: " + started.status().ToString());
  morph::Runtime& rt = **started;
  morph::State& state = rt.state();
  AppendLine(pid_file, std::to_string(rt.worker_id()));
  if (rt.fresh_start()) {
    if (Status st = trainer.Init(state); !st.ok()) return Fail(4, "Init: " + st.ToString());
  }

  const int64_t tokens_per_step = a.global_batch * a.dims.seq;
  auto last_end = Clock::now();
  int64_t last_trained = -2;  // the step this worker last began (none yet)
  int exit_code = 0;
  while (true) {
    auto step = rt.BeginStep();
    if (!step.ok()) {
      exit_code = Fail(4, "BeginStep: " + step.status().ToString());
      break;
    }
    if (step->done()) break;
    // A standby given a rank (or a joiner) times its first step from here, not from the last
    // step it trained before it waited as a spare.
    if (step->index() > last_trained + 1) last_end = Clock::now();
    last_trained = step->index();
    // Only a worker holding a rank trains: its pid file's time says so (a scheduler picking
    // "the newest pid file" as its victim then picks a member, never a standby spare).
    (void)utimensat(AT_FDCWD, pid_file.c_str(), nullptr, 0);
    const int64_t s = step->index();
    if (s >= a.steps) {
      (void)rt.EndStep();
      break;
    }
    Status st = trainer.Bind(state);
    if (!st.ok()) {
      exit_code = Fail(4, st.ToString());
      break;
    }
    if (step->reconfigured() && rt.last_reconfiguration()) {
      const morph::Reconfiguration& r = *rt.last_reconfiguration();
      int compared = -1;
      if (!a.check_dir.empty()) {
        compared = 0;
        st = CompareCheck(state, a.check_dir, r.step, &compared);
        if (r.recovery && st.code() == morph::StatusCode::kFailedPrecondition) {
          // The lost worker died before it finished saving that step: nothing to compare with
          // (events.tsv says 0 tensors; the loss check still covers the recovery).
          LOG(WARNING) << "check after the recovery at step " << r.step << " skipped: " << st;
          st = Status::Ok();
          compared = 0;
        }
        if (!st.ok()) {
          exit_code = Fail(3, "check after the change to generation " +
                                  std::to_string(r.generation) + ": " + st.ToString());
          break;
        }
      }
      if (step->rank() == 0) {
        std::ostringstream e;
        e << r.step << "\t" << r.from_generation << "\t" << r.generation << "\t"
          << r.old_config.world() << "\t" << r.config.world() << "\t" << Cfg(r.old_config) << "\t"
          << Cfg(r.config) << "\t" << (r.recovery ? 1 : 0) << "\t" << r.lost_steps() << "\t"
          << Phases(r) << "\t" << r.bytes_received << "\t" << compared;
        AppendLine(a.out + "/events.tsv", e.str());
        if (!a.quiet) {
          std::printf(
              "gpt: generation %ld -> %ld at step %ld: world %d -> %d, %s -> %s%s, "
              "communicators %.1f ms, plan %.1f ms, transfer %.1f ms, resume %.1f ms, "
              "stall %.1f ms\n",
              static_cast<long>(r.from_generation), static_cast<long>(r.generation),
              static_cast<long>(r.step), r.old_config.world(), r.config.world(),
              r.old_config.ToString().c_str(), r.config.ToString().c_str(),
              r.recovery ? " (recovery)" : "", r.communicators_seconds * 1e3, r.plan_seconds * 1e3,
              r.transfer_seconds * 1e3, r.resume_seconds * 1e3, r.stall_seconds * 1e3);
          std::fflush(stdout);
        }
      }
    }
    double loss = 0;
    st = trainer.Train(rt, *step, &loss);
    if (st.ok() && !a.check_dir.empty()) {
      Status saved = SaveCheck(state, *step, a.check_dir, s + 1);
      if (!saved.ok()) {
        exit_code =
            Fail(3, "check checkpoint of step " + std::to_string(s + 1) + ": " + saved.ToString());
        break;
      }
    }
    if (!st.ok()) {
      // A collective failed (a peer died or the change aborted it): the runtime recovers at the
      // next BeginStep, which returns the step to train again.
      LOG(WARNING) << "step " << s << " failed: " << st.ToString();
      Status ab = rt.AbortStep(st);
      if (!ab.ok()) {
        exit_code = Fail(4, "AbortStep: " + ab.ToString());
        break;
      }
      continue;
    }
    if (auto tok = state.scalar("tokens"); tok.ok()) {
      int64_t n = 0;
      std::memcpy(&n, tok->data(), sizeof n);
      n += tokens_per_step;
      std::memcpy(tok->data(), &n, sizeof n);
    }
    const auto now = Clock::now();
    const double secs = std::chrono::duration<double>(now - last_end).count();
    last_end = now;
    if (step->rank() == 0) {
      const morph::ParallelConfig& c = step->config();
      char line[256];
      std::snprintf(
          line, sizeof line, "%ld\t%.9f\t%d\t%d\t%d\t%d\t%ld\t%.2f\t%.0f\t%.3f",
          static_cast<long>(s), loss, c.world(), c.dp, c.tp, c.pp,
          static_cast<long>(step->generation()), secs * 1e3, tokens_per_step / secs,
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count());
      AppendLine(a.out + "/metrics.tsv", line);
      if (!a.quiet) {
        std::printf("gpt: step %ld loss %.4f %.0f tok/s world %d %s\n", static_cast<long>(s), loss,
                    tokens_per_step / secs, c.world(), c.ToString().c_str());
        std::fflush(stdout);
      }
      if (!a.check_dir.empty() && s >= 8) {
        fs::remove_all(a.check_dir + "/step-" + std::to_string(s - 7), ec);
      }
    }
    st = rt.EndStep();
    if (!st.ok()) {
      exit_code = Fail(4, "EndStep: " + st.ToString());
      break;
    }
  }
  Status f = rt.Finish();
  fs::remove(pid_file, ec);
  if (exit_code == 0 && !f.ok()) exit_code = Fail(4, "Finish: " + f.ToString());
  return exit_code;
}
