// The control messages' field lists: each names every field of its struct once, in wire order.
// wire.cc encodes and decodes frames with them and runtime/plan/plan_input.cc digests the job
// manifest with them, so adding a field is one line here (and a wire version bump).
//
// A visitor is called as v("name", field) for every field, with the field const when the struct
// is; for a field that is itself a struct with a field list, the visitor calls Fields on it
// (VisitFields below helps). Leaf types: bool, int32_t, int64_t, uint64_t, std::string, DType,
// Layout, RecoverySource, std::vector<int>, std::vector<int64_t>, and vectors of structs.
#ifndef MORPH_RUNTIME_PROTOCOL_FIELDS_H_
#define MORPH_RUNTIME_PROTOCOL_FIELDS_H_

#include <concepts>
#include <type_traits>

#include "runtime/protocol/wire.h"

namespace morph::fields {

// T is U, const or not.
template <typename T, typename U>
concept Is = std::same_as<std::remove_const_t<T>, U>;

template <typename V, Is<ParallelConfig> T>
void Fields(V& v, T& c) {
  v("dp", c.dp);
  v("tp", c.tp);
  v("pp", c.pp);
  v("zero_stage", c.zero_stage);
  v("micro_batches", c.micro_batches);
  v("stage_of_layer", c.stage_of_layer);
}

template <typename V, Is<Generation> T>
void Fields(V& v, T& g) {
  v("id", g.id);
  v("start_step", g.start_step);
  v("config", g.config);
  v("ranks", g.ranks);
  v("plan_digest", g.plan_digest);
}

template <typename V, Is<ChangeParticipants> T>
void Fields(V& v, T& c) {
  v("participants", c.participants);
  v("leavers", c.leavers);
  v("exiting", c.exiting);
  v("lost", c.lost);
  v("recovery", c.recovery);
  v("stale", c.stale);
}

template <typename V, Is<ModelShape> T>
void Fields(V& v, T& m) {
  v("num_layers", m.num_layers);
  v("num_heads", m.num_heads);
  v("tp_candidates", m.tp_candidates);
  v("pp_candidates", m.pp_candidates);
  v("global_batch", m.global_batch);
  v("micro_batches", m.micro_batches);
  v("zero_stage", m.zero_stage);
  v("device_memory_bytes", m.device_memory_bytes);
}

template <typename V, Is<TensorSpec> T>
void Fields(V& v, T& t) {
  v("name", t.name);
  v("dtype", t.dtype);
  v("shape", t.shape);
  v("layout", t.layout);
}

template <typename V, Is<ScalarSpec> T>
void Fields(V& v, T& s) {
  v("name", s.name);
  v("bytes", s.bytes);
}

template <typename V, Is<JobManifest> T>
void Fields(V& v, T& m) {
  v("model", m.model);
  v("tensors", m.tensors);
  v("scalars", m.scalars);
  v("backend", m.backend);
  v("dataset_samples", m.dataset_samples);
  v("dataset_seed", m.dataset_seed);
  v("dataset_shuffle", m.dataset_shuffle);
  v("chunk_bytes", m.chunk_bytes);
  v("staging_bytes", m.staging_bytes);
}

template <typename V, Is<HelloMsg> T>
void Fields(V& v, T& m) {
  v("token", m.token);
  v("host", m.host);
  v("pid", m.pid);
  v("capabilities", m.capabilities);
  v("resume_id", m.resume_id);
}

template <typename V, Is<WelcomeMsg> T>
void Fields(V& v, T& m) {
  v("worker", m.worker);
  v("generation", m.generation);
  v("store_address", m.store_address);
  v("current", m.current);
  v("first_generation", m.first_generation);
}

template <typename V, Is<ResumeState> T>
void Fields(V& v, T& r) {
  v("generation", r.generation);
  v("step", r.step);
  v("awaiting_outcome", r.awaiting_outcome);
  v("prepared", r.prepared);
  v("done", r.done);
  v("leaving", r.leaving);
}

// The manifest's fields directly: "register.tensors.dtype", not "register.manifest.…".
template <typename V, Is<RegisterMsg> T>
void Fields(V& v, T& m) {
  Fields(v, m.manifest);
  v("resume", m.resume);
}

template <typename V, Is<DoneMsg> T>
void Fields(V&, T&) {}

template <typename V, Is<HeartbeatMsg> T>
void Fields(V& v, T& m) {
  v("step", m.step);
}

template <typename V, Is<LeaveMsg> T>
void Fields(V& v, T& m) {
  v("reason", m.reason);
}

template <typename V, Is<ErrorMsg> T>
void Fields(V& v, T& m) {
  v("code", m.code);
  v("message", m.message);
}

template <typename V, Is<RecoveryDecision> T>
void Fields(V& v, T& r) {
  v("source", r.source);
  v("newest_step", r.newest_step);
  v("checkpoint", r.checkpoint);
  v("snapshot_holders", r.snapshot_holders);
}

// Prepare and Commit carry the same fields; a commit adds its recovery decision.
template <typename V, typename T>
requires Is<T, PrepareMsg> || Is<T, CommitMsg>
void Fields(V& v, T& m) {
  v("next", m.next);
  v("from_generation", m.from_generation);
  v("from", m.from);
  v("change", m.change);
  if constexpr (Is<T, CommitMsg>) v("recovery", m.recovery);
}

template <typename V, Is<SnapshotHoldings> T>
void Fields(V& v, T& s) {
  v("local_step", s.local_step);
  v("local_prev_step", s.local_prev_step);
  v("held_step", s.held_step);
  v("held_prev_step", s.held_prev_step);
  v("held_rank", s.held_rank);
  v("held_tensors", s.held_tensors);
}

template <typename V, Is<StepReportMsg> T>
void Fields(V& v, T& m) {
  v("worker", m.worker);
  v("generation", m.generation);
  v("last_free_step", m.last_free_step);
  v("state_step", m.state_step);
  v("state_ok", m.state_ok);
  v("snapshots", m.snapshots);
  v("undo_step", m.undo_step);
  v("vote_step", m.vote_step);
  v("committed_step", m.committed_step);
}

template <typename V, Is<AbortMsg> T>
void Fields(V& v, T& m) {
  v("generation", m.generation);
  v("reason", m.reason);
}

template <typename V, Is<FailureReportMsg> T>
void Fields(V& v, T& m) {
  v("generation", m.generation);
  v("step", m.step);
  v("peers", m.peers);
  v("error", m.error);
}

template <typename V, Is<AbandonMsg> T>
void Fields(V& v, T& m) {
  v("generation", m.generation);
}

template <typename V, Is<AppliedMsg::Phases> T>
void Fields(V& v, T& p) {
  v("communicators_us", p.communicators_us);
  v("plan_us", p.plan_us);
  v("transfer_us", p.transfer_us);
  v("resume_us", p.resume_us);
  v("stall_us", p.stall_us);
}

template <typename V, Is<AppliedMsg> T>
void Fields(V& v, T& m) {
  v("worker", m.worker);
  v("generation", m.generation);
  v("ok", m.ok);
  v("error", m.error);
  v("phases", m.phases);
}

template <typename V, Is<OutcomeMsg> T>
void Fields(V& v, T& m) {
  v("generation", m.generation);
  v("applied", m.applied);
}

template <typename V, Is<ReleaseMsg> T>
void Fields(V& v, T& m) {
  v("generation", m.generation);
}

}  // namespace morph::fields

#endif  // MORPH_RUNTIME_PROTOCOL_FIELDS_H_
