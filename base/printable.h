// Text that came from a peer (a worker's error message, a server's reply), made safe to put in
// a log line or on a terminal: it cannot start a new line, forge a log line, move the cursor,
// recolour or retitle the terminal.
//
//   LOG(WARNING) << "worker " << id << " failed: " << Printable(msg.error);
//   std::cout << "host " << Printable(host) << "\n";
//
// Printable ASCII (0x20..0x7e) is kept except the backslash; every other byte is escaped:
// \n, \r, \t, \\ and \xHH (control characters, DEL, and every byte of a non-ASCII character:
// a C1 control such as 0x9b is a terminal escape by itself). Pure function; any thread.
#ifndef MORPH_BASE_PRINTABLE_H_
#define MORPH_BASE_PRINTABLE_H_

#include <string>
#include <string_view>

namespace morph {

std::string Printable(std::string_view text);

// Printable(line) for each line of `text`, the line breaks ('\n') kept: for a document that is
// printed as lines (Prometheus text).
std::string PrintableLines(std::string_view text);

}  // namespace morph

#endif  // MORPH_BASE_PRINTABLE_H_
