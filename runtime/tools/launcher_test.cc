// The Launcher's process handling that morphrun --slurm relies on, without Slurm: the wrapper
// put before every worker's argv (with its launch index), and the token handed over in a 0600
// file instead of the environment, removed when the Launcher ends.
#include "runtime/tools/launcher.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace morph {
namespace {

namespace fs = std::filesystem;

std::string Read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(LauncherTest, WrapperAndTokenFile) {
  const fs::path dir = fs::temp_directory_path() / ("morph-launcher-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path token_file = dir / "token";
  setenv("MORPH_TOKEN", "inherited-token", 1);  // never reaches a worker
  LauncherOptions o;
  o.workers = 2;
  o.wrapper = {"/usr/bin/env", "WRAPPED=w{index}-{index}"};
  // Each worker records what it got and exits; none joins, so the job never completes.
  o.argv = {"/bin/sh", "-c",
            "out=" + dir.string() +
                "/out.$MORPH_LAUNCH_INDEX; "
                "echo \"$WRAPPED|${MORPH_TOKEN-unset}|$MORPH_TOKEN_FILE\" > $out; "
                "cat \"$MORPH_TOKEN_FILE\" >> $out"};
  o.token_file = token_file.string();
  o.coordinator.token = "job-token";
  o.kill_grace_ms = 1000;
  {
    StatusOr<std::unique_ptr<Launcher>> l = Launcher::Start(o);
    ASSERT_TRUE(l.ok()) << l.status();
    struct stat st;
    ASSERT_EQ(stat(token_file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(Read(token_file), "job-token\n");
    // Every worker gone, the job not complete: 1, after the 2 s grace.
    StatusOr<int> code = (*l)->Wait(Deadline::AfterMs(20000));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 1);
    for (int i = 0; i < 2; ++i) {
      const std::string idx = std::to_string(i);
      EXPECT_EQ(Read(dir / ("out." + idx)),
                "w" + idx + "-" + idx + "|unset|" + token_file.string() + "\njob-token\n");
    }
  }
  EXPECT_FALSE(fs::exists(token_file)) << "the token file outlived the Launcher";
  unsetenv("MORPH_TOKEN");

  // A token file that cannot be written: Start fails, naming it, and starts no worker.
  o.token_file = (dir / "missing" / "token").string();
  StatusOr<std::unique_ptr<Launcher>> bad = Launcher::Start(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(bad.status().message()).find("token file=" + o.token_file),
            std::string::npos)
      << bad.status();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace morph
