#include "runtime/agent/control_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "base/host_port.h"

namespace morph {
namespace {

// A write that makes no progress for this long means the coordinator stopped reading.
constexpr auto kSendStallTimeout = std::chrono::seconds(30);
// Blocking waits poll in slices this long, so Close is seen even where shutdown() does not wake
// a poller.
constexpr int kPollSliceMs = 100;
constexpr size_t kReadChunk = 64u << 10;


struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};

StatusOr<std::vector<sockaddr_storage>> Resolve(const HostPort& hp, const std::string& address,
                                                std::vector<socklen_t>& lens) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(hp.host.c_str(), hp.port.c_str(), &hints, &found);
  if (rc == EAI_NONAME || rc == EAI_SERVICE
#ifdef EAI_NODATA
      || rc == EAI_NODATA
#endif
  ) {
    return InvalidArgumentError("coordinator address '" + address + "': host '" + hp.host +
                                "' is not known: " + gai_strerror(rc));
  }
  if (rc != 0) {
    return UnavailableError("coordinator address '" + address + "': cannot resolve '" + hp.host +
                            "': " + gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, AddrInfoDeleter> owner(found);
  std::vector<sockaddr_storage> out;
  // IPv4 first: a server given a name usually listens on its IPv4 address.
  for (int pass = 0; pass < 2; ++pass) {
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      if ((a->ai_family == AF_INET) != (pass == 0)) continue;
      sockaddr_storage s{};
      std::memcpy(&s, a->ai_addr, a->ai_addrlen);
      out.push_back(s);
      lens.push_back(a->ai_addrlen);
    }
  }
  if (out.empty()) return UnavailableError("coordinator address '" + address + "': no addresses");
  return out;
}

int PollMs(Deadline deadline) {
  return static_cast<int>(std::min<long long>(deadline.RemainingMs(), kPollSliceMs));
}

// One non-blocking connect bounded by `deadline`: the fd, or kUnavailable (refused, reset,
// unreachable) / kDeadlineExceeded.
StatusOr<int> ConnectOnce(const sockaddr_storage& addr, socklen_t len, Deadline deadline,
                          const std::string& address) {
  int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return UnavailableError(std::string("socket: ") + std::strerror(errno));
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len);
  if (rc != 0 && errno != EINPROGRESS) {
    int err = errno;
    ::close(fd);
    return UnavailableError("connecting to coordinator " + address + ": " + std::strerror(err));
  }
  if (rc != 0) {
    while (true) {
      pollfd p{fd, POLLOUT, 0};
      int n = ::poll(&p, 1, PollMs(deadline));
      if (n > 0) break;
      if (n < 0 && errno != EINTR) {
        int err = errno;
        ::close(fd);
        return UnavailableError(std::string("poll: ") + std::strerror(err));
      }
      if (deadline.Expired()) {
        ::close(fd);
        return DeadlineExceededError("connecting to coordinator " + address + ": timed out");
      }
    }
    int err = 0;
    socklen_t el = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err != 0) {
      ::close(fd);
      return UnavailableError("connecting to coordinator " + address + ": " + std::strerror(err));
    }
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  return fd;
}

}  // namespace

StatusOr<std::unique_ptr<ControlClient>> ControlClient::Connect(const std::string& address,
                                                                const HelloMsg& hello,
                                                                const RegisterMsg& reg,
                                                                Deadline deadline) {
  MORPH_ASSIGN_OR_RETURN(HostPort hp, SplitHostPort("coordinator address", address));
  std::vector<socklen_t> lens;
  MORPH_ASSIGN_OR_RETURN(std::vector<sockaddr_storage> addrs, Resolve(hp, address, lens));
  auto backoff = std::chrono::milliseconds(2);
  int fd = -1;
  while (fd < 0) {
    Status last;
    for (size_t i = 0; i < addrs.size() && fd < 0; ++i) {
      StatusOr<int> r = ConnectOnce(addrs[i], lens[i], deadline, address);
      if (r.ok()) {
        fd = *r;
      } else {
        last = r.status();
        if (last.code() != StatusCode::kUnavailable) return last;
      }
    }
    if (fd >= 0) break;
    // Refused: the coordinator may still be starting. Retry until the deadline.
    if (deadline.Remaining() < backoff) {
      return last.WithContext("coordinator " + address + " not reachable in time");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
  std::unique_ptr<ControlClient> c(new ControlClient(fd, address));
  MORPH_RETURN_IF_ERROR(c->SendFrame(EncodeFrame(hello))) << "sending hello";
  MORPH_RETURN_IF_ERROR(c->SendFrame(EncodeFrame(reg))) << "sending registration";
  StatusOr<WireMessage> m = c->Receive(deadline);
  if (!m.ok()) {
    if (c->last_error_) {
      return Status(static_cast<StatusCode>(c->last_error_->code), c->last_error_->message);
    }
    if (m.status().code() == StatusCode::kDeadlineExceeded) {
      return DeadlineExceededError("coordinator " + address + " sent no welcome in time");
    }
    return m.status().WithContext("registering with coordinator " + address);
  }
  if (std::holds_alternative<ReleaseMsg>(*m)) {
    return CancelledError("coordinator " + address +
                          " released this worker at its registration: the job has ended");
  }
  if (!std::holds_alternative<WelcomeMsg>(*m)) {
    return InvalidArgumentError("coordinator " + address + " answered registration with " +
                                std::string(WireTypeName(static_cast<uint16_t>(m->index() + 1))) +
                                ", expected welcome");
  }
  c->welcome_ = std::get<WelcomeMsg>(*std::move(m));
  return c;
}

ControlClient::ControlClient(int fd, std::string address) : fd_(fd), address_(std::move(address)) {}

ControlClient::~ControlClient() {
  Close();
  ::close(fd_);
}

Status ControlClient::SetUnackedTimeout(std::chrono::milliseconds timeout) {
  const unsigned int ms = static_cast<unsigned int>(
      std::clamp<int64_t>(timeout.count(), 0, std::numeric_limits<int>::max()));
  if (::setsockopt(fd_, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms)) != 0) {
    return InternalError("control connection to " + address_ + ": TCP_USER_TIMEOUT " +
                         std::to_string(ms) + " ms: " + std::strerror(errno));
  }
  return Status::Ok();
}

void ControlClient::Close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (closed_.exchange(true)) return;
  ::shutdown(fd_, SHUT_RDWR);
}

