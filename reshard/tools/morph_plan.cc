// morph-plan: dry run of a reshard. Reads a model description and two configurations (JSON),
// prints the plan summary (assignment of workers to ranks, bytes moved against the lower
// bound, per-worker bytes, busiest link, plan time) or, with --json, the whole plan.
//
//   morph-plan examples/plans/gpt_16_to_12.json
//   morph-plan --json plan.json > plan.out.json
//   cat plan.json | morph-plan -
//   morph-plan --allow-lost plan.json   # report pieces without a surviving replica, exit 0
//   morph-plan --project examples/plans/topology_h200.json plan.json
//                                       # plus the transfer time projected on that cluster
//                                       # (reshard/projection.h; with --json: "projection")
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
#include <optional>
#include <sstream>
#include <string>

#include "morph/plan.h"
#include "reshard/plan.h"
#include "reshard/tools/plan_json.h"
#include "reshard/tools/projection_json.h"

namespace {

int Usage() {
  std::fprintf(stderr,
               "usage: morph-plan [--json] [--allow-lost] [--project TOPOLOGY.json] FILE.json\n"
               "       (FILE '-' reads stdin)\n");
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

// The whole text of `file` ("-": stdin), or an exit code (2) after printing why.
static int ReadAll(const std::string& file, std::string* text) {
  if (file == "-") {
    text->assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    return 0;
  }
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
  *text = ss.str();
  return 0;
}

int main(int argc, char** argv) {
  bool as_json = false, allow_lost = false;
  std::string file, topology_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      as_json = true;
    } else if (a == "--allow-lost") {
      allow_lost = true;
    } else if (a == "--project" && i + 1 < argc) {
      topology_file = argv[++i];
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
  if (int rc = ReadAll(file, &text); rc != 0) return rc;
  std::optional<morph::Topology> topology;
  if (!topology_file.empty()) {
    std::string ttext;
    if (int rc = ReadAll(topology_file, &ttext); rc != 0) return rc;
    auto t = morph::ParseTopology(ttext);
    if (!t.ok()) return Fail(t.status().WithContext(topology_file));
    topology = *std::move(t);
  }
  auto plan = morph::DryRunPlan(text, {.allow_lost = allow_lost});
  if (!plan.ok()) return Fail(plan.status());
  if (!topology) {
    std::cout << (as_json ? plan->json + "\n" : plan->summary);
    return 0;
  }
  // The projection needs every participant's plan: planned again here (DryRunPlan keeps none).
  auto req = morph::ParsePlanRequest(text);
  if (!req.ok()) return Fail(req.status());
  auto planner = morph::Planner::Create(req->input);
  if (!planner.ok()) return Fail(planner.status());
  morph::ProjectionBuilder b(*topology, req->input.num_participants);
  for (int32_t q = 0; q < req->input.num_participants; ++q) {
    std::vector<morph::PieceMove> lost;
    auto lp = planner->PlanFor(q, allow_lost ? &lost : nullptr);
    if (!lp.ok()) return Fail(lp.status().WithContext("worker " + req->worker_names[q]));
    if (morph::Status s = b.Add(*lp); !s.ok()) return Fail(s);
  }
  const morph::Projection projection = b.Finish();
  if (as_json) {
    nlohmann::json out = nlohmann::json::parse(plan->json);
    out["projection"] = morph::ProjectionToJson(*topology, projection, req->worker_names);
    std::cout << out.dump(1) << "\n";
  } else {
    std::cout << plan->summary
              << morph::FormatProjection(*topology, projection, req->worker_names);
  }
  return 0;
}
