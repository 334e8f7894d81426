// The math of a small decoder-only transformer language model (GPT-style, pre-norm, RMSNorm,
// GELU MLP, learned positions, untied output head), for one tensor-parallel rank of one
// pipeline stage: forward and backward of the pieces the training program (train.cc) chains
// with its communicators. Megatron-style TP: the fused QKV and the MLP up projection are
// column-parallel (a rank holds the rows of its heads / hidden units), the attention output and
// the MLP down projection are row-parallel (a rank holds their columns and produces a partial
// sum that the caller allreduces over TP). Every matrix product goes through Gemm (OpenBLAS or
// cuBLAS, below).
//
// Weights are stored row-major as [out, in] (y = x W^T), as PyTorch and Megatron do.
// Not thread-safe; the training thread owns everything here.
#ifndef MORPH_EXAMPLES_GPT_MODEL_H_
#define MORPH_EXAMPLES_GPT_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

struct Dims {
  int vocab = 256;  // bytes
  int d_model = 64;
  int heads = 4;
  int layers = 4;
  int seq = 32;  // tokens per sample (the sample is seq + 1 bytes: inputs and targets)
  int ffn() const { return 4 * d_model; }
  int head_dim() const { return d_model / heads; }
};

// The matrix-product backend, chosen at link time: gemm_openblas.cc (OpenBLAS, one thread per
// process) or gemm_cublas.cc (cuBLAS-XT on the current GPU, host buffers). InitGemm returns ""
// when ready, else why not (no GPU); call it once before Gemm.
std::string InitGemm();
const char* GemmBackend();
// C[m,n] (+)= alpha * op(A) op(B), row-major; op = transpose when the flag is set.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);

// Pointers to one layer's local weights (this TP rank's slices) and their gradients.
struct LayerWeights {
  const float* ln1 = nullptr;   // [D]
  const float* qkv = nullptr;   // [3 * D/tp, D]: q rows, k rows, v rows of this rank's heads
  const float* proj = nullptr;  // [D, D/tp]: the columns of this rank's heads
  const float* ln2 = nullptr;   // [D]
  const float* up = nullptr;    // [F/tp, D]
  const float* down = nullptr;  // [D, F/tp]
};
struct LayerGrads {
  float* ln1 = nullptr;
  float* qkv = nullptr;
  float* proj = nullptr;
  float* ln2 = nullptr;
  float* up = nullptr;
  float* down = nullptr;
};

// What the forward pass of one layer keeps for its backward pass (one micro-batch).
struct LayerCache {
  std::vector<float> x, r1, h1, qkv, probs, ctx, x2, r2, h2, u, z;
};

// The allreduce over the TP group the layer needs (sum, in place); returns false on failure.
using TpAllreduce = bool (*)(void* ctx, float* data, int64_t count);

class Layer {
 public:
  Layer(const Dims& dims, int tp) : d_(dims), tp_(tp) {}
  // x: [n_seq * seq, D] in; out: the same, out of the layer. False when an allreduce failed.
  bool Forward(const LayerWeights& w, int n_seq, const float* x, float* out, LayerCache& cache,
               TpAllreduce allreduce, void* ctx) const;
  // dy: gradient w.r.t. the layer's output; dx: w.r.t. its input (may alias dy). Accumulates
  // into g.
  bool Backward(const LayerWeights& w, const LayerGrads& g, int n_seq, const LayerCache& cache,
                const float* dy, float* dx, TpAllreduce allreduce, void* ctx) const;

 private:
  Dims d_;
  int tp_;
};

// RMSNorm with a gain: h = x / rms(x) * g, row by row; r gets 1 / rms per row.
void RmsNormForward(int n, int d, const float* x, const float* g, float* h, float* r);
// dx (+)= d/dx, dg += d/dg, given dh.
void RmsNormBackward(int n, int d, const float* x, const float* g, const float* r, const float* dh,
                     float* dx, float* dg, bool accumulate_dx);

// Softmax cross entropy over `vocab` logits per row, targets[i] in [0, vocab). Returns the sum
// of the rows' losses; dlogits = (softmax - onehot) * scale.
double CrossEntropy(int n, int vocab, const float* logits, const int* targets, float scale,
                    float* dlogits);

}  // namespace gpt

#endif  // MORPH_EXAMPLES_GPT_MODEL_H_