Status ControlClient::ClosedStatus() const {
  std::string why = close_reason_.empty() ? "closed" : close_reason_;
  return UnavailableError("control connection to " + address_ + ": " + why);
}

Status ControlClient::Send(const WireMessage& m) { return SendFrame(EncodeFrame(m)); }

Status ControlClient::SendFrame(const std::string& frame) {
  std::lock_guard<std::mutex> lock(send_mu_);
  size_t done = 0;
  auto last_progress = std::chrono::steady_clock::now();
  while (done < frame.size()) {
    if (closed_.load()) {
      return UnavailableError("control connection to " + address_ + ": closed");
    }
    ssize_t n = ::send(fd_, frame.data() + done, frame.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (std::chrono::steady_clock::now() - last_progress > kSendStallTimeout) {
        Close();
        return UnavailableError("control connection to " + address_ +
                                ": the coordinator read nothing for 30 s");
      }
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, kPollSliceMs);
      continue;
    }
    int err = n < 0 ? errno : EPIPE;
    Close();
    return UnavailableError("control connection to " + address_ + ": " + std::strerror(err));
  }
  return Status::Ok();
}

Status ControlClient::Fill(size_t want, Deadline deadline) {
  char buf[kReadChunk];
  while (in_.size() < want) {
    if (closed_.load()) return ClosedStatus();
    size_t ask = std::min(want - in_.size(), kReadChunk);
    ssize_t n = ::recv(fd_, buf, ask, 0);
    if (n > 0) {
      in_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {
      if (close_reason_.empty() && !closed_.load()) close_reason_ = "closed by the coordinator";
      Close();
      return ClosedStatus();
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      if (close_reason_.empty()) close_reason_ = std::strerror(errno);
      Close();
      return ClosedStatus();
    }
    if (deadline.Expired()) {
      return DeadlineExceededError("no message from coordinator " + address_ + " in time");
    }
    pollfd p{fd_, POLLIN, 0};
    ::poll(&p, 1, PollMs(deadline));
  }
  return Status::Ok();
}

StatusOr<WireMessage> ControlClient::Receive(Deadline deadline) {
  if (closed_.load()) return ClosedStatus();
  if (!header_) {
    MORPH_RETURN_IF_ERROR(Fill(kFrameHeaderBytes, deadline));
    StatusOr<FrameHeader> h = DecodeHeader(in_);
    if (!h.ok()) {
      close_reason_ = "malformed frame: " + std::string(h.status().message());
      Close();
      return h.status();
    }
    header_ = *h;
    in_.reserve(kFrameHeaderBytes + std::min<size_t>(h->length, kReadChunk));
  }
  MORPH_RETURN_IF_ERROR(Fill(kFrameHeaderBytes + header_->length, deadline));
  StatusOr<WireMessage> m =
      DecodeBody(*header_, std::string_view(in_).substr(kFrameHeaderBytes));
  header_.reset();
  in_.clear();
  if (in_.capacity() > (1u << 20)) in_.shrink_to_fit();
  if (!m.ok()) {
    close_reason_ = "malformed frame: " + std::string(m.status().message());
    Close();
    return m.status();
  }
  if (const ErrorMsg* e = std::get_if<ErrorMsg>(&*m)) {
    last_error_ = *e;
    close_reason_ = "the coordinator closed it: " +
                    std::string(StatusCodeName(static_cast<StatusCode>(e->code))) + ": " +
                    e->message;
    Close();
    return ClosedStatus();
  }
  return m;
}

}  // namespace morph
