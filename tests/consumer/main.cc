// Uses morph::base from an installed prefix: Status propagation and the params registry.
#include <morph/base/params.h>
#include <morph/base/status.h>

#include <cstdio>

namespace {
morph::Status Inner() { return morph::UnavailableError("peer 3 is gone"); }
morph::Status Outer() {
  MORPH_RETURN_IF_ERROR(Inner()) << "allreduce";
  return morph::Status();
}
}  // namespace

int main() {
  morph::Status s = Outer();
  if (s.ToString() != "UNAVAILABLE: allreduce: peer 3 is gone") {
    std::fprintf(stderr, "unexpected status: %s\n", s.ToString().c_str());
    return 1;
  }
  auto hb = morph::params::HeartbeatMs();
  if (!hb.ok()) {
    std::fprintf(stderr, "%s\n", hb.status().ToString().c_str());
    return 1;
  }
  std::printf("consumer ok: %s; heartbeat %lld ms\n", s.ToString().c_str(),
              static_cast<long long>(*hb));
  return 0;
}
