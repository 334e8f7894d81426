#include "runtime/ha/etcd_client.h"

#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "base/host_port.h"

namespace morph {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kMaxReplyBytes = 64 << 20;
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// etcd's JSON writes 64-bit numbers as strings; an absent field is 0.
int64_t Int(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (!it->is_string()) return 0;
  const std::string& s = it->get_ref<const std::string&>();
  int64_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// The reply's first JSON value: the gateway may follow it with a gRPC trailer line.
StatusOr<json> ParseReply(const std::string& body) {
  std::istringstream is(body);
  json j;
  try {
    is >> j;
  } catch (const std::exception& e) {
    return DataLossError(std::string("etcd reply is not JSON: ") + e.what());
  }
  if (!j.is_object()) return DataLossError("etcd reply is not a JSON object");
  return j;
}

StatusOr<EtcdKv> KvFromJson(const json& j) {
  EtcdKv kv;
  MORPH_ASSIGN_OR_RETURN(kv.key, Base64Decode(j.value("key", "")));
  MORPH_ASSIGN_OR_RETURN(kv.value, Base64Decode(j.value("value", "")));
  kv.create_revision = Int(j, "create_revision");
  kv.mod_revision = Int(j, "mod_revision");
  kv.lease = Int(j, "lease");
  return kv;
}

// The end of the key range holding every key that starts with `prefix` (etcd's "range_end").
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    unsigned char c = static_cast<unsigned char>(prefix.back());
    if (c < 0xff) {
      prefix.back() = static_cast<char>(c + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

}  // namespace

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kAlphabet[(v >> s) & 63]);
  }
  if (size_t rest = bytes.size() - i; rest > 0) {
    uint32_t v = uint8_t(bytes[i]) << 16;
    if (rest == 2) v |= uint8_t(bytes[i + 1]) << 8;
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(rest == 2 ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

StatusOr<std::string> Base64Decode(std::string_view text) {
  static const std::array<int8_t, 256> kValue = [] {
    std::array<int8_t, 256> t;
    t.fill(-1);
    for (int i = 0; i < 64; ++i) t[static_cast<uint8_t>(kAlphabet[i])] = static_cast<int8_t>(i);
    return t;
  }();
  if (text.size() % 4 != 0) return DataLossError("base64: length is not a multiple of 4");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      char c = text[i + k];
      if (c == '=' && i + 4 == text.size() && k >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      int8_t d = kValue[static_cast<uint8_t>(c)];
      if (d < 0 || pad > 0) return DataLossError("base64: bad character");
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out.push_back(static_cast<char>(v >> 16));
    if (pad < 2) out.push_back(static_cast<char>((v >> 8) & 0xff));
    if (pad < 1) out.push_back(static_cast<char>(v & 0xff));
  }
  return out;
}

StatusOr<EtcdOptions> EtcdOptions::Parse(std::string_view list, std::string_view what) {
  EtcdOptions o;
  size_t pos = 0;
  while (pos <= list.size()) {
    size_t comma = list.find(',', pos);
    if (comma == std::string_view::npos) comma = list.size();
    std::string_view one = list.substr(pos, comma - pos);
    while (!one.empty() && (one.front() == ' ' || one.front() == '\t')) one.remove_prefix(1);
    while (!one.empty() && (one.back() == ' ' || one.back() == '\t')) one.remove_suffix(1);
    if (one.starts_with("http://")) one.remove_prefix(7);
    while (one.ends_with('/')) one.remove_suffix(1);
    if (!one.empty()) {
      MORPH_ASSIGN_OR_RETURN(HostPort hp, SplitHostPort(what, std::string(one)));
      (void)hp;
      o.endpoints.emplace_back(one);
    }
    pos = comma + 1;
  }
  if (o.endpoints.empty()) {
    return InvalidArgumentError(std::string(what) + ": no etcd endpoint (expected host:port,...)");
  }
  return o;
}

// One kept-alive HTTP connection to one endpoint.
class EtcdClient::Connection {
 public:
  explicit Connection(std::string endpoint) : endpoint_(std::move(endpoint)), stream_(io_) {}

  const std::string& endpoint() const { return endpoint_; }

  // POSTs `body` to `path`, connecting first if needed, within `deadline`. The HTTP status and
  // body; any transport error as kUnavailable (the connection is then unusable).
  StatusOr<std::pair<int, std::string>> Post(std::string_view path, const std::string& body,
                                             Clock::time_point deadline) {
    error_code ec;
    if (!connected_) {
      MORPH_ASSIGN_OR_RETURN(HostPort hp, SplitHostPort("etcd endpoint", endpoint_));
      tcp::resolver resolver(io_);
      auto results = resolver.resolve(hp.host, hp.port, ec);
      if (ec) return UnavailableError("resolving " + endpoint_ + ": " + ec.message());
      stream_.expires_at(deadline);
      stream_.async_connect(results, [&](error_code e, const tcp::endpoint&) { ec = e; });
      Run();
      if (ec) return Fail("connecting to", ec);
      error_code ignored;
      stream_.socket().set_option(tcp::no_delay(true), ignored);
      connected_ = true;
    }
    http::request<http::string_body> req{http::verb::post, std::string(path), 11};
    req.set(http::field::host, endpoint_);
    req.set(http::field::content_type, "application/json");
    req.keep_alive(true);
    req.body() = body;
    req.prepare_payload();
    stream_.expires_at(deadline);
    http::async_write(stream_, req, [&](error_code e, size_t) { ec = e; });
    Run();
    if (ec) return Fail("sending to", ec);
    http::response_parser<http::string_body> parser;
    parser.body_limit(kMaxReplyBytes);
    stream_.expires_at(deadline);
    http::async_read(stream_, buffer_, parser, [&](error_code e, size_t) { ec = e; });
    Run();
    if (ec) return Fail("reading from", ec);
    auto& res = parser.get();
    if (!res.keep_alive()) Close();
    return std::make_pair(static_cast<int>(res.result_int()), std::move(res.body()));
  }

  void Close() {
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    buffer_.clear();
    connected_ = false;
  }

 private:
  void Run() {
    io_.restart();
    io_.run();
  }
  Status Fail(std::string_view step, error_code ec) {
    Close();
    if (ec == beast::error::timeout) {
      return UnavailableError(std::string(step) + " " + endpoint_ + ": timed out");
    }
    return UnavailableError(std::string(step) + " " + endpoint_ + ": " + ec.message());
  }

  std::string endpoint_;
  asio::io_context io_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  bool connected_ = false;
};

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {}
EtcdClient::~EtcdClient() = default;

StatusOr<std::string> EtcdClient::Call(std::string_view path, const std::string& body) {
  std::lock_guard<std::mutex> lock(mu_);
  if (options_.endpoints.empty()) return FailedPreconditionError("etcd: no endpoint");
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  std::string errors;
  // Each endpoint once at least, and more rounds while the budget lasts (a member restarting).
  for (size_t attempt = 0;; ++attempt) {
    const size_t n = options_.endpoints.size();
    if (attempt >= n && Clock::now() >= deadline) break;
    if (!conn_ || conn_->endpoint() != options_.endpoints[current_ % n]) {
      conn_ = std::make_unique<Connection>(options_.endpoints[current_ % n]);
    }
    // One endpoint may take at most half of what is left, so that a hung one leaves time for
    // the next (at least 100 ms each).
    Clock::time_point now = Clock::now();
    Clock::time_point mine = now + std::max<Clock::duration>((deadline - now) / 2,
                                                              std::chrono::milliseconds(100));
    if (n == 1 || attempt + 1 >= n) mine = std::max(deadline, now + std::chrono::milliseconds(100));
    StatusOr<std::pair<int, std::string>> r = conn_->Post(path, body, mine);
    if (r.ok()) {
      auto& [code, text] = *r;
      if (code == 200) return std::move(text);
      MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
      const int grpc = static_cast<int>(Int(j, "code"));
      std::string message = j.value("message", j.value("error", text));
      // 14: the member has no leader (partitioned, or the cluster is electing): another may.
      if (grpc != 14) {
        if (grpc == 5) return NotFoundError("etcd " + std::string(path) + ": " + message);
        return InternalError("etcd " + std::string(path) + ": " + message);
      }
      errors += (errors.empty() ? "" : "; ") + conn_->endpoint() + ": " + message;
      conn_->Close();
    } else {
      errors += (errors.empty() ? "" : "; ") + std::string(r.status().message());
    }
    ++current_;
    if (attempt + 1 >= n && Clock::now() < deadline) {
      // Every endpoint failed once: wait a little before the next round.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return UnavailableError("etcd: no endpoint answered within " +
                          std::to_string(options_.timeout.count()) + " ms (" + errors + ")");
}

StatusOr<int64_t> EtcdClient::LeaseGrant(int64_t ttl_s) {
  MORPH_ASSIGN_OR_RETURN(std::string text,
                         Call("/v3/lease/grant", json{{"TTL", std::to_string(ttl_s)}}.dump()));
  MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
  if (!j.value("error", "").empty()) return InternalError("etcd lease grant: " + j.value("error", ""));
  int64_t id = Int(j, "ID");
  if (id == 0) return DataLossError("etcd lease grant: no lease id in " + text);
  return id;
}

StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease) {
  MORPH_ASSIGN_OR_RETURN(std::string text,
                         Call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump()));
  MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
  const json& r = j.contains("result") ? j["result"] : j;
  int64_t ttl = Int(r, "TTL");
  if (ttl <= 0) return NotFoundError("etcd lease " + std::to_string(lease) + " has expired");
  return ttl;
}

Status EtcdClient::LeaseRevoke(int64_t lease) {
  StatusOr<std::string> r = Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  if (!r.ok() && r.status().code() == StatusCode::kNotFound) return Status::Ok();
  return r.status();
}

StatusOr<std::optional<EtcdKv>> EtcdClient::Get(const std::string& key) {
  MORPH_ASSIGN_OR_RETURN(std::string text,
                         Call("/v3/kv/range", json{{"key", Base64Encode(key)}}.dump()));
  MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
  if (!j.contains("kvs") || !j["kvs"].is_array() || j["kvs"].empty()) {
    return std::optional<EtcdKv>();
  }
  MORPH_ASSIGN_OR_RETURN(EtcdKv kv, KvFromJson(j["kvs"][0]));
  return std::optional<EtcdKv>(std::move(kv));
}

StatusOr<std::vector<EtcdKv>> EtcdClient::GetPrefix(const std::string& prefix) {
  MORPH_ASSIGN_OR_RETURN(
      std::string text,
      Call("/v3/kv/range", json{{"key", Base64Encode(prefix)},
                                {"range_end", Base64Encode(PrefixEnd(prefix))}}
                               .dump()));
  MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
  std::vector<EtcdKv> out;
  if (j.contains("kvs") && j["kvs"].is_array()) {
    for (const json& e : j["kvs"]) {
      MORPH_ASSIGN_OR_RETURN(EtcdKv kv, KvFromJson(e));
      out.push_back(std::move(kv));
    }
  }
  return out;
}

Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  json req{{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  return Call("/v3/kv/put", req.dump()).status();
}

Status EtcdClient::Delete(const std::string& key) {
  return Call("/v3/kv/deleterange", json{{"key", Base64Encode(key)}}.dump()).status();
}

Status EtcdClient::DeletePrefix(const std::string& prefix) {
  return Call("/v3/kv/deleterange", json{{"key", Base64Encode(prefix)},
                                         {"range_end", Base64Encode(PrefixEnd(prefix))}}
                                        .dump())
      .status();
}

StatusOr<bool> EtcdClient::CreateIfAbsent(const std::string& key, const std::string& value,
                                          int64_t lease) {
  json put{{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  json req{
      {"compare", json::array({json{{"key", Base64Encode(key)},
                                    {"target", "CREATE"},
                                    {"result", "EQUAL"},
                                    {"create_revision", "0"}}})},
      {"success", json::array({json{{"request_put", put}}})},
      {"failure", json::array()}};
  MORPH_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/txn", req.dump()));
  MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
  return j.value("succeeded", false);
}

Status EtcdClient::FencedPut(const EtcdFence& fence,
                             const std::vector<std::pair<std::string, std::string>>& puts,
                             const std::vector<std::string>& deletes) {
  json ops = json::array();
  for (const auto& [k, v] : puts) {
    ops.push_back(json{{"request_put", json{{"key", Base64Encode(k)}, {"value", Base64Encode(v)}}}});
  }
  for (const std::string& k : deletes) {
    ops.push_back(json{{"request_delete_range", json{{"key", Base64Encode(k)}}}});
  }
  const std::string fkey = Base64Encode(fence.key);
  json req{{"compare", json::array({json{{"key", fkey},
                                          {"target", "VALUE"},
                                          {"result", "EQUAL"},
                                          {"value", Base64Encode(fence.value)}},
                                     json{{"key", fkey},
                                          {"target", "LEASE"},
                                          {"result", "EQUAL"},
                                          {"lease", std::to_string(fence.lease)}}})},
           {"success", ops},
           {"failure", json::array()}};
  MORPH_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/txn", req.dump()));
  MORPH_ASSIGN_OR_RETURN(json j, ParseReply(text));
  if (!j.value("succeeded", false)) {
    return AbortedError("etcd: fence lost: " + fence.key + " is no longer this leader's (lease " +
                        std::to_string(fence.lease) + ")");
  }
  return Status::Ok();
}

}  // namespace morph
