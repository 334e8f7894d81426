// Private to the coordinator (not installed): Coordinator::Impl and one worker's control
// connection, shared by coordinator.cc (options, starting and stopping, the control channel's
// I/O, the public calls) and coordinator_decide.cc (the decider's events and actions, the tick,
// the same-host process watch, the published snapshot). Everything here runs on the io thread
// unless a member's comment says otherwise.
#ifndef MORPH_RUNTIME_COORDINATOR_COORDINATOR_IMPL_H_
#define MORPH_RUNTIME_COORDINATOR_COORDINATOR_IMPL_H_

#include <time.h>

#include <array>
#include <atomic>

#include <nlohmann/json.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

// clang-format off
// <utility> first: this Boost's asio/awaitable.hpp uses std::exchange without including it.
#include <utility>
#include <boost/asio.hpp>
// clang-format on

#include "base/connection_limit.h"
#include "base/logging.h"
#include "runtime/coordinator/coordinator.h"
#include "runtime/coordinator/process_watch.h"
#include "runtime/ha/election.h"
#include "runtime/protocol/wire.h"

namespace morph {
namespace coordinator_internal {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;

// Body bytes read per syscall: a body buffer grows by at most this beyond what arrived.
constexpr size_t kReadChunk = 64u << 10;
// A worker that lets this much of our output pile up unread is dropped (lost).
constexpr size_t kMaxQueuedBytes = size_t{256} << 20;
// The snapshot is republished at most this often.
constexpr auto kPublishInterval = std::chrono::milliseconds(50);
// The most steps a generation is believed to train per millisecond: the step it reports is at
// most its start step plus this many per millisecond since it began.
constexpr int64_t kMaxStepsPerMs = 10;

inline double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

inline std::string JoinHostPort(const std::string& host, uint16_t port) {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline std::string Ids(const std::vector<WorkerId>& v, size_t max = 16) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size() && i < max; ++i) os << (i ? "," : "") << v[i];
  if (v.size() > max) os << ",... (" << v.size() << ")";
  os << "]";
  return os.str();
}

// Resume at start, on the planner thread: the checkpoint the job of registration `manifest`
// resumes from (nullopt: a fresh start), or why it cannot start.
using ResumeFinder =
    std::function<StatusOr<std::optional<RecoveryCheckpoint>>(const JobManifest& manifest)>;

// The newest checkpoint in `dir` that is complete, holds exactly the registration and verifies
// whole (NewestIntactCheckpoint: a damaged newer one is passed over with a WARNING naming it and
// the steps that costs). `resumed` gets the one chosen (a recovery may roll back to it).
ResumeFinder FolderResumeFinder(std::string dir,
                                std::shared_ptr<std::optional<RecoveryCheckpoint>> resumed);
// The checkpoint `latest` (CoordinatorOptions::latest_checkpoint) names, if it holds exactly the
// registration and verifies whole; no fallback (it names one). Null when `latest` is.
ResumeFinder CallbackResumeFinder(std::function<std::optional<RecoveryCheckpoint>()> latest);

// Resume at start, on the planner thread (coordinator_decide.cc): `find`'s answer as the
// decider's event (no finder: a fresh start).
DeciderEvent::ResumeReady ResumeCheckpoint(int64_t generation,
                                           const std::shared_ptr<const JobManifest>& manifest,
                                           const ResumeFinder& find);

// ---- one worker's control connection ---------------------------------------------------------
struct Conn : std::enable_shared_from_this<Conn> {
  enum class State { kHello, kRegister, kJoined, kClosed };
  Conn(asio::io_context& io, tcp::socket s) : sock(std::move(s)), timer(io) {}

  tcp::socket sock;
  asio::steady_timer timer;  // the handshake deadline
  State state = State::kHello;
  // Its place among the connections that have not said Hello yet (Impl::waiting_).
  std::optional<PreAuthQueue<std::shared_ptr<Conn>>::Handle> waiting;
  WorkerId id = 0;
  std::string host;
  int64_t pid = 0;  // as the Hello said
  WorkerId resume_id = 0;  // as the Hello said: a worker reconnecting to a successor
  // A same-host worker proven to hold this connection (process_watch.h), and how many watch
  // ticks in a row have seen its process exiting.
  std::optional<WatchedProcess> watched;
  int exiting_ticks = 0;
  std::array<char, kFrameHeaderBytes> header{};
  FrameHeader hdr;
  std::string body;
  struct Out {
    std::shared_ptr<const std::string> frame;
    bool commit = false;
  };
  std::deque<Out> out;
  size_t queued_bytes = 0;
  bool writing = false;
  bool close_after_write = false;
  bool gone_reported = false;  // the decider knows it is gone (or must not be told)
  bool socket_closed = false;
};

}  // namespace coordinator_internal

