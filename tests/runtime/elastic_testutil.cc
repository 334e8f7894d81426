#include "tests/runtime/elastic_testutil.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "morph/dataset_cursor.h"

namespace morph::testing {

namespace fs = std::filesystem;

ParallelConfig Config(int dp, int tp, int pp) {
  ParallelConfig c{.dp = dp, .tp = tp, .pp = pp};
  c.stage_of_layer = *ParallelConfig::EvenStages(4, pp);
  return c;
}

std::string WorkerLogs(const fs::path& dir) {
  std::string out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".log") continue;
    std::ifstream in(e.path());
    std::stringstream s;
    s << in.rdbuf();
    std::string text = s.str();
    if (text.size() > 4000) text = "..." + text.substr(text.size() - 4000);
    out += "---- " + e.path().filename().string() + "\n" + text;
  }
  return out;
}

void CheckSamples(const fs::path& dir, int64_t steps, bool retrained) {
  std::map<int64_t, std::map<int, std::vector<int64_t>>> by_step;  // step -> dp rank -> samples
  std::map<int64_t, int> dp_of_step;
  std::map<int64_t, int64_t> gen_of_step;  // the latest generation that trained it
  for (const auto& [file, lines] : ReadSampleFiles(dir)) {
    for (const SampleLine& line : lines) {
      const int64_t s = line.step, g = line.generation, dp = line.dp, d = line.dp_rank;
      const std::vector<int64_t>& xs = line.samples;
      if (retrained) {
        auto it = gen_of_step.find(s);
        if (it != gen_of_step.end() && it->second > g) continue;  // superseded
        if (it != gen_of_step.end() && it->second < g) {
          by_step[s].clear();  // trained again in a later generation
          dp_of_step.erase(s);
        }
        gen_of_step[s] = g;
      }
      ASSERT_FALSE(by_step[s].count(static_cast<int>(d)))
          << "step " << s << " dp rank " << d << " trained twice";
      by_step[s][static_cast<int>(d)] = xs;
      if (dp_of_step.count(s)) {
        ASSERT_EQ(dp_of_step[s], dp) << "step " << s;
      }
      dp_of_step[s] = static_cast<int>(dp);
    }
  }
  ASSERT_EQ(static_cast<int64_t>(by_step.size()), steps) << WorkerLogs(dir);
  std::vector<int64_t> stream;
  for (auto& [s, ranks] : by_step) {
    ASSERT_EQ(static_cast<int>(ranks.size()), dp_of_step[s]) << "step " << s;
    for (auto& [d, xs] : ranks) stream.insert(stream.end(), xs.begin(), xs.end());
  }
  ASSERT_EQ(static_cast<int64_t>(stream.size()), steps * kElasticBatch);
  for (size_t e = 0; e + kElasticSamples <= stream.size(); e += kElasticSamples) {
    std::set<int64_t> epoch(stream.begin() + e, stream.begin() + e + kElasticSamples);
    EXPECT_EQ(static_cast<int64_t>(epoch.size()), kElasticSamples) << "epoch at " << e;
    EXPECT_EQ(*epoch.begin(), 0);
    EXPECT_EQ(*epoch.rbegin(), kElasticSamples - 1);
  }
  StatusOr<DatasetCursor> cursor = DatasetCursor::Create(
      {.num_samples = kElasticSamples, .global_batch = kElasticBatch, .seed = 7});
  ASSERT_TRUE(cursor.ok());
  for (size_t p = 0; p < stream.size(); ++p) {
    ASSERT_EQ(stream[p], cursor->SampleAt(static_cast<int64_t>(p))) << "position " << p;
  }
}

pid_t SpawnProcess(const std::vector<std::string>& argv,
                   const std::map<std::string, std::string>& env, const std::string& log) {
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (std::string& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  pid_t pid = fork();
  if (pid != 0) return pid;
  setpgid(0, 0);
  for (const auto& [k, v] : env) {
    if (v.empty()) {
      unsetenv(k.c_str());
    } else {
      setenv(k.c_str(), v.c_str(), 1);
    }
  }
  int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
  execv(cargv[0], cargv.data());
  _exit(127);
}

uint16_t WaitForMorphdApiPort(const std::filesystem::path& out, int64_t timeout_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    std::istringstream in(ReadFile(out));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("{\"control\":", 0) != 0) continue;
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) return static_cast<uint16_t>(j.value("http_port", 0));
    }
    if (std::chrono::steady_clock::now() >= until) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::map<std::string, std::vector<SampleLine>> ReadSampleFiles(const fs::path& dir) {
  std::map<std::string, std::vector<SampleLine>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".samples") continue;
    const std::string text = ReadFile(e.path());
    auto& lines = out[e.path().filename().string()];
    size_t at = 0;
    for (size_t end = text.find('\n'); end != std::string::npos; end = text.find('\n', at)) {
      std::istringstream l(text.substr(at, end - at));  // a line still being written: left out
      at = end + 1;
      SampleLine x;
      if (!(l >> x.step >> x.generation >> x.dp >> x.dp_rank)) continue;
      for (int64_t s; l >> s;) x.samples.push_back(s);
      lines.push_back(std::move(x));
    }
  }
  return out;
}

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

