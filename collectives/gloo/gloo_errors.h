// How the Gloo backend reads the text of a Gloo exception: one classifier for every place
// that must tell a timeout from a lost peer (rendezvous, operations, a pair's own error).
// Internal to collectives/ (not installed); header-only and free of Gloo headers so that
// tests can call it. Any thread.
//
//   switch (ClassifyGlooError(e.what())) {
//     case GlooErrorKind::kTimeout: return DeadlineExceededError(...);
//     ...
//   }
#ifndef MORPH_COLLECTIVES_GLOO_ERRORS_H_
#define MORPH_COLLECTIVES_GLOO_ERRORS_H_

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string_view>

namespace morph {

enum class GlooErrorKind : uint8_t {
  kTimeout,     // a Gloo wait, read, write, connect or store wait ran out of time
  kPeerClosed,  // the peer's connection closed or failed (EOF, reset, read/write error)
  kLocal,       // raised by this rank on its own pairs (Abort, or its own earlier failure)
  kOther,       // anything else (e.g. an EnforceNotMet about arguments)
};

// The prefix of every message morph raises on a Gloo pair itself
// (tcp::Pair::signalExceptionExternal), so that it is never mistaken for a peer's failure.
inline constexpr std::string_view kGlooLocalSignalPrefix = "morph: ";

// Gloo 0.5's wordings (libgloo.so strings): "Timed out waiting ...", "Connect timeout",
// "Read timeout", "Write timeout", "Send timeout", "Wait timeout for key(s)", "Application
// timeout caused pair closure"; "Connection closed by peer", "Read error", "Write error",
// "Socket closed", "Socket unexpectedly closed", "Connection reset by peer", "Broken pipe".
inline GlooErrorKind ClassifyGlooError(std::string_view what) {
  if (what.substr(0, kGlooLocalSignalPrefix.size()) == kGlooLocalSignalPrefix) {
    return GlooErrorKind::kLocal;
  }
  auto contains = [&](std::string_view needle) {
    return std::search(what.begin(), what.end(), needle.begin(), needle.end(), [](char a, char b) {
             return std::tolower(static_cast<unsigned char>(a)) ==
                    std::tolower(static_cast<unsigned char>(b));
           }) != what.end();
  };
  if (contains("timed out") || contains("timeout")) return GlooErrorKind::kTimeout;
  for (std::string_view s : {"closed", "reset by peer", "read error", "write error", "broken pipe",
                             "connection refused"}) {
    if (contains(s)) return GlooErrorKind::kPeerClosed;
  }
  return GlooErrorKind::kOther;
}

}  // namespace morph

#endif  // MORPH_COLLECTIVES_GLOO_ERRORS_H_