using namespace coordinator_internal;  // the two files that include this header

class Coordinator::Impl : public std::enable_shared_from_this<Coordinator::Impl> {
 public:
  // `resume_finder`: where resume at start finds its checkpoint (null: the one
  // latest_checkpoint names, if set).
  Impl(CoordinatorOptions options, ResumeFinder resume_finder)
      : options_(std::move(options)),
        resume_finder_(resume_finder ? std::move(resume_finder)
                                     : CallbackResumeFinder(options_.latest_checkpoint)),
        decider_(MakeDeciderOptions()),
        acceptor_(io_),
        accept_backoff_(io_),
        tick_(io_),
        watch_timer_(io_),
        publish_timer_(io_),
        epoch_(Clock::now()) {
    if (options_.manifest) manifest_ = std::make_shared<const JobManifest>(*options_.manifest);
  }

  Status Start();
  void Stop();

  // ---- io thread ----
  void Accept();
  // Closes the connection that has waited longest for its Hello (a stranger, most likely).
  void DropOldestWaiting();
  // `c` said Hello with the token, or closed: it no longer counts against the cap.
  void StopWaiting(Conn& c);
  void ReadHeader(const std::shared_ptr<Conn>& c);
  void ReadBody(const std::shared_ptr<Conn>& c);
  void OnFrame(const std::shared_ptr<Conn>& c, WireMessage m);
  void OnHello(const std::shared_ptr<Conn>& c, const HelloMsg& m);
  void OnRegister(const std::shared_ptr<Conn>& c, RegisterMsg m);
  void Refuse(const std::shared_ptr<Conn>& c, const Status& s);
  void Enqueue(const std::shared_ptr<Conn>& c, std::shared_ptr<const std::string> frame,
               bool commit = false);
  void DoWrite(const std::shared_ptr<Conn>& c);
  void CloseSocket(const std::shared_ptr<Conn>& c);
  // The connection ended: the decider hears of a registered worker's loss once.
  void Gone(const std::shared_ptr<Conn>& c, const std::string& reason);
  void Feed(DeciderEvent::Any event);
  // Every resize, whichever door it came in by (the scheduler API, Coordinator::Resize): numbered
  // from one counter, its answer kept for the decider's AnswerResize, fed to the decider. Returns
  // the id. io thread.
  int64_t SubmitResize(ResizeRequest request, std::function<void(Status)> answer,
                       std::string_view via);
  void Execute(DeciderAction::Any& a);
  template <typename M>
  void SendTo(const std::vector<WorkerId>& to, const M& msg, bool commit = false);
  void ArmTick();
  // Same-host workers whose process exits before its connection closes (process_watch.h).
  void MaybeWatch(const std::shared_ptr<Conn>& c);
  void ArmWatch();
  void Watch();
  // The current generation's step (/v1/status "step", morph_step): the least of its members'
  // latest heartbeat steps, at least its start step and at most kMaxStepsPerMs per millisecond
  // since it began; one member's claim cannot move it, and it starts over at every change.
  void FollowGeneration();  // after each event: a new generation resets the members' steps
  void NoteStep(WorkerId worker, int64_t step);
  int64_t GenerationStep() const;
  void MarkDirty();
  CoordinatorSnapshot BuildSnapshot() const;
  void Publish();
  void Finish(Status s);
  // The job ended without completing: every connection gets ErrorMsg{code, message}, then closes.
  void EndEveryConnection(StatusCode code, const std::string& message);
  // ---- coordinator failover (coordinator_ha.cc) ----
  bool ha() const { return options_.etcd.has_value(); }
  // Start(): campaigns (the election's callbacks post OnElected / OnDeposed to the io thread).
  Status StartCampaign();
  void OnElected(const EtcdFence& fence);  // restores the persisted state, then leads
  // Stops leading: closes every connection, forgets the decider's state, and (unless the
  // election deposed it) resigns so that another candidate may lead.
  void StepDown(const Status& why, bool resign);
  // After the decider handled an event: writes its state, fenced, if it changed. False when the
  // write failed (this coordinator stepped down: carry out nothing).
  bool Persist();
  std::string SavedState() const;
  // The job's record in its saved state: its token's digest and its settings (initial and
  // largest world, heartbeat and rejoin timeouts), so that a candidate of another job refuses to
  // lead it and a successor keeps the job's settings, not its own.
  nlohmann::json JobRecord() const;
  // A saved record of another job: kFailedPrecondition naming both digests' heads. Otherwise
  // this candidate takes the job's settings (a WARNING for each that differed).
  Status AdoptJobRecord(const nlohmann::json& job);
  // A Register from a worker with a Hello resume_id (a successor's rejoin). Returns after
  // refusing or welcoming it.
  void OnResumeRegister(const std::shared_ptr<Conn>& c, const RegisterMsg& m);
  void SendWelcome(const std::shared_ptr<Conn>& c);
  DeciderOptions MakeDeciderOptions() const;
  int64_t NowMs() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - epoch_).count();
  }

  CoordinatorOptions options_;
  ResumeFinder resume_finder_;  // planner thread
  std::string advertise_host_;
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  std::thread io_thread_;
  asio::thread_pool planner_{1};
  asio::thread_pool launcher_{1};
  Decider decider_;
  LogContext log_{"coordinator"};  // "[g4 r-/8 coordinator] ": the committed generation
  tcp::acceptor acceptor_;
  asio::steady_timer accept_backoff_;
  // Connections that have not said Hello yet, oldest first, at most PreAuthCap(...).
  PreAuthQueue<std::shared_ptr<Conn>> waiting_;
  // One line per 10 s each under a flood: failed accepts, strangers dropped at the cap, and
  // strangers refused at their first frame.
  WarningLimiter accept_warnings_, drop_warnings_, refuse_warnings_;
  asio::steady_timer tick_;
  asio::steady_timer watch_timer_;
  bool watch_armed_ = false;
  size_t watched_ = 0;          // connections with a WatchedProcess (io thread)
  std::string local_hostname_;  // what a same-host worker's Hello says
  asio::steady_timer publish_timer_;
  bool publish_armed_ = false;
  std::unique_ptr<TcpStoreServer> store_;
  std::unique_ptr<HttpServer> http_;
  uint16_t port_ = 0;
  uint16_t http_port_ = 0;
  const Clock::time_point epoch_;
  bool stopping_ = false;                 // io thread
  std::deque<DeciderEvent::Any> events_;  // io thread: events waiting for Feed's loop
  bool feeding_ = false;
  std::optional<Status> ended_;  // io thread: the job completed (OK) or failed
  clockid_t io_clock_{};
  std::atomic<bool> has_io_clock_{false};

  std::unique_ptr<Election> election_;
  bool leading_ = true;      // io thread; false while an HA candidate follows
  std::atomic<bool> leading_flag_{true};
  EtcdFence fence_;          // io thread: the leadership the state writes are fenced on
  std::string saved_;        // io thread: the state last written
  std::string manifest_frame_;  // the manifest as a Register frame, for the saved state
  std::atomic<int64_t> successions_{0}, etcd_writes_{0}, etcd_write_us_{0},
      etcd_write_max_us_{0};

  std::shared_ptr<const JobManifest> manifest_;
  WorkerId next_worker_ = 1;
  std::map<WorkerId, std::shared_ptr<Conn>> conns_;  // registered, connected
  // The hosts of conns_ (/v1/status), checked by CheckHostName; erased with the connection.
  std::unordered_map<WorkerId, std::string> hosts_;
  // GenerationStep's input: the generation followed, since when (NowMs), and each of its
  // members' latest heartbeat step (INT64_MIN: none yet).
  int64_t step_generation_ = -1;
  int64_t step_since_ms_ = 0;
  std::unordered_map<WorkerId, int64_t> member_steps_;
  int64_t next_request_id_ = 1;
  std::map<int64_t, std::function<void(Status)>> answers_;

  // The change in progress, for its phase timings (io thread).
  struct ChangeTiming {
    int64_t from_generation = 0;
    int from_world = 0;
    Clock::time_point planned, prepared, committed;
    double plan_ms = 0;
    bool has_prepare = false;
    AppliedMsg::Phases slowest;  // per phase, the most any participant reported
  };
  std::optional<ChangeTiming> timing_;
  int64_t reconfigurations_ = 0;
  std::optional<ReconfigurationRecord> last_record_;

  // Shared with other threads.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Status> result_;  // the job's end
  bool stopped_ = false;
  CoordinatorSnapshot published_;
  std::atomic<int64_t> accepted_{0}, refused_{0}, registered_{0}, connected_{0}, received_{0},
      sent_{0}, commits_sent_{0}, dropped_{0}, hosts_known_{0};
};

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_COORDINATOR_IMPL_H_
