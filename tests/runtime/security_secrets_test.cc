// The job token stays secret (docs/operations.md "Security", "Secrets"): every program that
// reads it (morphd, a worker, morphctl, morphrun) runs as a user runs it, with the token in its
// environment and everything it prints captured; the token appears in none of it. morphrun hands
// its workers the token in a 0600 file (MORPH_TOKEN_FILE), never in their environment, and the
// worker logs it creates are 0600. params::Dump() and the one-time parameter line are
// params_test's. Bounded: every child has a deadline and is killed and reaped after it.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace morph {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

bool WaitFor(const std::function<bool()>& pred, int ms = 10000) {
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

constexpr char kSecret[] = "security-test-S3CRET-9f1c7a";

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Starts argv with every MORPH_* variable removed and `env` added, stdout and stderr to files.
pid_t SpawnLogged(const std::vector<std::string>& argv,
                  const std::map<std::string, std::string>& env, const std::string& out,
                  const std::string& err) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  for (char** e = environ; *e != nullptr;) {
    std::string kv = *e;
    if (kv.rfind("MORPH_", 0) == 0 || kv.rfind("GLOG_", 0) == 0) {
      ::unsetenv(kv.substr(0, kv.find('=')).c_str());
    } else {
      ++e;
    }
  }
  for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (o < 0 || e < 0) ::_exit(126);
  ::dup2(o, 1);
  ::dup2(e, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  ::_exit(127);
}

// The exit code of `pid` within `ms` (128 + signal when killed); -1 (and killed) when it ran on.
int WaitExit(pid_t pid, int ms) {
  int status = 0;
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

struct TempDir {
  TempDir() {
    char dir[] = "/tmp/morph_security_XXXXXX";
    path = ::mkdtemp(dir) != nullptr ? dir : "";
  }
  ~TempDir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  std::string path;
};

// morphd, a worker that joins it and morphctl, each with the token in its environment and
// everything it prints captured: the token appears nowhere, and morphctl prints only what it
// was asked for (no glog banner, no parameter lines).
TEST(SecurityTest, TheTokenIsNeverPrintedByMorphdAWorkerOrMorphctl) {
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string d = dir.path;
  pid_t morphd = SpawnLogged({MORPHD, "--initial-world", "1"}, {{"MORPH_TOKEN", kSecret}},
                             d + "/morphd.out", d + "/morphd.err");
  ASSERT_GT(morphd, 0);
  std::string line;
  ASSERT_TRUE(WaitFor([&] {
    line = Slurp(d + "/morphd.out");
    return line.find('\n') != std::string::npos;
  })) << Slurp(d + "/morphd.err");
  auto after = [&](const std::string& key) {
    size_t at = line.find(key);
    return at == std::string::npos ? std::string() : line.substr(at + key.size());
  };
  const std::string control = after("\"control\":\"").substr(0, after("\"control\":\"").find('"'));
  const std::string http_port =
      std::to_string(std::strtoul(after("\"http_port\":").c_str(), nullptr, 10));
  ASSERT_FALSE(control.empty()) << line;
  const std::map<std::string, std::string> ctl_env = {{"MORPH_TOKEN", kSecret},
                                                      {"MORPH_API_PORT", http_port}};
  pid_t status = SpawnLogged({MORPHCTL, "status"}, ctl_env, d + "/status.out", d + "/status.err");
  EXPECT_EQ(WaitExit(status, 20000), 0) << Slurp(d + "/status.err");
  pid_t resize =
      SpawnLogged({MORPHCTL, "resize", "1"}, ctl_env, d + "/resize.out", d + "/resize.err");
  EXPECT_GE(WaitExit(resize, 20000), 0);
  pid_t worker = SpawnLogged({MORPH_ELASTIC_WORKER, "--steps", "3", "--step-ms", "1", "--out", d},
                             {{"MORPH_COORDINATOR", control}, {"MORPH_TOKEN", kSecret}},
                             d + "/worker.out", d + "/worker.err");
  EXPECT_EQ(WaitExit(worker, 60000), 0) << Slurp(d + "/worker.err");
  EXPECT_EQ(WaitExit(morphd, 10000), 0) << Slurp(d + "/morphd.err");

  for (const char* f : {"morphd.out", "morphd.err", "status.out", "status.err", "resize.out",
                        "resize.err", "worker.out", "worker.err"}) {
    EXPECT_THAT(Slurp(d + "/" + f), Not(HasSubstr(kSecret))) << f << " shows the token";
  }
  // Both programs did log their parameters, redacted.
  EXPECT_THAT(Slurp(d + "/morphd.err"),
              HasSubstr("MORPH_TOKEN set by environment (secret, value not shown)"));
  EXPECT_THAT(Slurp(d + "/worker.err"),
              HasSubstr("MORPH_TOKEN set by environment (secret, value not shown)"));
  // morphctl: its answer on stdout and nothing on stderr.
  EXPECT_THAT(Slurp(d + "/status.out"), HasSubstr("generation "));
  EXPECT_EQ(Slurp(d + "/status.err"), "");
  EXPECT_THAT(Slurp(d + "/resize.err"), Not(HasSubstr("InitGoogleLogging")));
  EXPECT_THAT(Slurp(d + "/resize.err"), Not(HasSubstr("MORPH_")));
}

// morphrun hands its workers the token (the one it was given, or the one it generated) in a
// 0600 file named by MORPH_TOKEN_FILE, removed when it ends; never in their environment. The
// worker logs it creates are 0600, and it does not print the token itself.
TEST(SecurityTest, MorphrunHandsWorkersTheTokenInAPrivateFile) {
  for (bool given : {true, false}) {
    SCOPED_TRACE(given ? "token given" : "token generated");
    TempDir dir;
    ASSERT_FALSE(dir.path.empty());
    const std::string d = dir.path;
    ASSERT_EQ(::mkdir((d + "/logs").c_str(), 0755), 0);
    // A log left by an earlier run, readable by all: rewritten, and private again.
    std::ofstream(d + "/logs/worker-0.log") << "old\n";
    ASSERT_EQ(::chmod((d + "/logs/worker-0.log").c_str(), 0644), 0);
    const std::string script =
        "env | grep '^MORPH_' | sort; stat -c 'token file mode %a' "
        "\"$MORPH_TOKEN_FILE\"; cat \"$MORPH_TOKEN_FILE\" > " +
        d + "/seen; echo \"$MORPH_TOKEN_FILE\" > " + d + "/where";
    std::map<std::string, std::string> env;
    if (given) env["MORPH_TOKEN"] = kSecret;
    pid_t morphrun =
        SpawnLogged({MORPHRUN, "-n", "1", "--log-dir", d + "/logs", "--", "/bin/sh", "-c", script},
                    env, d + "/morphrun.out", d + "/morphrun.err");
    // The worker never registers: morphrun ends 2 s after it exited, with 1.
    EXPECT_EQ(WaitExit(morphrun, 30000), 1) << Slurp(d + "/morphrun.err");
    const std::string log = Slurp(d + "/logs/worker-0.log");
    std::string token = Slurp(d + "/seen");
    while (!token.empty() && token.back() == '\n') token.pop_back();
    EXPECT_FALSE(token.empty()) << log;
    if (given) {
      EXPECT_EQ(token, kSecret);
    }
    EXPECT_THAT(log, Not(HasSubstr("MORPH_TOKEN=")));
    EXPECT_THAT(log, HasSubstr("MORPH_TOKEN_FILE="));
    EXPECT_THAT(log, HasSubstr("token file mode 600"));
    for (const std::string& f :
         {d + "/logs/worker-0.log", d + "/morphrun.out", d + "/morphrun.err"}) {
      EXPECT_THAT(Slurp(f), Not(HasSubstr(token))) << f << " shows the token";
    }
    struct stat st {};
    ASSERT_EQ(::stat((d + "/logs/worker-0.log").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    std::string where = Slurp(d + "/where");
    while (!where.empty() && where.back() == '\n') where.pop_back();
    ASSERT_FALSE(where.empty());
    EXPECT_FALSE(std::filesystem::exists(where)) << "the token file outlived morphrun";
  }
}

}  // namespace
}  // namespace morph
