// model_test: the transformer layer's and the head's backward passes against central finite
// differences (ctest gpt_model_test). Exit 0 when every checked derivative agrees.
#include "model.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

bool Noop(void*, float*, int64_t) { return true; }

}  // namespace

int main() {
  gpt::InitGemm();
  gpt::Dims d{.vocab = 11, .d_model = 8, .heads = 2, .layers = 1, .seq = 5};
  const int D = d.d_model, F = d.ffn(), ns = 2, N = ns * d.seq;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.5f);
  auto rnd = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  std::vector<float> ln1 = rnd(D), qkv = rnd(3 * D * D), proj = rnd(D * D), ln2 = rnd(D),
                     up = rnd(F * D), down = rnd(D * F), x = rnd(N * D), r = rnd(N * D);
  std::vector<std::vector<float>*> ws = {&ln1, &qkv, &proj, &ln2, &up, &down, &x};
  const char* names[] = {"ln1", "qkv", "proj", "ln2", "up", "down", "x"};
  gpt::Layer layer(d, 1);
  auto loss = [&]() {
    gpt::LayerWeights w{ln1.data(), qkv.data(), proj.data(), ln2.data(), up.data(), down.data()};
    gpt::LayerCache c;
    std::vector<float> out(N * D);
    layer.Forward(w, ns, x.data(), out.data(), c, &Noop, nullptr);
    double l = 0;
    for (int i = 0; i < N * D; ++i) l += static_cast<double>(out[i]) * r[i];
    return l;
  };
  gpt::LayerWeights w{ln1.data(), qkv.data(), proj.data(), ln2.data(), up.data(), down.data()};
  std::vector<std::vector<float>> g(7);
  for (int k = 0; k < 7; ++k) g[k].assign(ws[k]->size(), 0.f);
  gpt::LayerGrads lg{g[0].data(), g[1].data(), g[2].data(), g[3].data(), g[4].data(), g[5].data()};
  gpt::LayerCache c;
  std::vector<float> out(N * D);
  layer.Forward(w, ns, x.data(), out.data(), c, &Noop, nullptr);
  layer.Backward(w, lg, ns, c, r.data(), g[6].data(), &Noop, nullptr);
  int bad = 0;
  for (int k = 0; k < 7; ++k) {
    double worst = 0;
    for (size_t i = 0; i < ws[k]->size(); i += 3) {
      float keep = (*ws[k])[i];
      const float h = 1e-2f;
      (*ws[k])[i] = keep + h;
      double lp = loss();
      (*ws[k])[i] = keep - h;
      double lm = loss();
      (*ws[k])[i] = keep;
      double num = (lp - lm) / (2 * h);
      double err = std::fabs(num - g[k][i]) / std::max(1.0, std::fabs(num));
      worst = std::max(worst, err);
    }
    std::printf("%-5s worst relative error %.2e\n", names[k], worst);
    if (worst > 2e-2) ++bad;
  }
  // Cross entropy's gradient.
  std::vector<float> logits = rnd(3 * d.vocab), dl(logits.size());
  std::vector<int> targets = {1, 4, 9};
  gpt::CrossEntropy(3, d.vocab, logits.data(), targets.data(), 1.f, dl.data());
  double worst = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    float keep = logits[i];
    std::vector<float> tmp(logits.size());
    logits[i] = keep + 1e-2f;
    double lp = gpt::CrossEntropy(3, d.vocab, logits.data(), targets.data(), 1.f, tmp.data());
    logits[i] = keep - 1e-2f;
    double lm = gpt::CrossEntropy(3, d.vocab, logits.data(), targets.data(), 1.f, tmp.data());
    logits[i] = keep;
    worst = std::max(worst, std::fabs((lp - lm) / 2e-2 - dl[i]));
  }
  std::printf("xent  worst error %.2e\n", worst);
  if (worst > 1e-2) ++bad;
  return bad == 0 ? 0 : 1;
}
