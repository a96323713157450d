// JsonTest.cpp — the JSON parser (values, escapes, numbers, located errors) and serializer.
#include "runtime/Json.h"

#include <gtest/gtest.h>

#include <cmath>

using abp::rt::Error;
using abp::rt::ErrorCode;
using abp::rt::Json;
using abp::rt::JsonError;

TEST(Json, ParsesEveryKind) {
  Json j = Json::parse(R"( {"n": null, "t": true, "f": false, "i": -12, "x": 1.5e3,
                            "s": "hi", "a": [1, [2], {}], "o": {"k": "v"}} )");
  ASSERT_TRUE(j.isObject());
  EXPECT_TRUE(j.find("n")->isNull());
  EXPECT_TRUE(j.find("t")->asBool());
  EXPECT_FALSE(j.find("f")->asBool());
  EXPECT_EQ(j.find("i")->asInteger(), -12);
  EXPECT_DOUBLE_EQ(j.find("x")->asNumber(), 1500.0);
  EXPECT_TRUE(j.find("x")->isInteger());
  EXPECT_EQ(j.find("s")->asString(), "hi");
  EXPECT_EQ(j.find("a")->asArray().size(), 3u);
  EXPECT_TRUE(j.find("a")->asArray()[2].isObject());
  EXPECT_EQ(j.find("o")->find("k")->asString(), "v");
  EXPECT_EQ(j.find("missing"), nullptr);
  EXPECT_EQ(Json::parse("[]").find("x"), nullptr); // not an object
}

TEST(Json, StringEscapes) {
  Json j = Json::parse(R"("q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20ac \ud83d\ude00 \u0000end")");
  std::string expected =
      std::string("q\" b\\ s/ \b\f\n\r\t \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 ") +
      std::string(1, '\0') + "end";
  EXPECT_EQ(j.asString(), expected);
  // Serializing escapes what must be escaped, and the result parses back to the same string.
  std::string dumped = j.dump();
  EXPECT_NE(dumped.find("\\u0000"), std::string::npos) << dumped;
  EXPECT_EQ(Json::parse(dumped).asString(), expected);
  EXPECT_EQ(Json::string(std::string("\x01")).dump(), "\"\\u0001\"");
}

TEST(Json, NumbersKeepTheirText) {
  Json j = Json::parse(R"([1.0, 0.1, -3.1858, 1e-7, 0, -0, 12345678901234])");
  EXPECT_EQ(j.dump(), "[1.0,0.1,-3.1858,1e-7,0,-0,12345678901234]");
  EXPECT_FALSE(j.asArray()[1].isInteger());
  EXPECT_EQ(j.asArray()[6].asInteger(), 12345678901234);
  EXPECT_EQ(Json::number(0.5).dump(), "0.5");
  EXPECT_EQ(Json::number(3).dump(), "3");
  EXPECT_EQ(Json::integer(-7).dump(), "-7");
  EXPECT_EQ(Json::number(NAN).dump(), "null");
  EXPECT_EQ(Json::parse(Json::number(0.1f).dump()).asNumber(), static_cast<double>(0.1f));
}

TEST(Json, ObjectsKeepMemberOrderAndDumpCompactly) {
  Json j = Json::parse(R"({ "b" : 1 , "a" : [ true , null ] , "c" : { } })");
  EXPECT_EQ(j.dump(), R"({"b":1,"a":[true,null],"c":{}})");
  j.set("a", Json::string("x"));
  j.set("d", Json::array());
  j.asObject()[3].second.push(Json::boolean(false));
  EXPECT_EQ(j.dump(), R"({"b":1,"a":"x","c":{},"d":[false]})");
}

TEST(Json, WrongKindAccessIsAnError) {
  Json s = Json::string("x");
  EXPECT_THROW(s.asNumber(), Error);
  EXPECT_THROW(s.asArray(), Error);
  EXPECT_THROW(s.asObject(), Error);
  EXPECT_THROW(s.asBool(), Error);
  EXPECT_THROW(Json().asString(), Error);
  EXPECT_THROW(Json::number(1.5).asInteger(), Error);
  EXPECT_THROW(s.set("k", Json()), Error);
  EXPECT_THROW(s.push(Json()), Error);
  try {
    s.asNumber();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_STREQ(e.what(), "json: expected a number, got a string");
  }
  EXPECT_STREQ(Json::kindName(Json::Kind::Object), "an object");
}

namespace {
/// The parse error of `text` (fails the test if it parses).
std::string parseError(const std::string &text, size_t *offset = nullptr) {
  try {
    Json::parse(text);
  } catch (const JsonError &e) {
    if (offset)
      *offset = e.offset();
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "parsed: " << text;
  return "";
}
} // namespace

TEST(Json, RejectsMalformedDocuments) {
  const std::pair<const char *, const char *> cases[] = {
      {"", "unexpected end of input"},
      {"{", "expected a member name"},
      {"[1,]", "unexpected ']'"},
      {"{\"a\" 1}", "expected ':'"},
      {"{\"a\":1 \"b\":2}", "expected ',' or '}'"},
      {"[1 2]", "expected ',' or ']'"},
      {"01", "leading zeros"},
      {"1.", "expected a digit after '.'"},
      {"1e", "expected a digit in the exponent"},
      {"-", "expected a digit"},
      {"1e999", "out of range"},
      {"\"abc", "unterminated string"},
      {"\"\\x\"", "invalid escape"},
      {"\"\\u12g4\"", "invalid hex digit"},
      {"\"\\ud800\"", "high surrogate"},
      {"\"\\udc00\"", "unpaired low surrogate"},
      {"\"a\tb\"", "unescaped control character"},
      {"tru", "expected 'true'"},
      {"nul", "expected 'null'"},
      {"{\"a\":1,\"a\":2}", "duplicate member \"a\""},
      {"[1] x", "unexpected text after the document"},
      {"{1:2}", "expected a member name (a string)"},
      {"@", "unexpected '@'"}};
  for (const auto &[text, want] : cases)
    EXPECT_NE(parseError(text).find(want), std::string::npos)
        << "input: " << text << "\nerror: " << parseError(text);
}

TEST(Json, ErrorsAreLocated) {
  size_t offset = 0;
  std::string message = parseError("{\n  \"a\": tru\n}", &offset);
  EXPECT_EQ(offset, 9u);
  EXPECT_NE(message.find("at offset 9 (line 2, column 8)"), std::string::npos) << message;
  try {
    Json::parse("[\n\n  ?]");
  } catch (const JsonError &e) {
    EXPECT_EQ(e.line(), 3u);
    EXPECT_EQ(e.column(), 3u);
  }
}

TEST(Json, DeepNestingIsAnErrorNotACrash) {
  std::string deep(100000, '[');
  EXPECT_NE(parseError(deep).find("nesting deeper than"), std::string::npos);
  std::string ok = std::string(200, '[') + std::string(200, ']');
  EXPECT_NO_THROW(Json::parse(ok));
}