std::optional<int> WaitExit(pid_t pid, int64_t timeout_ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return std::nullopt;
    if (std::chrono::steady_clock::now() >= until) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void Stop(pid_t pid, int64_t grace_ms) {
  if (pid <= 0) return;
  if (kill(pid, SIGTERM) != 0) return;
  if (WaitExit(pid, grace_ms)) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

int Sh(const std::string& cmd, std::string* out) {
  std::string full = cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (p == nullptr) return -1;
  std::string text;
  char buf[512];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) text.append(buf, n);
  int rc = pclose(p);
  if (out != nullptr) *out = text;
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int CoordinatorLostLines(const std::string& log) {
  int n = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    n += line.rfind("elastic_worker ", 0) == 0 &&
         line.find(": UNAVAILABLE: ") != std::string::npos &&
         line.find("connection to the coordinator lost") != std::string::npos;
  }
  return n;
}

std::vector<std::string> NumbersAfter(const std::string& text, const std::string& before) {
  // No std::regex: GCC 12's <regex> trips -Wmaybe-uninitialized under the sanitizer build's
  // -O2 -Werror.
  std::vector<std::string> out;
  for (size_t at = text.find(before); at != std::string::npos; at = text.find(before, at + 1)) {
    size_t b = at + before.size(), e = b;
    while (e < text.size() && text[e] >= '0' && text[e] <= '9') ++e;
    if (e > b) out.push_back(text.substr(b, e - b));
  }
  return out;
}

bool ReadCoordinatorFile(const fs::path& path, std::string& address, std::string& token,
                         int64_t timeout_ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    std::string text = ReadFile(path);
    size_t nl = text.find('\n');
    if (nl != std::string::npos && text.back() == '\n') {
      address = text.substr(0, nl);
      token = text.substr(nl + 1, text.size() - nl - 2);
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

HttpReply Http(uint16_t port, const std::string& method, const std::string& target,
               const std::string& body, const std::string& token) {
  HttpReply reply;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return reply;
  timeval tv{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return reply;
  }
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  if (!token.empty()) req += "Authorization: Bearer " + token + "\r\n";
  if (!body.empty() || method == "POST") {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\n";
  }
  req += "\r\n" + body;
  size_t sent = 0;
  while (sent < req.size()) {
    ssize_t n = send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      close(fd);
      return reply;
    }
    sent += static_cast<size_t>(n);
  }
  std::string in;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) in.append(buf, static_cast<size_t>(n));
  close(fd);
  // "HTTP/1.1 202 Accepted\r\n...\r\n\r\nbody"
  if (in.rfind("HTTP/1.1 ", 0) != 0 || in.size() < 12) return reply;
  reply.code = std::atoi(in.c_str() + 9);
  size_t head_end = in.find("\r\n\r\n");
  if (head_end != std::string::npos) reply.body = in.substr(head_end + 4);
  return reply;
}

nlohmann::json ApiStatus(uint16_t api_port) {
  HttpReply r = Http(api_port, "GET", "/v1/status");
  if (r.code != 200) return nullptr;
  return nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
}

bool WaitForStatus(uint16_t api_port, const std::function<bool(const nlohmann::json&)>& pred,
                   int64_t timeout_ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < until) {
    nlohmann::json s = ApiStatus(api_port);
    if (s.is_object() && pred(s)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

bool Stable(const nlohmann::json& s, int64_t generation, size_t world) {
  return s.value("generation", int64_t{0}) >= generation && !s.value("resize_in_progress", true) &&
         s.value("world_size", size_t{0}) == world &&
         (!s.contains("pending_generation") || s["pending_generation"].is_null());
}

uint16_t FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  uint16_t port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace morph::testing
