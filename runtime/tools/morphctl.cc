// morphctl: the command-line client of a running job's scheduler API (docs/operations.md
// "morphctl"). The commands live in morphctl_cli.h; this is the program around them.
#include <csignal>
#include <iostream>
#include <string>
#include <vector>

#include "runtime/tools/morphctl_cli.h"

namespace {

std::atomic<bool> g_interrupted{false};

extern "C" void OnSignal(int) { g_interrupted.store(true, std::memory_order_relaxed); }

}  // namespace

int main(int argc, char** argv) {
  // Ctrl-C (and SIGTERM) end `watch` between polls with exit code 0.
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<std::string> args(argv + 1, argv + argc);
  return morph::RunMorphctl(args, std::cout, std::cerr, &g_interrupted);
}
