// The transformer's math (model.h): one layer's forward and backward on one TP rank, RMSNorm,
// cross entropy. Matrix products through Gemm (gemm_openblas.cc or gemm_cublas.cc).
#include "model.h"

#include <algorithm>
#include <cmath>

namespace gpt {

namespace {

constexpr float kEps = 1e-5f;
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)

float Gelu(float x) { return 0.5f * x * (1.f + std::tanh(kGeluC * (x + 0.044715f * x * x * x))); }
float GeluGrad(float x) {
  float t = std::tanh(kGeluC * (x + 0.044715f * x * x * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kGeluC * (1.f + 3.f * 0.044715f * x * x);
}

}  // namespace

void RmsNormForward(int n, int d, const float* x, const float* g, float* h, float* r) {
  for (int i = 0; i < n; ++i) {
    const float* xi = x + static_cast<int64_t>(i) * d;
    float ss = 0;
    for (int j = 0; j < d; ++j) ss += xi[j] * xi[j];
    float inv = 1.f / std::sqrt(ss / d + kEps);
    r[i] = inv;
    float* hi = h + static_cast<int64_t>(i) * d;
    for (int j = 0; j < d; ++j) hi[j] = xi[j] * inv * g[j];
  }
}

void RmsNormBackward(int n, int d, const float* x, const float* g, const float* r, const float* dh,
                     float* dx, float* dg, bool accumulate_dx) {
  for (int i = 0; i < n; ++i) {
    const int64_t o = static_cast<int64_t>(i) * d;
    float dot = 0;  // mean(dxhat * xhat)
    for (int j = 0; j < d; ++j) {
      float xhat = x[o + j] * r[i];
      dg[j] += dh[o + j] * xhat;
      dot += dh[o + j] * g[j] * xhat;
    }
    dot /= d;
    for (int j = 0; j < d; ++j) {
      float xhat = x[o + j] * r[i];
      float v = r[i] * (dh[o + j] * g[j] - xhat * dot);
      dx[o + j] = accumulate_dx ? dx[o + j] + v : v;
    }
  }
}

double CrossEntropy(int n, int vocab, const float* logits, const int* targets, float scale,
                    float* dlogits) {
  double total = 0;
  for (int i = 0; i < n; ++i) {
    const float* li = logits + static_cast<int64_t>(i) * vocab;
    float* di = dlogits + static_cast<int64_t>(i) * vocab;
    float mx = *std::max_element(li, li + vocab);
    float sum = 0;
    for (int j = 0; j < vocab; ++j) {
      di[j] = std::exp(li[j] - mx);
      sum += di[j];
    }
    total += std::log(sum) + mx - li[targets[i]];
    float inv = 1.f / sum;
    for (int j = 0; j < vocab; ++j) di[j] *= inv * scale;
    di[targets[i]] -= scale;
  }
  return total;
}

bool Layer::Forward(const LayerWeights& w, int n_seq, const float* x, float* out, LayerCache& c,
                    TpAllreduce allreduce, void* ctx) const {
  const int D = d_.d_model, T = d_.seq, hd = d_.head_dim();
  const int Dl = D / tp_, Hl = d_.heads / tp_, Fl = d_.ffn() / tp_;
  const int N = n_seq * T;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  c.x.assign(x, x + static_cast<int64_t>(N) * D);
  c.r1.resize(N);
  c.h1.resize(static_cast<size_t>(N) * D);
  RmsNormForward(N, D, x, w.ln1, c.h1.data(), c.r1.data());
  c.qkv.resize(static_cast<size_t>(N) * 3 * Dl);
  Gemm(false, true, N, 3 * Dl, D, 1.f, c.h1.data(), D, w.qkv, D, 0.f, c.qkv.data(), 3 * Dl);
  c.probs.resize(static_cast<size_t>(n_seq) * Hl * T * T);
  c.ctx.assign(static_cast<size_t>(N) * Dl, 0.f);
  for (int b = 0; b < n_seq; ++b) {
    for (int h = 0; h < Hl; ++h) {
      const float* q = c.qkv.data() + static_cast<int64_t>(b) * T * 3 * Dl + h * hd;
      const float* k = q + Dl;
      const float* v = q + 2 * Dl;
      float* p = c.probs.data() + (static_cast<int64_t>(b) * Hl + h) * T * T;
      Gemm(false, true, T, T, hd, scale, q, 3 * Dl, k, 3 * Dl, 0.f, p, T);
      for (int i = 0; i < T; ++i) {  // causal softmax
        float* pi = p + static_cast<int64_t>(i) * T;
        float mx = *std::max_element(pi, pi + i + 1);
        float sum = 0;
        for (int j = 0; j <= i; ++j) {
          pi[j] = std::exp(pi[j] - mx);
          sum += pi[j];
        }
        for (int j = 0; j <= i; ++j) pi[j] /= sum;
        for (int j = i + 1; j < T; ++j) pi[j] = 0.f;
      }
      float* o = c.ctx.data() + static_cast<int64_t>(b) * T * Dl + h * hd;
      Gemm(false, false, T, hd, T, 1.f, p, T, v, 3 * Dl, 0.f, o, Dl);
    }
  }
  // Row-parallel output projection: a partial sum over this rank's heads, then the TP allreduce.
  std::vector<float> a(static_cast<size_t>(N) * D);
  Gemm(false, true, N, D, Dl, 1.f, c.ctx.data(), Dl, w.proj, Dl, 0.f, a.data(), D);
  if (tp_ > 1 && !allreduce(ctx, a.data(), static_cast<int64_t>(N) * D)) return false;
  c.x2.resize(static_cast<size_t>(N) * D);
  for (size_t i = 0; i < c.x2.size(); ++i) c.x2[i] = x[i] + a[i];
  c.r2.resize(N);
  c.h2.resize(static_cast<size_t>(N) * D);
  RmsNormForward(N, D, c.x2.data(), w.ln2, c.h2.data(), c.r2.data());
  c.u.resize(static_cast<size_t>(N) * Fl);
  Gemm(false, true, N, Fl, D, 1.f, c.h2.data(), D, w.up, D, 0.f, c.u.data(), Fl);
  c.z.resize(c.u.size());
  for (size_t i = 0; i < c.u.size(); ++i) c.z[i] = Gelu(c.u[i]);
  Gemm(false, true, N, D, Fl, 1.f, c.z.data(), Fl, w.down, Fl, 0.f, out, D);
  if (tp_ > 1 && !allreduce(ctx, out, static_cast<int64_t>(N) * D)) return false;
  for (size_t i = 0; i < c.x2.size(); ++i) out[i] += c.x2[i];
  return true;
}

bool Layer::Backward(const LayerWeights& w, const LayerGrads& g, int n_seq, const LayerCache& c,
                     const float* dy, float* dx, TpAllreduce allreduce, void* ctx) const {
  const int D = d_.d_model, T = d_.seq, hd = d_.head_dim();
  const int Dl = D / tp_, Hl = d_.heads / tp_, Fl = d_.ffn() / tp_;
  const int N = n_seq * T;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const size_t nd = static_cast<size_t>(N) * D;
  std::vector<float> dx2(dy, dy + nd);  // the residual branch
  // MLP: down (row-parallel), GELU, up (column-parallel).
  Gemm(true, false, D, Fl, N, 1.f, dy, D, c.z.data(), Fl, 1.f, g.down, Fl);
  std::vector<float> du(static_cast<size_t>(N) * Fl);
  Gemm(false, false, N, Fl, D, 1.f, dy, D, w.down, Fl, 0.f, du.data(), Fl);
  for (size_t i = 0; i < du.size(); ++i) du[i] *= GeluGrad(c.u[i]);
  Gemm(true, false, Fl, D, N, 1.f, du.data(), Fl, c.h2.data(), D, 1.f, g.up, D);
  std::vector<float> dh(nd);
  Gemm(false, false, N, D, Fl, 1.f, du.data(), Fl, w.up, D, 0.f, dh.data(), D);
  if (tp_ > 1 && !allreduce(ctx, dh.data(), static_cast<int64_t>(nd))) return false;
  RmsNormBackward(N, D, c.x2.data(), w.ln2, c.r2.data(), dh.data(), dx2.data(), g.ln2, true);
  // Attention: output projection (row-parallel), softmax(QK^T)V per local head, fused QKV.
  Gemm(true, false, D, Dl, N, 1.f, dx2.data(), D, c.ctx.data(), Dl, 1.f, g.proj, Dl);
  std::vector<float> dctx(static_cast<size_t>(N) * Dl);
  Gemm(false, false, N, Dl, D, 1.f, dx2.data(), D, w.proj, Dl, 0.f, dctx.data(), Dl);
  std::vector<float> dqkv(static_cast<size_t>(N) * 3 * Dl, 0.f);
  std::vector<float> dp(static_cast<size_t>(T) * T);
  for (int b = 0; b < n_seq; ++b) {
    for (int h = 0; h < Hl; ++h) {
      const int64_t row0 = static_cast<int64_t>(b) * T;
      const float* q = c.qkv.data() + row0 * 3 * Dl + h * hd;
      const float* k = q + Dl;
      const float* v = q + 2 * Dl;
      float* dq = dqkv.data() + row0 * 3 * Dl + h * hd;
      float* dk = dq + Dl;
      float* dv = dq + 2 * Dl;
      const float* p = c.probs.data() + (static_cast<int64_t>(b) * Hl + h) * T * T;
      const float* dO = dctx.data() + row0 * Dl + h * hd;
      Gemm(false, true, T, T, hd, 1.f, dO, Dl, v, 3 * Dl, 0.f, dp.data(), T);  // dP = dO V^T
      Gemm(true, false, T, hd, T, 1.f, p, T, dO, Dl, 0.f, dv, 3 * Dl);         // dV = P^T dO
      for (int i = 0; i < T; ++i) {  // dS = P * (dP - rowsum(P * dP)), times the scale
        float* di = dp.data() + static_cast<int64_t>(i) * T;
        const float* pi = p + static_cast<int64_t>(i) * T;
        float dot = 0;
        for (int j = 0; j <= i; ++j) dot += pi[j] * di[j];
        for (int j = 0; j <= i; ++j) di[j] = pi[j] * (di[j] - dot) * scale;
        for (int j = i + 1; j < T; ++j) di[j] = 0.f;
      }
      Gemm(false, false, T, hd, T, 1.f, dp.data(), T, k, 3 * Dl, 0.f, dq, 3 * Dl);  // dQ = dS K
      Gemm(true, false, T, hd, T, 1.f, dp.data(), T, q, 3 * Dl, 0.f, dk, 3 * Dl);   // dK = dS^T Q
    }
  }
  Gemm(true, false, 3 * Dl, D, N, 1.f, dqkv.data(), 3 * Dl, c.h1.data(), D, 1.f, g.qkv, D);
  Gemm(false, false, N, D, 3 * Dl, 1.f, dqkv.data(), 3 * Dl, w.qkv, D, 0.f, dh.data(), D);
  if (tp_ > 1 && !allreduce(ctx, dh.data(), static_cast<int64_t>(nd))) return false;
  std::copy(dx2.begin(), dx2.end(), dx);
  RmsNormBackward(N, D, c.x.data(), w.ln1, c.r1.data(), dh.data(), dx, g.ln1, true);
  return true;
}

}  // namespace gpt
