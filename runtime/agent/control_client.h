// ControlClient: a worker's end of the control channel (runtime/protocol/wire.h) to the
// coordinator, used by the agent's control thread. Blocking calls on one TCP connection; every
// wait is bounded by a Deadline.
//
//   MORPH_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> c,
//       ControlClient::Connect("10.0.0.1:29400", HelloMsg{.token = token, .host = host},
//                              RegisterMsg{.manifest = state.Manifest()},
//                              Deadline::AfterMs(30000)));
//   WorkerId me = c->welcome().worker;
//   MORPH_RETURN_IF_ERROR(c->Send(HeartbeatMsg{.step = step}));      // any thread
//   StatusOr<WireMessage> m = c->Receive(Deadline::AfterMs(100));    // one thread
//
// Handshake: Hello, then Register; the coordinator answers Welcome, or an ErrorMsg and closes
// (wrong token: kUnauthenticated; a manifest that differs from the job's: kFailedPrecondition
// naming the first difference; another wire version: kFailedPrecondition; an invalid manifest:
// kInvalidArgument).
//
// Threads: Send and Close from any thread (Send is serialized internally); Receive from one
// thread at a time. Destroy when no call is in flight.
#ifndef MORPH_RUNTIME_AGENT_CONTROL_CLIENT_H_
#define MORPH_RUNTIME_AGENT_CONTROL_CLIENT_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "morph/deadline.h"
#include "morph/status.h"
#include "runtime/protocol/wire.h"

namespace morph {

class ControlClient {
 public:
  // Connects to "host:port" ("[v6]:port" for IPv6; a name is resolved once), retrying refused
  // connections until `deadline` (the coordinator may still be starting), sends Hello then
  // Register and waits for Welcome. Errors: the coordinator's ErrorMsg as a Status (its code and
  // message); kDeadlineExceeded when no Welcome came in time; kUnavailable when it cannot
  // connect or the connection closed; kInvalidArgument for a malformed address or an unknown
  // host, or a malformed frame from the coordinator.
  static StatusOr<std::unique_ptr<ControlClient>> Connect(const std::string& address,
                                                          const HelloMsg& hello,
                                                          const RegisterMsg& reg,
                                                          Deadline deadline);
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  const WelcomeMsg& welcome() const { return welcome_; }
  const std::string& address() const { return address_; }

  // Sends one frame (whole, or the connection is closed). kUnavailable once the connection is
  // closed (by Close, by the peer, or by a failed write). Any thread.
  Status Send(const WireMessage& m);
  // The next frame, blocking until `deadline`: kDeadlineExceeded when none came in time (the
  // connection stays usable; a partly received frame is kept for the next call); kUnavailable
  // when the connection closed (its message includes the coordinator's ErrorMsg if one came:
  // see last_error()); kInvalidArgument for a malformed frame (the connection is then closed).
  // An ErrorMsg from the coordinator is not returned as a message: it closes the connection and
  // Receive returns kUnavailable. One thread at a time.
  StatusOr<WireMessage> Receive(Deadline deadline);
  // Data sent and left unacknowledged for `timeout` closes the connection (TCP_USER_TIMEOUT):
  // then Send and Receive return kUnavailable. With heartbeats going out, a coordinator whose
  // host went silent (link down, host frozen: no connection closes) is noticed within
  // `timeout` instead of TCP's retransmission limit (about 15 minutes). 0: the kernel's
  // default. kInternal when the socket refuses the option. Any thread.
  Status SetUnackedTimeout(std::chrono::milliseconds timeout);
  // Closes the connection; a blocked Receive returns kUnavailable promptly. Any thread;
  // idempotent.
  void Close();
  bool closed() const { return closed_.load(); }
  // The ErrorMsg the coordinator sent before closing, if any. After Receive returned
  // kUnavailable (the receiving thread).
  const std::optional<ErrorMsg>& last_error() const { return last_error_; }

 private:
  ControlClient(int fd, std::string address);
  Status SendFrame(const std::string& frame);
  // Reads into in_ until it holds `want` bytes; kDeadlineExceeded / kUnavailable.
  Status Fill(size_t want, Deadline deadline);
  Status ClosedStatus() const;

  const int fd_;
  const std::string address_;
  WelcomeMsg welcome_;
  std::mutex send_mu_;
  std::atomic<bool> closed_{false};
  std::mutex close_mu_;
  // Receive side (one thread).
  std::string in_;  // bytes of the frame being received
  std::optional<FrameHeader> header_;
  std::optional<ErrorMsg> last_error_;
  std::string close_reason_;  // why the connection is closed (receive side)
};

}  // namespace morph

#endif  // MORPH_RUNTIME_AGENT_CONTROL_CLIENT_H_
