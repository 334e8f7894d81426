#include "base/params.h"

#include <glog/logging.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

namespace morph::params {
namespace {


std::string Quote(std::string_view name, std::string_view text) {
  std::string s(name);
  s += "=";
  s += text;
  return s;
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

// Logs "NAME set by environment to VALUE" once per process for each name; a secret's value is
// not shown.
void LogOnce(const char* env, std::string_view value, bool secret) {
  static std::mutex mu;
  static std::set<std::string>* logged = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (logged->insert(env).second) {
    if (secret) {
      LOG(INFO) << env << " set by environment (secret, value not shown)";
    } else {
      LOG(INFO) << env << " set by environment to " << value;
    }
  }
}

template <typename T, typename Parse>
StatusOr<T> Read(const char* env, T def, Parse parse, bool secret = false) {
  const char* raw = std::getenv(env);
  if (raw == nullptr || Trim(raw).empty()) return def;
  StatusOr<T> v = parse(std::string_view(raw));
  if (v.ok() && !(*v == def)) LogOnce(env, Trim(raw), secret);
  return v;
}

}  // namespace

std::string_view ParamTypeName(ParamType type) {
  switch (type) {
    case ParamType::kBool: return "bool";
    case ParamType::kInt64: return "int64";
    case ParamType::kDouble: return "double";
    case ParamType::kBytes: return "bytes";
    case ParamType::kString: return "string";
  }
  return "?";
}

StatusOr<bool> ParseBool(std::string_view name, std::string_view text) {
  std::string t(Trim(text));
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  return InvalidArgumentError(Quote(name, text) +
                              ": not a boolean (use 1/0, true/false, yes/no, on/off)");
}

StatusOr<int64_t> ParseInt64(std::string_view name, std::string_view text, int64_t min,
                             int64_t max) {
  std::string t(Trim(text));
  if (t.empty()) return InvalidArgumentError(Quote(name, text) + ": not an integer");
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(t.c_str(), &end, 10);
  if (end != t.c_str() + t.size()) {
    return InvalidArgumentError(Quote(name, text) + ": not an integer");
  }
  if (errno == ERANGE || v < min || v > max) {
    return InvalidArgumentError(Quote(name, text) + ": out of range [" + std::to_string(min) +
                                ", " + std::to_string(max) + "]");
  }
  return static_cast<int64_t>(v);
}

StatusOr<double> ParseDouble(std::string_view name, std::string_view text, double min,
                             double max) {
  std::string t(Trim(text));
  errno = 0;
  char* end = nullptr;
  double v = t.empty() ? 0 : std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || !std::isfinite(v)) {
    return InvalidArgumentError(Quote(name, text) + ": not a number");
  }
  if (errno == ERANGE || v < min || v > max) {
    std::ostringstream os;
    os << ": out of range [" << min << ", " << max << "]";
    return InvalidArgumentError(Quote(name, text) + os.str());
  }
  return v;
}

StatusOr<uint64_t> ParseBytes(std::string_view name, std::string_view text) {
  std::string_view t = Trim(text);
  size_t digits = 0;
  while (digits < t.size() && t[digits] >= '0' && t[digits] <= '9') ++digits;
  if (digits == 0) {
    return InvalidArgumentError(Quote(name, text) + ": not a byte size (e.g. 4096, 64KiB, 1G)");
  }
  std::string_view unit = Trim(t.substr(digits));
  uint64_t mult = 1;
  if (!unit.empty()) {
    char u = static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0])));
    std::string_view rest = unit.substr(1);
    if (u == 'B' && rest.empty()) {
      mult = 1;
    } else if ((u == 'K' || u == 'M' || u == 'G' || u == 'T') &&
               (rest.empty() || rest == "B" || rest == "iB" || rest == "IB" || rest == "ib")) {
      mult = u == 'K' ? 1ull << 10 : u == 'M' ? 1ull << 20 : u == 'G' ? 1ull << 30 : 1ull << 40;
    } else {
      return InvalidArgumentError(Quote(name, text) + ": unknown unit '" + std::string(unit) +
                                  "' (use K, M, G or T)");
    }
  }
  uint64_t value = 0;
  for (size_t i = 0; i < digits; ++i) {
    uint64_t d = static_cast<uint64_t>(t[i] - '0');
    if (value > (UINT64_MAX - d) / 10) {
      return InvalidArgumentError(Quote(name, text) + ": too large");
    }
    value = value * 10 + d;
  }
  if (value != 0 && mult > UINT64_MAX / value) {
    return InvalidArgumentError(Quote(name, text) + ": too large");
  }
  return value * mult;
}

