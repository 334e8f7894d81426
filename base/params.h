// Typed registry of morph's environment parameters (NCCL's param.h, made typed).
//
// Each MORPH_* variable is declared once in params.def with its type, default and description.
// Each has a getter here that reads the environment when it is called:
//
//   MORPH_ASSIGN_OR_RETURN(int64_t heartbeat_ms, morph::params::HeartbeatMs());
//
// Only the options readers call the getters (GlooOptions::FromEnv, TcpStoreServerOptions::
// FromEnv, ExecutorOptions::FromEnv, ...), and a program calls those once, at the top, then
// passes the options values down: library calls never read the environment, so a test passes
// options instead of setting variables (collectives/env_isolation_test.cc checks this).
//
// A value that does not parse or is out of range is kInvalidArgument naming the variable and
// the value ("MORPH_HEARTBEAT_MS=abc: not an integer"). The first time a getter sees a
// non-default value it logs it once ("MORPH_HEARTBEAT_MS set by environment to 500").
// `Dump()` lists every parameter with its current value. A secret (MORPH_PARAM_SECRET: the job
// token) is a string whose value is returned to its reader and never printed: its log line says
// "MORPH_TOKEN set by environment (secret, value not shown)", Dump shows "<redacted>", and
// `Shown` is how any other printer shows a value. Thread-safe.
#ifndef MORPH_BASE_PARAMS_H_
#define MORPH_BASE_PARAMS_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "morph/status.h"

namespace morph::params {

enum class ParamType { kBool, kInt64, kDouble, kBytes, kString };
std::string_view ParamTypeName(ParamType type);

struct ParamInfo {
  const char* env_name;
  ParamType type;
  const char* default_text;  // as it would be written in the environment
  const char* description;
  Status (*check)();  // parses the current environment value: OK or kInvalidArgument
  bool secret = false;  // never printed (MORPH_PARAM_SECRET)
};

// `value` as a printer may show it: "<redacted>" for a secret, else the value itself.
std::string_view Shown(const ParamInfo& param, std::string_view value);

// All declared parameters in declaration order.
std::span<const ParamInfo> All();

// One line per parameter: "MORPH_X=<value> (<type>[, secret], default <d>[, set])
// <description>", a secret's value shown as "<redacted>". A value that does not parse is shown
// with "(invalid: <reason>)".
std::string Dump();

// Parsers, exposed for tests and for Options fields given as text. `name` is used in errors.
StatusOr<bool> ParseBool(std::string_view name, std::string_view text);
StatusOr<int64_t> ParseInt64(std::string_view name, std::string_view text, int64_t min,
                             int64_t max);
StatusOr<double> ParseDouble(std::string_view name, std::string_view text, double min,
                             double max);
// "4096", "64KiB", "256MiB", "1GiB", "2G" (K/M/G/T, with or without "iB"/"B", powers of 1024).
StatusOr<uint64_t> ParseBytes(std::string_view name, std::string_view text);

#define MORPH_PARAM_INT64(fn, env, def, min, max, desc) StatusOr<int64_t> fn();
#define MORPH_PARAM_DOUBLE(fn, env, def, min, max, desc) StatusOr<double> fn();
#define MORPH_PARAM_BOOL(fn, env, def, desc) StatusOr<bool> fn();
#define MORPH_PARAM_BYTES(fn, env, def, desc) StatusOr<uint64_t> fn();
#define MORPH_PARAM_STRING(fn, env, def, desc) StatusOr<std::string> fn();
#define MORPH_PARAM_SECRET(fn, env, def, desc) StatusOr<std::string> fn();
#include "base/params.def"
#undef MORPH_PARAM_INT64
#undef MORPH_PARAM_DOUBLE
#undef MORPH_PARAM_BOOL
#undef MORPH_PARAM_BYTES
#undef MORPH_PARAM_STRING
#undef MORPH_PARAM_SECRET

}  // namespace morph::params

#endif  // MORPH_BASE_PARAMS_H_
