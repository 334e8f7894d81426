// morphctl: the command-line client of a running job's scheduler API (docs/operations.md
// "morphctl"). The commands live in morphctl_cli.h; this is the program around them.
#include <glog/logging.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "base/logging.h"
#include "runtime/tools/morphctl_cli.h"

namespace {

std::atomic<bool> g_interrupted{false};

extern "C" void OnSignal(int) { g_interrupted.store(true, std::memory_order_relaxed); }

}  // namespace

int main(int argc, char** argv) {
  // morphctl prints what its user asked for, nothing else: the libraries' INFO lines (the
  // parameters read from the environment) stay quiet; warnings and errors still show.
  if (std::getenv("GLOG_minloglevel") == nullptr) FLAGS_minloglevel = google::GLOG_WARNING;
  morph::InitLogging(argv[0]);
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
