// A training program's view of an installed morph: <morph/morph.h> and libmorph only. It
// checks a few things that need the library's code (so the link is real): Status propagation,
// a layout's shard, the planner's dry run, and a one-worker job (hosted coordinator) that
// registers a tensor, trains two steps and finishes.
#include <morph/morph.h>

#include <cstdio>
#include <cstring>

namespace {

morph::Status Inner() { return morph::UnavailableError("peer 3 is gone"); }
morph::Status Outer() {
  MORPH_RETURN_IF_ERROR(Inner()) << "allreduce";
  return morph::Status();
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "consumer: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main() {
  morph::Status s = Outer();
  if (s.ToString() != "UNAVAILABLE: allreduce: peer 3 is gone") return Fail(s.ToString());

  morph::TensorSpec w{"w", morph::DType::kF32, {8, 4}, morph::Layout::Layer(0).SplitTP(0)};
  morph::ParallelConfig tp2;
  tp2.tp = 2;
  tp2.stage_of_layer = {0};
  auto shard = morph::ShardOf(w, tp2, 1);
  if (!shard.ok() || shard->NumElements() != 16) return Fail("ShardOf");

  auto plan = morph::DryRunPlan("{}");
  if (plan.ok() || plan.status().code() != morph::StatusCode::kInvalidArgument) {
    return Fail("DryRunPlan accepted an empty request");
  }

  auto opts = morph::Options::FromEnv();
  if (!opts.ok()) return Fail(opts.status().ToString());
  opts->bootstrap = morph::Bootstrap::kHost;
  opts->handle_sigterm = false;
  auto rt = morph::Runtime::Start(*opts, [&](morph::State& st) -> morph::Status {
    MORPH_RETURN_IF_ERROR(st.AddTensor(w.name, w.shape, w.dtype, w.layout));
    return st.AddScalar("step", 8);
  });
  if (!rt.ok()) return Fail(rt.status().ToString());
  int steps = 0;
  while (true) {
    auto step = (*rt)->BeginStep();
    if (!step.ok()) return Fail(step.status().ToString());
    if (step->done() || step->index() >= 2) break;
    auto t = (*rt)->state().tensor("w");
    if (!t.ok() || t->shard.NumElements() != 32) return Fail("tensor w");
    static_cast<float*>(t->data.data)[0] += 1;
    float one = 1;
    if (!step->world().Allreduce(&one, 1, morph::DType::kF32, morph::ReduceOp::kSum,
                                 morph::kDefaultCollectiveTimeout)
             .ok()) {
      return Fail("allreduce");
    }
    if (!(*rt)->EndStep().ok()) return Fail("EndStep");
    ++steps;
  }
  if (!(*rt)->Finish().ok()) return Fail("Finish");
  std::printf("consumer ok: %s; %d steps, generation %lld\n", s.ToString().c_str(), steps,
              static_cast<long long>((*rt)->generation().id));
  return 0;
}