#define MORPH_PARAM_INT64(fn, env, def, min, max, desc)                                  \
  StatusOr<int64_t> fn() {                                                               \
    return Read<int64_t>(env, def, [](std::string_view t) { return ParseInt64(env, t, min, max); }); \
  }
#define MORPH_PARAM_DOUBLE(fn, env, def, min, max, desc)                                 \
  StatusOr<double> fn() {                                                                \
    return Read<double>(env, def, [](std::string_view t) { return ParseDouble(env, t, min, max); }); \
  }
#define MORPH_PARAM_BOOL(fn, env, def, desc)                                             \
  StatusOr<bool> fn() {                                                                  \
    return Read<bool>(env, def, [](std::string_view t) { return ParseBool(env, t); });   \
  }
#define MORPH_PARAM_BYTES(fn, env, def, desc)                                            \
  StatusOr<uint64_t> fn() {                                                              \
    static const uint64_t kDefault = *ParseBytes(env, def);                              \
    return Read<uint64_t>(env, kDefault, [](std::string_view t) { return ParseBytes(env, t); }); \
  }
#define MORPH_PARAM_STRING(fn, env, def, desc)                                           \
  StatusOr<std::string> fn() {                                                           \
    return Read<std::string>(env, def, [](std::string_view t) {                          \
      return StatusOr<std::string>(std::string(Trim(t)));                                \
    });                                                                                  \
  }
#define MORPH_PARAM_SECRET(fn, env, def, desc)                                           \
  StatusOr<std::string> fn() {                                                           \
    return Read<std::string>(                                                            \
        env, def, [](std::string_view t) { return StatusOr<std::string>(std::string(Trim(t))); }, \
        /*secret=*/true);                                                                \
  }
#include "base/params.def"
#undef MORPH_PARAM_INT64
#undef MORPH_PARAM_DOUBLE
#undef MORPH_PARAM_BOOL
#undef MORPH_PARAM_BYTES
#undef MORPH_PARAM_STRING
#undef MORPH_PARAM_SECRET

namespace {
#define MORPH_STR_(x) #x
#define MORPH_PARAM_INT64(fn, env, def, min, max, desc) {env, ParamType::kInt64, MORPH_STR_(def), desc, [] { return fn().status(); }},
#define MORPH_PARAM_DOUBLE(fn, env, def, min, max, desc) {env, ParamType::kDouble, MORPH_STR_(def), desc, [] { return fn().status(); }},
#define MORPH_PARAM_BOOL(fn, env, def, desc) {env, ParamType::kBool, MORPH_STR_(def), desc, [] { return fn().status(); }},
#define MORPH_PARAM_BYTES(fn, env, def, desc) {env, ParamType::kBytes, def, desc, [] { return fn().status(); }},
#define MORPH_PARAM_STRING(fn, env, def, desc) {env, ParamType::kString, def, desc, [] { return fn().status(); }},
#define MORPH_PARAM_SECRET(fn, env, def, desc) {env, ParamType::kString, def, desc, [] { return fn().status(); }, true},
const ParamInfo kParams[] = {
#include "base/params.def"
};
#undef MORPH_PARAM_INT64
#undef MORPH_PARAM_DOUBLE
#undef MORPH_PARAM_BOOL
#undef MORPH_PARAM_BYTES
#undef MORPH_PARAM_STRING
#undef MORPH_PARAM_SECRET
}  // namespace

std::span<const ParamInfo> All() { return kParams; }

std::string_view Shown(const ParamInfo& param, std::string_view value) {
  return param.secret ? std::string_view("<redacted>") : value;
}

std::string Dump() {
  std::ostringstream os;
  for (const ParamInfo& p : kParams) {
    const char* raw = std::getenv(p.env_name);
    bool set = raw != nullptr && !Trim(raw).empty();
    std::string value = set ? std::string(Trim(raw)) : p.default_text;
    Status valid = p.check();
    os << p.env_name << "=" << Shown(p, value) << " (" << ParamTypeName(p.type)
       << (p.secret ? ", secret" : "") << ", default '" << p.default_text << "'"
       << (set ? ", set" : "") << ")";
    if (!valid.ok()) os << " (invalid: " << valid.message() << ")";
    os << " " << p.description << "\n";
  }
  return os.str();
}

}  // namespace morph::params
