// The tree's include order, read from the #include lines of every source file: the public
// headers (include/morph/, which include nothing else of morph's), the layers below the runtime
// (base < reshard < collectives < runtime) and the runtime's folders in the order
// docs/design.md §2 gives (runtime/CMakeLists.txt adds them in it). A file may include its own
// folder and the folders before it, never one after it, so the folders cannot form a cycle; the
// test names every include that breaks the order, and then checks that the graph it read has no
// cycle at all (whatever the order says).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

// Lowest first. "runtime/x" is a folder of the runtime; the others are top-level folders.
const std::vector<std::string> kOrder = {
    "morph",          "base",           "reshard",          "collectives",   "runtime/protocol",
    "runtime/ha",     "runtime/plan",   "runtime/cursor",   "runtime/state", "runtime/recovery",
    "runtime/agent",  "runtime/switch",   "runtime/coordinator", "runtime/api",
    "runtime/tools"};

// The layer a path (relative to the source root, or an include's "a/b/c.h") belongs to; "" for
// none we check (tests/, bench/, examples/, a system header).
std::string LayerOf(const std::string& path) {
  // The public headers (include/morph/ in the tree, "morph/..." in an include) lie below all.
  if (path.starts_with("include/morph/") || path.starts_with("morph/")) return "morph";
  const size_t slash = path.find('/');
  if (slash == std::string::npos) return "";
  const std::string top = path.substr(0, slash);
  if (top == "runtime") {
    const size_t second = path.find('/', slash + 1);
    if (second == std::string::npos) return "";
    return path.substr(0, second);
  }
  return std::find(kOrder.begin(), kOrder.end(), top) != kOrder.end() ? top : "";
}

int Rank(const std::string& layer) {
  return static_cast<int>(std::find(kOrder.begin(), kOrder.end(), layer) - kOrder.begin());
}

struct Include {
  std::string file;
  int line;
  std::string target;
};

// `#include "a/b.h"` (spaces allowed around '#'): its target. Not std::regex: GCC 12 warns
// (maybe-uninitialized, an error here) inside <regex> under -O2 with the sanitizers.
bool QuotedInclude(const std::string& line, std::string* target) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string::npos || line[i] != '#') return false;
  i = line.find_first_not_of(" \t", i + 1);
  if (i == std::string::npos || line.compare(i, 7, "include") != 0) return false;
  i = line.find_first_not_of(" \t", i + 7);
  if (i == std::string::npos || line[i] != '"') return false;
  const size_t end = line.find('"', i + 1);
  if (end == std::string::npos) return false;
  *target = line.substr(i + 1, end - i - 1);
  return true;
}

std::vector<Include> ReadIncludes(const fs::path& root) {
  std::vector<Include> out;
  for (const char* top : {"include/morph", "base", "reshard", "collectives", "runtime"}) {
    for (const auto& e : fs::recursive_directory_iterator(root / top)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".h" && ext != ".cc" && ext != ".cu")) continue;
      std::ifstream in(e.path());
      std::string text;
      int n = 0;
      while (std::getline(in, text)) {
        ++n;
        std::string target;
        if (QuotedInclude(text, &target)) {
          out.push_back({fs::relative(e.path(), root).string(), n, target});
        }
      }
    }
  }
  return out;
}

TEST(LayeringTest, EveryFolderIncludesOnlyFoldersBeforeIt) {
  const fs::path root = MORPH_SOURCE_DIR;
  const std::vector<Include> includes = ReadIncludes(root);
  ASSERT_GT(includes.size(), 500u) << "read the tree at " << root;
  std::map<std::string, std::set<std::string>> graph;
  for (const Include& inc : includes) {
    const std::string from = LayerOf(inc.file);
    const std::string to = LayerOf(inc.target);
    if (from.empty() || to.empty() || from == to) continue;
    graph[from].insert(to);
    EXPECT_LT(Rank(to), Rank(from))
        << inc.file << ":" << inc.line << " includes \"" << inc.target << "\": " << from
        << " may include only what comes before it in the order";
  }
  // A cycle, independently of the order (depth-first search over the graph read above).
  std::map<std::string, int> color;  // 0 new, 1 on the stack, 2 done
  std::vector<std::string> stack;
  std::string cycle;
  std::function<void(const std::string&)> visit = [&](const std::string& n) {
    color[n] = 1;
    stack.push_back(n);
    for (const std::string& m : graph[n]) {
      if (!cycle.empty()) return;
      if (color[m] == 1) {
        std::ostringstream os;
        auto it = std::find(stack.begin(), stack.end(), m);
        for (; it != stack.end(); ++it) os << *it << " -> ";
        os << m;
        cycle = os.str();
        return;
      }
      if (color[m] == 0) visit(m);
    }
    stack.pop_back();
    color[n] = 2;
  };
  for (const auto& [n, _] : graph) {
    if (color[n] == 0) visit(n);
  }
  EXPECT_EQ(cycle, "") << "the folders include each other in a cycle";
}

// The layer order is what the test and the build say it is: every runtime/ folder is listed.
TEST(LayeringTest, EveryRuntimeFolderIsInTheOrder) {
  const fs::path root = MORPH_SOURCE_DIR;
  for (const auto& e : fs::directory_iterator(root / "runtime")) {
    if (!e.is_directory()) continue;
    const std::string layer = "runtime/" + e.path().filename().string();
    EXPECT_NE(Rank(layer), static_cast<int>(kOrder.size())) << layer << " is not in the order";
  }
}

}  // namespace
