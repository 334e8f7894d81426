#include "runtime/coordinator/process_watch.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace morph {
namespace {

constexpr uint64_t kPfExiting = 0x4;  // include/linux/sched.h: getting shut down

// The whole of a small /proc file; nullopt with errno set when it cannot be read.
std::optional<std::string> ReadProcFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      int saved = errno;
      ::close(fd);
      errno = saved;
      return std::nullopt;
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

// How /proc/net/tcp{,6} prints an address: each 32-bit word of the network-order bytes as the
// host reads it, in hex; then the port in host order.
std::string ProcNetTcpEnd(const SocketEnd& end) {
  std::string out;
  char word[9];
  for (size_t i = 0; i + 4 <= end.address.size(); i += 4) {
    uint32_t w;
    std::memcpy(&w, end.address.data() + i, 4);
    std::snprintf(word, sizeof(word), "%08X", w);
    out += word;
  }
  char port[6];
  std::snprintf(port, sizeof(port), "%04X", static_cast<unsigned>(end.port));
  return out + ":" + port;
}

bool ExitingOrZombie(const ProcStat& s) {
  return (s.flags & kPfExiting) != 0 || s.state == 'Z' || s.state == 'X' || s.state == 'x';
}

// Every thread of `pid` is exiting or a zombie (the leader alone may have called pthread_exit).
bool AllThreadsExiting(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return errno == ENOENT;  // reaped meanwhile
  bool all = true;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::optional<std::string> text = ReadProcFile(dir + "/" + e->d_name + "/stat");
    if (!text) continue;  // that thread finished meanwhile
    std::optional<ProcStat> s = ParseProcStat(*text);
    if (s && !ExitingOrZombie(*s)) {
      all = false;
      break;
    }
  }
  ::closedir(d);
  return all;
}

}  // namespace

std::optional<ProcStat> ParseProcStat(std::string_view text) {
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so fields count from
  // the last ')'.
  size_t close = text.rfind(')');
  if (close == std::string_view::npos) return std::nullopt;
  std::vector<std::string_view> fields;
  size_t i = close + 1;
  while (i < text.size() && fields.size() < 20) {
    while (i < text.size() && (text[i] == ' ' || text[i] == '\n')) ++i;
    size_t j = i;
    while (j < text.size() && text[j] != ' ' && text[j] != '\n') ++j;
    if (j > i) fields.push_back(text.substr(i, j - i));
    i = j;
  }
  // fields[0] is field 3 (state), fields[6] field 9 (flags), fields[19] field 22 (starttime).
  if (fields.size() < 20 || fields[0].size() != 1) return std::nullopt;
  auto number = [](std::string_view f, uint64_t* out) {
    if (f.empty()) return false;
    uint64_t v = 0;
    for (char c : f) {
      if (c < '0' || c > '9') return false;
      v = v * 10 + static_cast<uint64_t>(c - '0');
    }
    *out = v;
    return true;
  };
  ProcStat s;
  s.state = fields[0][0];
  if (!number(fields[6], &s.flags) || !number(fields[19], &s.start_time)) return std::nullopt;
  return s;
}

std::optional<uint64_t> FindTcpInode(std::string_view table, const SocketEnd& local,
                                     const SocketEnd& remote) {
  const std::string want_local = ProcNetTcpEnd(local), want_remote = ProcNetTcpEnd(remote);
  size_t pos = 0;
  while (pos < table.size()) {
    size_t end = table.find('\n', pos);
    if (end == std::string_view::npos) end = table.size();
    std::string_view line = table.substr(pos, end - pos);
    pos = end + 1;
    // "sl local rem st tx:rx tr:when retrnsmt uid timeout inode ..."
    std::vector<std::string_view> f;
    size_t i = 0;
    while (i < line.size() && f.size() < 10) {
      while (i < line.size() && line[i] == ' ') ++i;
      size_t j = i;
      while (j < line.size() && line[j] != ' ') ++j;
      if (j > i) f.push_back(line.substr(i, j - i));
      i = j;
    }
    if (f.size() < 10 || f[1] != want_local || f[2] != want_remote) continue;
    uint64_t inode = 0;
    for (char c : f[9]) {
      if (c < '0' || c > '9') return std::nullopt;
      inode = inode * 10 + static_cast<uint64_t>(c - '0');
    }
    return inode != 0 ? std::optional<uint64_t>(inode) : std::nullopt;
  }
  return std::nullopt;
}

std::optional<WatchedProcess> VerifyPeerProcess(pid_t pid, const SocketEnd& ours,
                                                const SocketEnd& theirs) {
  if (pid <= 0) return std::nullopt;
  const bool v4 = theirs.address.size() == 4;
  if (!v4 && theirs.address.size() != 16) return std::nullopt;
  std::optional<std::string> table = ReadProcFile(v4 ? "/proc/net/tcp" : "/proc/net/tcp6");
  if (!table) return std::nullopt;
  // The worker's socket: its local end is our remote one.
  std::optional<uint64_t> inode = FindTcpInode(*table, theirs, ours);
  if (!inode) return std::nullopt;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  const std::string want = "socket:[" + std::to_string(*inode) + "]";
  DIR* d = ::opendir(fd_dir.c_str());
  if (d == nullptr) return std::nullopt;
  bool found = false;
  char target[64];
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    ssize_t n = ::readlinkat(::dirfd(d), e->d_name, target, sizeof(target) - 1);
    if (n > 0 && want == std::string_view(target, static_cast<size_t>(n))) {
      found = true;
      break;
    }
  }
  ::closedir(d);
  if (!found) return std::nullopt;
  std::optional<std::string> stat = ReadProcFile("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return std::nullopt;
  std::optional<ProcStat> s = ParseProcStat(*stat);
  if (!s || ExitingOrZombie(*s)) return std::nullopt;
  return WatchedProcess{.pid = pid, .start_time = s->start_time};
}

bool ProcessGone(const WatchedProcess& p) {
  std::optional<std::string> text = ReadProcFile("/proc/" + std::to_string(p.pid) + "/stat");
  if (!text) return errno == ENOENT || errno == ESRCH;  // reaped: it was ours (verified)
  std::optional<ProcStat> s = ParseProcStat(*text);
  if (!s) return false;
  if (s->start_time != p.start_time) return true;  // the pid names another process now
  if (!ExitingOrZombie(*s)) return false;
  return AllThreadsExiting(p.pid);
}

}  // namespace morph
