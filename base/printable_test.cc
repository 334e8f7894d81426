#include "base/printable.h"

#include <gtest/gtest.h>

namespace morph {
namespace {

TEST(PrintableTest, KeepsPrintableAsciiAndEscapesTheRest) {
  EXPECT_EQ(Printable("node-7.example.com: step 12"), "node-7.example.com: step 12");
  EXPECT_EQ(Printable("a\nI0101 forged"), "a\\nI0101 forged");
  EXPECT_EQ(Printable("\x1b[31mred\x1b[0m\a"), "\\x1b[31mred\\x1b[0m\\x07");
  EXPECT_EQ(Printable("tab\there\r"), "tab\\there\\r");
  EXPECT_EQ(Printable("back\\slash"), "back\\\\slash");
  EXPECT_EQ(Printable(std::string("nul\0del\x7f", 8)), "nul\\x00del\\x7f");
  EXPECT_EQ(Printable("\xc2\x9b"
                      "2J \xe2\x86\x92"),
            "\\xc2\\x9b2J \\xe2\\x86\\x92");
  EXPECT_EQ(Printable(""), "");
}

TEST(PrintableTest, LinesKeepTheirBreaks) {
  EXPECT_EQ(PrintableLines("a 1\n\x1b[2Jb 2\n"), "a 1\n\\x1b[2Jb 2\n");
  EXPECT_EQ(PrintableLines("no newline\r"), "no newline\\r");
  EXPECT_EQ(PrintableLines("\n\n"), "\n\n");
}

}  // namespace
}  // namespace morph
