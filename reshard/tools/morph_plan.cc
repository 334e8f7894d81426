// morph-plan: dry run of a reshard. Reads a model description and two configurations (JSON),
// prints the plan summary (assignment of workers to ranks, bytes moved against the lower
// bound, per-worker bytes, busiest link, plan time) or, with --json, the whole plan.
//
//   morph-plan examples/plans/gpt_16_to_12.json
//   morph-plan --json plan.json > plan.out.json
//   cat plan.json | morph-plan -
//   morph-plan --allow-lost plan.json   # report pieces without a surviving replica, exit 0
//
// Exit codes: 0 plan printed; 2 bad or inconsistent input (the message names the JSON path);
// 3 data loss (an element has no surviving holder: restore from a checkpoint; --allow-lost
// prints the plan and the lost bytes instead); 1 other errors.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include "morph/plan.h"

namespace {

int Usage() {
  std::fprintf(stderr,
               "usage: morph-plan [--json] [--allow-lost] FILE.json   (FILE '-' reads stdin)\n");
  return 2;
}

int Fail(const morph::Status& s) {
  std::fprintf(stderr, "morph-plan: %s\n", s.ToString().c_str());
  switch (s.code()) {
    case morph::StatusCode::kInvalidArgument:
    case morph::StatusCode::kNotFound:
    case morph::StatusCode::kAlreadyExists:
      return 2;
    case morph::StatusCode::kDataLoss:
      return 3;
    default:
      return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool as_json = false, allow_lost = false;
  std::string file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      as_json = true;
    } else if (a == "--allow-lost") {
      allow_lost = true;
    } else if (a == "-h" || a == "--help") {
      Usage();
      return 0;
    } else if (file.empty()) {
      file = a;
    } else {
      return Usage();
    }
  }
  if (file.empty()) return Usage();
  std::string text;
  if (file == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::error_code ec;
    if (std::filesystem::is_directory(file, ec)) {
      std::fprintf(stderr, "morph-plan: %s is a directory, not a JSON file\n", file.c_str());
      return 2;
    }
    std::ifstream f(file);
    if (!f) {
      std::fprintf(stderr, "morph-plan: cannot open %s: %s\n", file.c_str(), std::strerror(errno));
      return 2;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    if (f.bad()) {
      std::fprintf(stderr, "morph-plan: cannot read %s: %s\n", file.c_str(), std::strerror(errno));
      return 2;
    }
    text = ss.str();
  }
  auto plan = morph::DryRunPlan(text, {.allow_lost = allow_lost});
  if (!plan.ok()) return Fail(plan.status());
  std::cout << (as_json ? plan->json + "\n" : plan->summary);
  return 0;
}
