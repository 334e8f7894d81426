#include "collectives/store/store_protocol.h"

#include <gtest/gtest.h>

#include <cstring>

#include "base/testing.h"

namespace morph::store_wire {
namespace {

using ::morph::testing::StatusIs;
using ::testing::HasSubstr;

KvTable::Request Sample() {
  return {.op = KvTable::Op::kCas,
          .generation = 7,
          .keys = {"a", std::string("b\0c", 3)},
          .value = "desired",
          .expected = std::string("old"),
          .number = -3};
}

TEST(StoreProtocolTest, RequestRoundTrip) {
  MORPH_ASSERT_OK_AND_ASSIGN(WireRequest w, DecodeRequest(EncodeRequest(Sample(), 1234)));
  EXPECT_EQ(w.timeout_ms, 1234);
  EXPECT_EQ(w.request.op, KvTable::Op::kCas);
  EXPECT_EQ(w.request.generation, 7);
  EXPECT_EQ(w.request.keys, Sample().keys);
  EXPECT_EQ(w.request.value, "desired");
  EXPECT_EQ(w.request.expected, std::optional<std::string>("old"));
  EXPECT_EQ(w.request.number, -3);
  EXPECT_FALSE(w.request.bounded_advance);  // the server sets it, never the wire
}

TEST(StoreProtocolTest, ResponseAndHelloRoundTrip) {
  KvTable::Response r;
  r.status = NotFoundError("key 'x'");
  r.value = "v";
  r.number = 42;
  MORPH_ASSERT_OK_AND_ASSIGN(KvTable::Response d, DecodeResponse(EncodeResponse(r)));
  EXPECT_THAT(d.status, StatusIs(StatusCode::kNotFound, HasSubstr("key 'x'")));
  EXPECT_EQ(d.value, "v");
  EXPECT_EQ(d.number, 42);
  MORPH_ASSERT_OK_AND_ASSIGN(std::string token, DecodeHello(EncodeHello("tok")));
  EXPECT_EQ(token, "tok");
  EXPECT_THAT(DecodeHello(EncodeHello("tok") + "x"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("malformed hello of 8 bytes")));
}

TEST(StoreProtocolTest, TimeoutsAreClamped) {
  KvTable::Request r{.op = KvTable::Op::kGet, .keys = {"k"}};
  MORPH_ASSERT_OK_AND_ASSIGN(WireRequest huge, DecodeRequest(EncodeRequest(r, int64_t{1} << 62)));
  EXPECT_EQ(huge.timeout_ms, kMaxTimeoutMs);
  MORPH_ASSERT_OK_AND_ASSIGN(WireRequest negative, DecodeRequest(EncodeRequest(r, INT64_MIN)));
  EXPECT_EQ(negative.timeout_ms, 0);
}

TEST(StoreProtocolTest, KeyCountIsBoundedByTheBody) {
  // 1,000,000 keys announced in a body of ~1 KiB: refused naming the count and the room.
  std::string body(1, static_cast<char>(KvTable::Op::kWait));
  PutU64(body, 0);
  PutU64(body, 0);
  PutU32(body, 1000000);
  body.append(1024, '\0');
  EXPECT_THAT(DecodeRequest(body),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("announces 1000000 keys but its remaining 1024 bytes hold at "
                                 "most 251")));
  // Exactly as many empty keys as fit is fine.
  KvTable::Request many{.op = KvTable::Op::kWait, .keys = std::vector<std::string>(251)};
  MORPH_ASSERT_OK_AND_ASSIGN(WireRequest w, DecodeRequest(EncodeRequest(many, 0)));
  EXPECT_EQ(w.request.keys.size(), 251u);
}

TEST(StoreProtocolTest, MalformedRequestsNameTheDefect) {
  std::string good = EncodeRequest(Sample(), 0);
  EXPECT_THAT(DecodeRequest(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("0 bytes")));
  std::string bad_op = good;
  bad_op[0] = 9;
  EXPECT_THAT(DecodeRequest(bad_op),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown operation 9")));
  EXPECT_THAT(DecodeRequest(good + "zz"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("2 trailing bytes")));
  for (size_t cut = 1; cut < good.size(); ++cut) {
    EXPECT_FALSE(DecodeRequest(good.substr(0, cut)).ok()) << "truncated at " << cut;
  }
  // A string length beyond the body.
  std::string long_key = good;
  long_key[21] = static_cast<char>(0xff);  // first key's length byte 0
  EXPECT_FALSE(DecodeRequest(long_key).ok());
}

TEST(StoreProtocolTest, FrameReaderGrowsWithTheBytesNotTheHeader) {
  FrameReader reader(64u << 20);
  std::string header;
  PutU32(header, 60u << 20);
  std::span<char> space = reader.Prepare(1 << 20);
  ASSERT_EQ(space.size(), 4u);
  std::memcpy(space.data(), header.data(), 4);
  MORPH_ASSERT_OK(reader.Commit(4));
  space = reader.Prepare(64 << 10);
  EXPECT_EQ(space.size(), size_t{64} << 10);
  MORPH_ASSERT_OK(reader.Commit(1000));
  EXPECT_LT(reader.held(), size_t{256} << 10);  // not 60 MiB
  EXPECT_FALSE(reader.has_frame());
}

TEST(StoreProtocolTest, FrameReaderAssemblesAndRefusesOversizedFrames) {
  FrameReader reader(kMaxHelloBytes);
  std::string bytes = Frame("hello") + Frame("");
  size_t at = 0;
  auto feed = [&](size_t chunk) {
    std::span<char> s = reader.Prepare(chunk);
    size_t n = std::min(s.size(), bytes.size() - at);
    std::memcpy(s.data(), bytes.data() + at, n);
    at += n;
    return reader.Commit(n);
  };
  while (!reader.has_frame()) MORPH_ASSERT_OK(feed(1));  // one byte at a time
  EXPECT_EQ(reader.frame(), "hello");
  EXPECT_TRUE(reader.Prepare(16).empty());  // nothing more until the frame is consumed
  reader.Pop();
  MORPH_ASSERT_OK(feed(16));
  ASSERT_TRUE(reader.has_frame());  // an empty body is complete with its header
  EXPECT_EQ(reader.frame(), "");
  reader.Pop();

  std::string big;
  PutU32(big, 64u << 20);
  bytes = big;
  at = 0;
  EXPECT_THAT(feed(4), StatusIs(StatusCode::kInvalidArgument,
                                HasSubstr("frame of 67108864 bytes exceeds the limit of 4096")));
}

TEST(StoreProtocolTest, TokensEqual) {
  EXPECT_TRUE(TokensEqual("abc", "abc"));
  EXPECT_FALSE(TokensEqual("abc", "abd"));
  EXPECT_FALSE(TokensEqual("abc", "ab"));
  EXPECT_FALSE(TokensEqual("", "a"));
}

}  // namespace
}  // namespace morph::store_wire
