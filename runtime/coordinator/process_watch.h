// Seeing a same-host worker die before its connection drops. On SIGKILL the kernel tears down
// the process's memory (exit_mm) before it closes its files (exit_files), so a worker holding
// gigabytes keeps its control connection open for the hundreds of milliseconds that takes on a
// loaded host. The process is marked exiting (PF_EXITING in /proc/<pid>/stat) at the start of
// that, and never comes back: the coordinator watches its same-host workers there
// (CoordinatorOptions::local_watch_ms, MORPH_LOCAL_WATCH_MS) and treats an exiting one as a
// dropped connection. docs/design.md §4 "Failure", docs/operations.md.
//
// A pid is trusted only once it is proven to be the connection's process: at registration the
// connection's peer socket is looked up in /proc/net/tcp{,6} and must be among the pid's open
// files (a worker in another pid namespace, or one that sent a wrong pid, is not watched; the
// dropped connection still finds it). The process's start time is kept, so a reused pid is
// never mistaken for it.
//
//   std::optional<WatchedProcess> w = VerifyPeerProcess(pid, local_endpoint, remote_endpoint);
//   if (w && ProcessGone(*w)) { ... }   // every tick
//
// Linux only; every function returns "not proven" / false where /proc cannot be read.
#ifndef MORPH_RUNTIME_COORDINATOR_PROCESS_WATCH_H_
#define MORPH_RUNTIME_COORDINATOR_PROCESS_WATCH_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace morph {

// One end of a TCP connection: an IPv4 (4 bytes) or IPv6 (16 bytes) address, and a port.
struct SocketEnd {
  std::string address;  // raw bytes, network order
  uint16_t port = 0;
};

struct WatchedProcess {
  pid_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22 (clock ticks since boot)
};

// The fields of /proc/<pid>/stat this needs, parsed from its text. nullopt when malformed.
struct ProcStat {
  char state = '?';
  uint64_t flags = 0;
  uint64_t start_time = 0;
};
std::optional<ProcStat> ParseProcStat(std::string_view text);

// The socket inode of the TCP connection whose local end is `local` and remote end `remote`,
// from the text of /proc/net/tcp or /proc/net/tcp6. nullopt when no line matches.
std::optional<uint64_t> FindTcpInode(std::string_view table, const SocketEnd& local,
                                     const SocketEnd& remote);

// Whether process `pid` has the peer end of our connection (`ours` is this process's end,
// `theirs` the worker's) among its open files; then the process to watch.
std::optional<WatchedProcess> VerifyPeerProcess(pid_t pid, const SocketEnd& ours,
                                                const SocketEnd& theirs);

// Whether `p` is exiting or gone: marked exiting or a zombie (every thread: a thread group
// whose leader merely called pthread_exit lives on), or its pid now names another process or
// none. False when its stat cannot be read for another reason.
bool ProcessGone(const WatchedProcess& p);

}  // namespace morph

#endif  // MORPH_RUNTIME_COORDINATOR_PROCESS_WATCH_H_
