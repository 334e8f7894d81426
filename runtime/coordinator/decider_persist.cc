// Coordinator failover, the decider's half (decider.h "Coordinator failover"): its state saved
// as JSON (the wire structs through their field lists, runtime/protocol/fields.h), restored in
// a successor, and the rejoin of workers that reconnect to it.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "runtime/coordinator/decider.h"
#include "runtime/protocol/fields.h"

namespace morph {

namespace {

using json = nlohmann::json;

constexpr int kSaveVersion = 1;

template <typename T>
struct IsVector : std::false_type {};
template <typename T, typename A>
struct IsVector<std::vector<T, A>> : std::true_type {};

struct ToJson;
struct FromJson;

template <typename T>
concept HasFields = requires(ToJson& v, const T& t) { fields::Fields(v, t); };

template <typename T>
json Encode(const T& v);
template <typename T>
void Decode(const json& j, T& v);

struct ToJson {
  json& out;
  template <typename T>
  void operator()(const char* name, const T& v) {
    out[name] = Encode(v);
  }
};

struct FromJson {
  const json& in;
  template <typename T>
  void operator()(const char* name, T& v) {
    Decode(in.at(name), v);
  }
};

template <typename T>
json Encode(const T& v) {
  if constexpr (HasFields<T>) {
    json o = json::object();
    ToJson w{o};
    fields::Fields(w, v);
    return o;
  } else if constexpr (IsVector<T>::value) {
    json a = json::array();
    for (const auto& x : v) a.push_back(Encode(x));
    return a;
  } else if constexpr (std::is_enum_v<T>) {
    return static_cast<int64_t>(v);
  } else {
    return v;
  }
}

template <typename T>
void Decode(const json& j, T& v) {
  if constexpr (HasFields<T>) {
    FromJson r{j};
    fields::Fields(r, v);
  } else if constexpr (IsVector<T>::value) {
    v.clear();
    for (const json& x : j) {
      typename T::value_type e{};
      Decode(x, e);
      v.push_back(std::move(e));
    }
  } else if constexpr (std::is_enum_v<T>) {
    v = static_cast<T>(j.get<int64_t>());
  } else {
    v = j.get<T>();
  }
}

template <typename C>
json Ids(const C& c) {
  return json(std::vector<WorkerId>(c.begin(), c.end()));
}

std::set<WorkerId> IdSet(const json& j) {
  std::vector<WorkerId> v = j.get<std::vector<WorkerId>>();
  return std::set<WorkerId>(v.begin(), v.end());
}

}  // namespace

std::string Decider::Save() const {
  json j;
  j["version"] = kSaveVersion;
  j["phase"] = static_cast<int>(phase_);
  j["last_id"] = last_id_;
  j["current"] = Encode(current_);
  json workers = json::array();
  for (const auto& [id, w] : workers_) {
    workers.push_back(json{{"id", id},
                           {"host", w.host},
                           {"leaving", w.leaving},
                           {"released", w.released},
                           {"done", w.done}});
  }
  j["workers"] = std::move(workers);
  j["lost"] = Ids(lost_);
  j["desired_world"] = desired_world_ ? json(*desired_world_) : json(nullptr);
  j["launch_outstanding"] = launch_outstanding_;
  j["resize_active"] = resize_active_;
  j["noop"] = noop_ ? json{{"candidates", noop_->first}, {"target", noop_->second}} : json(nullptr);
  j["replan"] = replan_;
  j["explanation"] = last_explanation_;
  j["finishing"] = finishing_;
  j["gone_after_done"] = Ids(gone_after_done_);
  j["recovery_needed"] = recovery_needed_;
  j["shrunk_away"] = Ids(shrunk_away_);
  j["pending"] = pending_ ? Encode(*pending_) : json(nullptr);
  j["pending_change"] = Encode(pending_change_);
  json reports = json::array();
  for (const auto& [w, r] : reports_) reports.push_back(Encode(r));
  j["reports"] = std::move(reports);
  j["choosing"] = choosing_;
  j["recovery_prepared"] = recovery_prepared_ms_ >= 0;
  j["recovery_decision"] = Encode(recovery_decision_);
  j["applied"] = Ids(applied_);
  j["applied_ok"] = Ids(applied_ok_);
  j["aborted_fresh"] = aborted_fresh_;
  j["lost_during_commit"] = Ids(lost_during_commit_);
  j["failed_before_outcome"] = Ids(failed_before_outcome_);
  j["answered"] = Ids(answered_);
  j["rejoin_waiting"] = Ids(rejoin_waiting_);
  return j.dump();
}

Status Decider::Load(std::string_view saved) {
  json j = json::parse(saved, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return DataLossError("saved decider state: not a JSON object");
  if (j.value("version", 0) != kSaveVersion) {
    return DataLossError("saved decider state: version " + std::to_string(j.value("version", 0)) +
                         ", this coordinator reads " + std::to_string(kSaveVersion));
  }
  try {
    const int phase = j.at("phase").get<int>();
    if (phase < static_cast<int>(Phase::kStarting) || phase > static_cast<int>(Phase::kStopped)) {
      return DataLossError("saved decider state: phase " + std::to_string(phase));
    }
    phase_ = static_cast<Phase>(phase);
    last_id_ = j.at("last_id").get<int64_t>();
    Decode(j.at("current"), current_);
    IndexCurrent();
    workers_.clear();
    for (const json& w : j.at("workers")) {
      workers_[w.at("id").get<WorkerId>()] = Worker{.host = w.at("host").get<std::string>(),
                                                    .leaving = w.at("leaving").get<bool>(),
                                                    .released = w.at("released").get<bool>(),
                                                    .done = w.at("done").get<bool>()};
    }
    lost_ = IdSet(j.at("lost"));
    desired_world_.reset();
    if (!j.at("desired_world").is_null()) desired_world_ = j["desired_world"].get<int>();
    launch_outstanding_ = j.at("launch_outstanding").get<int>();
    resize_active_ = j.at("resize_active").get<bool>();
    noop_.reset();
    if (!j.at("noop").is_null()) {
      noop_ = std::make_pair(j["noop"].at("candidates").get<std::vector<WorkerId>>(),
                             j["noop"].at("target").get<int>());
    }
    replan_ = j.at("replan").get<bool>();
    last_explanation_ = j.at("explanation").get<std::string>();
    finishing_ = j.at("finishing").get<bool>();
    gone_after_done_ = IdSet(j.at("gone_after_done"));
    recovery_needed_ = j.at("recovery_needed").get<bool>();
    shrunk_away_ = IdSet(j.at("shrunk_away"));
    pending_.reset();
    if (!j.at("pending").is_null()) {
      Generation g;
      Decode(j["pending"], g);
      pending_ = std::move(g);
    }
    Decode(j.at("pending_change"), pending_change_);
    participant_set_ = std::unordered_set<WorkerId>(pending_change_.participants.begin(),
                                                    pending_change_.participants.end());
    reports_.clear();
    for (const json& r : j.at("reports")) {
      StepReportMsg m;
      Decode(r, m);
      reports_.emplace(m.worker, std::move(m));
    }
    choosing_ = j.at("choosing").get<bool>();
    recovery_prepared_ms_ = j.at("recovery_prepared").get<bool>() ? 0 : -1;
    Decode(j.at("recovery_decision"), recovery_decision_);
    applied_ = IdSet(j.at("applied"));
    applied_ok_ = IdSet(j.at("applied_ok"));
    aborted_fresh_ = j.at("aborted_fresh").get<bool>();
    lost_during_commit_ = IdSet(j.at("lost_during_commit"));
    failed_before_outcome_ = IdSet(j.at("failed_before_outcome"));
    answered_ = IdSet(j.at("answered"));
    rejoin_waiting_ = IdSet(j.at("rejoin_waiting"));
  } catch (const std::exception& e) {
    return DataLossError(std::string("saved decider state: ") + e.what());
  }
  rejoin_deadline_ms_ = -1;
  return Status::Ok();
}

std::vector<DeciderAction::Any> Decider::Resume(int64_t now_ms) {
  Out out;
  now_ms_ = now_ms;
  if (phase_ == Phase::kFailed || phase_ == Phase::kComplete || phase_ == Phase::kStopped) {
    return out;
  }
  // Every worker the dead leader knew has a rejoin timeout to come back; the ones still owed
  // from an earlier succession keep waiting.
  for (auto& [id, w] : workers_) {
    w.last_seen_ms = now_ms;
    rejoin_waiting_.insert(id);
  }
  rejoin_deadline_ms_ = now_ms + options_.rejoin_timeout_ms;
  resumed_ = true;
  if (recovery_prepared_ms_ >= 0) recovery_prepared_ms_ = now_ms;
  const int64_t newest = pending_ ? pending_->id : current_.id;
  if (newest > 0) out.push_back(DeciderAction::AdvanceStore{newest});
  if (phase_ == Phase::kCommitted && pending_) {
    // Saved with some participant past the closing barrier: its leavers are gone.
    CountInheritedLeaversGone();
    MaybeFinishChange(out);
  } else if (phase_ == Phase::kPlanning) {
    // The plan died with the leader; nothing was sent for it. Its id is skipped.
    pending_.reset();
    phase_ = current_.id == 0 ? Phase::kStarting : Phase::kStable;
    MaybePropose(out);
  } else if (phase_ == Phase::kPreparing && !choosing_ && pending_) {
    // Its participants build the new generation's communicators through the dead leader's
    // store, and only some may have got through: a build waiting there never ends (before the
    // change timeout), and one rebuilt on this leader's store would not meet the others. So the
    // proposal is abandoned and proposed anew under a new id, whose builds all rendezvous
    // here. Reports come only from built participants, so no commit depended on it yet; a
    // worker waiting at its gate for it gets the abandon when it rejoins (OnRejoin).
    AbandonPending(out);
    MaybePropose(out);
  } else if (phase_ == Phase::kPreparing && choosing_ && pending_) {
    if (current_.id == 0) {
      out.push_back(DeciderAction::FindResumeCheckpoint{pending_->id});
    } else {
      std::vector<StepReportMsg> reports;
      for (const auto& [w, r] : reports_) reports.push_back(r);
      out.push_back(DeciderAction::ChooseRecovery{pending_->id, current_, *pending_,
                                                  pending_change_, std::move(reports)});
    }
  }
  return out;
}

void Decider::OnRejoin(const DeciderEvent::Rejoin& e, Out& out) {
  const WorkerId w = e.worker;
  auto it = workers_.find(w);
  if (it == workers_.end()) {
    if (lost_.count(w) || CurrentRank(w) >= 0) {
      // Declared lost (its state is being or was replaced): it may not come back as itself.
      out.push_back(DeciderAction::Disconnect{w, "worker " + std::to_string(w) +
                                                     " was declared lost before it reconnected"});
    } else if (e.generation == 0 && !e.done && !e.leaving) {
      // Welcomed by the dead leader after its last write: a worker without state joins anew.
      workers_[w] = Worker{.host = e.host, .last_seen_ms = now_ms_};
      OnJoin(DeciderEvent::Join{.worker = w, .host = e.host}, out);
    } else {
      // Released (or gone through a change) before the leader died: it has nothing to do here.
      if (e.done) out.push_back(DeciderAction::AckDone{w});
      out.push_back(DeciderAction::SendRelease{w, ReleaseMsg{current_.id}});
    }
    return;
  }
  rejoin_waiting_.erase(w);
  it->second.last_seen_ms = now_ms_;
  if (!e.host.empty()) it->second.host = e.host;
  // An Outcome the dead leader decided but did not deliver.
  if (e.awaiting_outcome != 0 && !(phase_ == Phase::kCommitted && pending_ &&
                                   pending_->id == e.awaiting_outcome)) {
    out.push_back(DeciderAction::SendOutcome{
        {w}, OutcomeMsg{e.awaiting_outcome, current_.id == e.awaiting_outcome}});
  }
  // A proposal it stopped for that is not in progress any more was abandoned (its Abandon died
  // with the leader): without one it would wait at its gate for ever.
  if (e.prepared != 0 && !(pending_ && pending_->id == e.prepared)) {
    out.push_back(DeciderAction::SendAbandon{{w}, AbandonMsg{e.prepared}});
  }
  if (phase_ == Phase::kPreparing && pending_ && !choosing_ && IsParticipant(w) &&
      !reports_.count(w)) {
    // Its Prepare, or its report, may be lost: the prepare again (the agent answers a duplicate
    // with the same report).
    out.push_back(DeciderAction::SendPrepare{{w}, PrepareMessage()});
  } else if (phase_ == Phase::kCommitted && pending_ && IsParticipant(w) && !answered_.count(w)) {
    if (e.generation == pending_->id) {
      // It switched: its Applied died with the leader.
      OnApplied(AppliedMsg{.worker = w, .generation = pending_->id, .ok = true}, out);
    } else if (e.awaiting_outcome != pending_->id) {
      out.push_back(DeciderAction::SendCommit{{w}, CommitMessage()});
    }  // else its Applied(false) comes again after the rejoin
  }
  if (!workers_.count(w)) return;  // answered and gone (an exiting worker)
  if (e.leaving) OnLeave(w, out);
  if (e.done && workers_.count(w)) OnDone(w, out);
}

void Decider::OnStaleReport(const StepReportMsg& m, Out& out) {
  if (!resumed_ || m.generation <= 0 || m.generation > last_id_) return;
  if (pending_ && pending_->id == m.generation) return;  // committed: a duplicate
  if (m.generation <= current_.id || !workers_.count(m.worker)) return;
  out.push_back(DeciderAction::SendAbandon{{m.worker}, AbandonMsg{m.generation}});
}

void Decider::OnRejoinDeadline(int64_t now_ms, Out& out) {
  if (rejoin_deadline_ms_ < 0 || now_ms < rejoin_deadline_ms_) return;
  rejoin_deadline_ms_ = -1;
  std::vector<WorkerId> missing(rejoin_waiting_.begin(), rejoin_waiting_.end());
  rejoin_waiting_.clear();
  for (WorkerId w : missing) {
    if (!workers_.count(w)) continue;
    if (phase_ == Phase::kFailed || phase_ == Phase::kComplete || phase_ == Phase::kStopped) break;
    std::string reason = "did not reconnect to the new coordinator within " +
                         std::to_string(options_.rejoin_timeout_ms) + " ms";
    out.push_back(DeciderAction::Disconnect{w, reason});
    OnLost(w, reason, out);
  }
}

}  // namespace morph
