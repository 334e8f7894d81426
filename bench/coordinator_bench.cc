// Coordinator at scale (issue 9, "Benchmarks"): 4,096 simulated workers (connections driven by a
// few client threads, each worker a real AgentCore) register with one Coordinator and heartbeat;
// then the time to decide and announce a change, for a GPT-like manifest (24 layers x 12
// tensors, tp 8, pp 4) with the exact assignment:
//   first_generation   the last registration -> every worker holds generation 1's commit
//   shrink_dp          Resize(world - tp*pp) -> every participant received the commit
//                      (plan + assignment + digest, prepare, 4,096 step reports, commit)
//   worker_lost        one connection closes -> every survivor received the next commit
// The clients share this machine's cores with the coordinator; 1 in 64 simulated workers decodes
// every frame and runs a real AgentCore, the others answer from the frames' fixed fields.
// Target: < 500 ms for the change. One JSON object per case.
//
//   make bench-coordinator     (or build/bench/coordinator_bench [workers] [client_threads])
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/logging.h"
#include "runtime/agent/agent_core.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/protocol/wire.h"

namespace morph {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kToken[] = "coordinator-bench-token";
constexpr int kTp = 8, kPp = 4;
// One simulated worker in this many decodes Prepare and Commit fully and runs a real AgentCore;
// the others read the fixed fields only (see ClientThread).
constexpr int64_t kFullDecodeEvery = 64;

JobManifest GptManifest() {
  JobManifest m;
  const int layers = 24;
  const int64_t h = 1024;
  m.model = ModelShape{.num_layers = layers,
                       .num_heads = 32,
                       .tp_candidates = {kTp},
                       .pp_candidates = {kPp},
                       .global_batch = 8192,
                       .micro_batches = 8};
  for (int l = 0; l < layers; ++l) {
    std::string p = "layers." + std::to_string(l) + ".";
    auto add = [&](const std::string& n, std::vector<int64_t> shape, int tp_dim) {
      Layout lay = Layout::Layer(l);
      if (tp_dim >= 0) lay = lay.SplitTP(tp_dim);
      m.tensors.push_back(TensorSpec{p + n, DType::kBF16, std::move(shape), lay});
    };
    add("ln1.w", {h}, -1);
    add("ln1.b", {h}, -1);
    add("attn.qkv.w", {3 * h, h}, 0);
    add("attn.qkv.b", {3 * h}, 0);
    add("attn.out.w", {h, h}, 1);
    add("attn.out.b", {h}, -1);
    add("ln2.w", {h}, -1);
    add("ln2.b", {h}, -1);
    add("mlp.fc1.w", {4 * h, h}, 0);
    add("mlp.fc1.b", {4 * h}, 0);
    add("mlp.fc2.w", {h, 4 * h}, 1);
    add("mlp.fc2.b", {h}, -1);
  }
  m.scalars = {ScalarSpec{"step", 8}, ScalarSpec{"rng", 16}};
  m.dataset_samples = 1 << 20;
  return m;
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct SimWorker {
  int fd = -1;
  std::string in;
  std::unique_ptr<AgentCore> core;
  bool welcomed = false;
  bool closed = false;
};

// Shared progress counters, per generation id.
struct Progress {
  std::atomic<int> welcomed{0};
  std::atomic<int> commits[8] = {};
  std::atomic<int64_t> last_commit_ns[8] = {};
  std::atomic<int64_t> first_prepare_ns[8] = {};
  std::atomic<int64_t> last_prepare_ns[8] = {};
  std::atomic<int64_t> commit_bytes{0};
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  // The generation the bench knows to be a recovery (case 3): its prepare is answered with the
  // state report a real worker sends at its step boundary.
  std::atomic<int64_t> recovery_generation{-1};
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

bool SendAll(int fd, const std::string& b) {
  size_t done = 0;
  while (done < b.size()) {
    ssize_t n = ::send(fd, b.data() + done, b.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// One client thread: `workers` connections, an epoll loop, heartbeats every second (the
// MORPH_HEARTBEAT_MS default).
void ClientThread(uint16_t port, int workers, const std::string& hello, const std::string& reg,
                  Progress& p, std::vector<SimWorker>& mine, std::mutex& close_mu) {
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  for (int i = 0; i < workers; ++i) {
    SimWorker& w = mine[i];
    w.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    ::setsockopt(w.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    while (::connect(w.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(w.fd);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      w.fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    }
    if (!SendAll(w.fd, hello) || !SendAll(w.fd, reg)) p.errors++;
    epoll_event ev{.events = EPOLLIN, .data = {.u32 = static_cast<uint32_t>(i)}};
    ::epoll_ctl(ep, EPOLL_CTL_ADD, w.fd, &ev);
  }
  std::string hb = EncodeFrame(HeartbeatMsg{.step = 10});
  auto last_hb = Clock::now();
  std::vector<char> buf(1 << 20);
  epoll_event events[256];
  while (!p.stop.load()) {
    int n = ::epoll_wait(ep, events, 256, 20);
    for (int e = 0; e < n; ++e) {
      SimWorker& w = mine[events[e].data.u32];
      std::lock_guard<std::mutex> lock(close_mu);
      if (w.closed) continue;
      ssize_t got = ::recv(w.fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (got <= 0) {
        if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
          ::epoll_ctl(ep, EPOLL_CTL_DEL, w.fd, nullptr);
          w.closed = true;
        }
        continue;
      }
      w.in.append(buf.data(), static_cast<size_t>(got));
      while (w.in.size() >= kFrameHeaderBytes) {
        StatusOr<FrameHeader> h = DecodeHeader(w.in);
        if (!h.ok()) {
          p.errors++;
          w.in.clear();
          break;
        }
        if (w.in.size() < kFrameHeaderBytes + h->length) break;
        std::string_view body = std::string_view(w.in).substr(kFrameHeaderBytes, h->length);
        const bool big = h->type == static_cast<uint16_t>(WireType::kPrepare) ||
                         h->type == static_cast<uint16_t>(WireType::kCommit);
        if (big && w.core && w.core->me() % kFullDecodeEvery != 1) {
          // A real worker decodes its own copy on its own machine; here one client thread
          // would decode thousands, so most simulated workers read only the fixed fields
          // (next.id, next.start_step) and answer as their agent would.
          int64_t id = 0, start = 0;
          std::memcpy(&id, body.data(), 8);
          std::memcpy(&start, body.data() + 8, 8);
          if (h->type == static_cast<uint16_t>(WireType::kPrepare)) {
            int slot = static_cast<int>(id % 8);
            int64_t now = NowNs(), zero = 0;
            p.first_prepare_ns[slot].compare_exchange_strong(zero, now);
            p.last_prepare_ns[slot] = now;
            StepReportMsg report{.worker = w.core->me(), .generation = id, .last_free_step = 10};
            // A recovery: every simulated worker's state is whole at step 10 (its heartbeats'
            // step), as a real worker reports it at its boundary.
            if (id == p.recovery_generation.load()) report.state_step = 10;
            SendAll(w.fd, EncodeFrame(report));
          } else {
            int slot = static_cast<int>(id % 8);
            p.commits[slot]++;
            p.last_commit_ns[slot] = NowNs();
            SendAll(w.fd, EncodeFrame(AppliedMsg{.worker = w.core->me(), .generation = id}));
          }
          w.in.erase(0, kFrameHeaderBytes + h->length);
          continue;
        }
        StatusOr<WireMessage> m = DecodeBody(*h, body);
        w.in.erase(0, kFrameHeaderBytes + h->length);
        if (!m.ok()) {
          p.errors++;
          continue;
        }
        if (auto* wel = std::get_if<WelcomeMsg>(&*m)) {
          w.core = std::make_unique<AgentCore>(wel->worker);
          w.welcomed = true;
          p.welcomed++;
        } else if (auto* pre = std::get_if<PrepareMsg>(&*m)) {
          if (pre->change.recovery) {
            // What the agent and the training thread do: the new world is built, and the state
            // at the boundary (step 10, whole) is reported; the report goes out with the second.
            w.core->OnRecoveryPrepare(*pre);
            std::optional<StepReportMsg> r = w.core->OnRecoveryBuilt(pre->next.id);
            if (auto r2 = w.core->OnRecoveryState(StepReportMsg{.state_step = 10})) r = r2;
            if (r) SendAll(w.fd, EncodeFrame(*r));
          } else if (auto r = w.core->OnPrepare(*pre, /*next_step=*/10)) {
            SendAll(w.fd, EncodeFrame(*r));
          }
        } else if (auto* c = std::get_if<CommitMsg>(&*m)) {
          int slot = static_cast<int>(c->next.id % 8);
          p.commits[slot]++;
          p.last_commit_ns[slot] = NowNs();
          p.commit_bytes = kFrameHeaderBytes + h->length;
          w.core->OnCommit(*c);
          // The simulated training thread reaches the switch step at once.
          if (w.core->AtStep(c->next.start_step) == AgentCore::Action::kSwitch) {
            SendAll(w.fd, EncodeFrame(w.core->SwitchDone(true)));
          }
        } else if (auto* o = std::get_if<OutcomeMsg>(&*m)) {
          w.core->OnOutcome(*o);
        } else if (auto* r = std::get_if<ReleaseMsg>(&*m)) {
          w.core->OnRelease(*r);
        } else if (std::holds_alternative<ErrorMsg>(*m)) {
          p.errors++;
        }
      }
    }
    if (Clock::now() - last_hb > std::chrono::milliseconds(1000)) {
      last_hb = Clock::now();
      std::lock_guard<std::mutex> lock(close_mu);
      for (int i = 0; i < workers; ++i) {
        if (mine[i].welcomed && !mine[i].closed) SendAll(mine[i].fd, hb);
      }
    }
  }
  for (int i = 0; i < workers; ++i) {
    if (mine[i].fd >= 0) ::close(mine[i].fd);
  }
  ::close(ep);
}

bool WaitUntil(const std::function<bool()>& pred, double seconds) {
  auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return pred();
}

void Print(const char* name, int workers, int64_t bytes, double seconds,
           const CoordinatorSnapshot& s, const std::string& extra) {
  double plan = 0, agree = 0;
  if (s.last_reconfiguration) {
    plan = s.last_reconfiguration->plan_ms;
    agree = s.last_reconfiguration->agree_ms;
  }
  std::printf(
      "{\"name\":\"coordinator_%s\",\"workers\":%d,\"world\":%zu,\"config\":\"%s\","
      "\"bytes\":%lld,\"seconds\":%.6f,\"target_seconds\":0.5,\"ratio_vs_target\":%.3f,"
      "\"plan_ms\":%.3f,\"agree_ms\":%.3f%s}\n",
      name, workers, s.members.size(), s.config.ToString().c_str(),
      static_cast<long long>(bytes), seconds, seconds / 0.5, plan, agree, extra.c_str());
  std::fflush(stdout);
}

int Run(int workers, int threads) {
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < static_cast<rlim_t>(2 * workers + 256)) {
    std::fprintf(stderr, "coordinator_bench: open-file limit %llu is below %d\n",
                 static_cast<unsigned long long>(rl.rlim_cur), 2 * workers + 256);
    return 1;
  }
  CoordinatorOptions o;
  o.token = kToken;
  o.initial_world = workers;
  o.heartbeat_timeout_ms = 120000;
  o.serve_http = false;
  o.handshake_timeout_ms = 120000;
  o.store.max_connections = 64;
  StatusOr<std::unique_ptr<Coordinator>> started = Coordinator::Start(o);
  if (!started.ok()) {
    std::fprintf(stderr, "coordinator_bench: %s\n", started.status().ToString().c_str());
    return 1;
  }
  Coordinator& coord = **started;
  uint16_t port = static_cast<uint16_t>(
      std::stoi(coord.control_address().substr(coord.control_address().rfind(':') + 1)));
  std::string hello = EncodeFrame(HelloMsg{.token = kToken, .host = "sim"});
  std::string reg = EncodeFrame(RegisterMsg{.manifest = GptManifest()});

  Progress p;
  std::mutex close_mu;
  std::vector<std::vector<SimWorker>> pools(threads);
  std::vector<std::thread> clients;
  auto t_reg = Clock::now();
  for (int t = 0; t < threads; ++t) {
    int n = workers / threads + (t < workers % threads ? 1 : 0);
    pools[t].resize(n);
    clients.emplace_back(ClientThread, port, n, std::cref(hello), std::cref(reg), std::ref(p),
                         std::ref(pools[t]), std::ref(close_mu));
  }
  int rc = 0;
  auto fail = [&](const char* what) {
    std::fprintf(stderr, "coordinator_bench: %s (welcomed %d, errors %d)\n", what,
                 p.welcomed.load(), p.errors.load());
    rc = 1;
  };
  // Case 1: registration, then generation 1 to everybody.
  if (!WaitUntil([&] { return p.welcomed.load() == workers; }, 120)) fail("registration");
  double reg_s = Since(t_reg);
  auto t_last_welcome = Clock::now();
  if (rc == 0 && !WaitUntil([&] { return p.commits[1].load() == workers; }, 60)) {
    fail("generation 1");
  }
  if (rc == 0) {
    double s = std::chrono::duration<double>(
                   Clock::time_point(std::chrono::nanoseconds(p.last_commit_ns[1].load())) -
                   t_last_welcome)
                   .count();
    WaitUntil([&] { return coord.Snapshot().generation == 1; }, 30);
    Print("first_generation", workers, p.commit_bytes.load(), std::max(0.0, s), coord.Snapshot(),
          ",\"registration_seconds\":" + std::to_string(reg_s));
  }
  // Let heartbeats flow for a moment, as in a running job.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));

  // Case 2: shrink by one DP replica (tp*pp workers): resize -> every commit delivered.
  if (rc == 0) {
    WaitUntil([&] { return coord.Snapshot().phase == "stable"; }, 30);
    int world = coord.Snapshot().config.world();
    int target = world - kTp * kPp;
    double cpu0 = coord.stats().io_cpu_seconds;
    auto t0 = Clock::now();
    Status s = coord.Resize(ResizeRequest{.world_size = target, .reason = "bench"},
                            Deadline::AfterMs(30000));
    double answer_s = Since(t0);
    if (!s.ok()) {
      std::fprintf(stderr, "coordinator_bench: resize: %s\n", s.ToString().c_str());
      rc = 1;
    } else if (!WaitUntil([&] { return p.commits[2].load() == workers; }, 60)) {
      fail("generation 2");
    } else {
      double secs = std::chrono::duration<double>(
                        Clock::time_point(std::chrono::nanoseconds(p.last_commit_ns[2].load())) -
                        t0)
                        .count();
      double cpu = coord.stats().io_cpu_seconds - cpu0;  // up to now: an upper bound
      WaitUntil([&] { return coord.Snapshot().generation == 2; }, 30);
      auto at = [&](int64_t ns) {
        return std::to_string(
            std::chrono::duration<double>(Clock::time_point(std::chrono::nanoseconds(ns)) - t0)
                .count());
      };
      Print("shrink_dp", workers, p.commit_bytes.load(), secs, coord.Snapshot(),
            ",\"first_prepare_at\":" + at(p.first_prepare_ns[2]) +
                ",\"last_prepare_at\":" + at(p.last_prepare_ns[2]) +
                ",\"io_thread_cpu_seconds\":" + std::to_string(cpu) +
                ",\"from_world\":" + std::to_string(world) +
                ",\"resize_answer_seconds\":" + std::to_string(answer_s));
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // Case 3: a member's connection closes -> every survivor holds the next commit.
  if (rc == 0) {
    WaitUntil([&] { return coord.Snapshot().phase == "stable"; }, 30);
    CoordinatorSnapshot before = coord.Snapshot();
    WorkerId victim = before.members.back().worker;
    int survivors = static_cast<int>(before.members.size()) - 1;
    p.recovery_generation = before.generation + 1;
    auto t0 = Clock::now();
    {
      std::lock_guard<std::mutex> lock(close_mu);
      for (auto& pool : pools) {
        for (SimWorker& w : pool) {
          if (w.core && w.core->me() == victim) {
            ::shutdown(w.fd, SHUT_RDWR);
            w.closed = true;
          }
        }
      }
    }
    // Survivors: the old ranks minus the victim (the released spares are gone).
    if (!WaitUntil([&] { return p.commits[3].load() >= survivors; }, 60)) {
      fail("generation 3");
    } else {
      double secs = std::chrono::duration<double>(
                        Clock::time_point(std::chrono::nanoseconds(p.last_commit_ns[3].load())) -
                        t0)
                        .count();
      WaitUntil([&] { return coord.Snapshot().generation == 3; }, 30);
      Print("worker_lost", workers, p.commit_bytes.load(), secs, coord.Snapshot(),
            ",\"survivors\":" + std::to_string(survivors));
    }
  }
  p.stop = true;
  for (auto& t : clients) t.join();
  coord.Stop();
  if (p.errors.load() != 0) {
    std::fprintf(stderr, "coordinator_bench: %d protocol errors\n", p.errors.load());
    rc = 1;
  }
  return rc;
}

}  // namespace
}  // namespace morph

int main(int argc, char** argv) {
  morph::InitLogging(argv[0]);
  if (!std::getenv("MORPH_BENCH_VERBOSE")) FLAGS_minloglevel = 1;  // the coordinator's per-decision INFO lines would dominate the output
  int workers = argc > 1 ? std::atoi(argv[1]) : 4096;
  int threads = argc > 2 ? std::atoi(argv[2]) : 4;
  if (workers < 64 || threads < 1) {
    std::fprintf(stderr, "usage: coordinator_bench [workers >= 64] [client_threads]\n");
    return 2;
  }
  return morph::Run(workers, threads);
}
