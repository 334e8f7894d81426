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
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>

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

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  auto req = morph::ParsePlanRequest(text);
  if (!req.ok()) return Fail(req.status());
  morph::PlanTimes times;
  auto t0 = std::chrono::steady_clock::now();
  auto planner = morph::Planner::Create(req->input);
  times.create_seconds = Since(t0);
  if (!planner.ok()) return Fail(planner.status());
  std::vector<morph::LocalPlan> plans;
  std::vector<std::vector<morph::PieceMove>> lost;
  if (allow_lost) lost.resize(static_cast<size_t>(req->input.num_participants));
  for (int32_t q = 0; q < req->input.num_participants; ++q) {
    auto t1 = std::chrono::steady_clock::now();
    auto lp = planner->PlanFor(q, allow_lost ? &lost[static_cast<size_t>(q)] : nullptr);
    const double dt = Since(t1);
    if (!lp.ok()) return Fail(lp.status().WithContext("worker " + req->worker_names[q]));
    times.plans_seconds += dt;
    times.max_local_seconds = std::max(times.max_local_seconds, dt);
    plans.push_back(*std::move(lp));
  }
  auto summary = planner->Summarize(plans, allow_lost ? &lost : nullptr);
  if (!summary.ok()) return Fail(summary.status());
  std::optional<morph::Projection> projection;
  if (topology) {
    morph::ProjectionBuilder b(*topology, req->input.num_participants);
    for (const morph::LocalPlan& lp : plans) {
      if (morph::Status s = b.Add(lp); !s.ok()) return Fail(s);
    }
    projection = b.Finish();
  }
  if (as_json) {
    nlohmann::json out = morph::PlanToJson(*req, *planner, plans, lost, *summary, times);
    if (projection) {
      out["projection"] = morph::ProjectionToJson(*topology, *projection, req->worker_names);
    }
    std::cout << out.dump(1) << "\n";
  } else {
    std::cout << morph::FormatPlanSummary(*req, *planner, *summary, times);
    if (projection) {
      std::cout << morph::FormatProjection(*topology, *projection, req->worker_names);
    }
  }
  return 0;
}
