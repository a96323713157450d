// JsonTest.cpp — the lookups runtime/Json.h adds to nlohmann-json (the parser itself is theirs).
#include "runtime/Json.h"

#include <gtest/gtest.h>

#include <cstdio>

using namespace abp::rt;

TEST(Json, FindMemberOnlyLooksIntoObjects) {
  Json j = parseJson(R"({"b": 1, "a": null})");
  ASSERT_NE(findMember(j, "a"), nullptr);
  EXPECT_TRUE(findMember(j, "a")->is_null());
  EXPECT_EQ(*findMember(j, "b"), 1);
  EXPECT_EQ(findMember(j, "c"), nullptr);
  EXPECT_EQ(findMember(parseJson("[1]"), "0"), nullptr);
  EXPECT_EQ(findMember(parseJson(R"("a")"), "a"), nullptr);
}

TEST(Json, IntegralValuesAreTheNumbersThatNameAnInt64) {
  EXPECT_EQ(integralValue(parseJson("3")), 3);
  EXPECT_EQ(integralValue(parseJson("-3")), -3);
  EXPECT_EQ(integralValue(parseJson("1.0e3")), 1000);
  EXPECT_EQ(integralValue(parseJson("9223372036854775807")), INT64_MAX);
  EXPECT_EQ(integralValue(parseJson("-9223372036854775808")), INT64_MIN);
  EXPECT_EQ(integralValue(parseJson("9223372036854775808")), std::nullopt); // 2^63, unsigned
  EXPECT_EQ(integralValue(parseJson("9.3e18")), std::nullopt);              // a double past int64
  EXPECT_EQ(integralValue(parseJson("1.5")), std::nullopt);
  EXPECT_EQ(integralValue(parseJson(R"("3")")), std::nullopt);
  EXPECT_EQ(integralValue(parseJson("true")), std::nullopt);
}

TEST(Json, KindNamesReadInASentence) {
  EXPECT_EQ(kindName(parseJson("[]")), "an array");
  EXPECT_EQ(kindName(parseJson("{}")), "an object");
  EXPECT_EQ(kindName(parseJson(R"("s")")), "a string");
  EXPECT_EQ(kindName(parseJson("1")), "a number");
  EXPECT_EQ(kindName(parseJson("false")), "a boolean");
  EXPECT_EQ(kindName(parseJson("null")), "null");
}

TEST(Json, ParseErrorsSayLineAndColumnWithoutTheLibraryPrefix) {
  try {
    parseJson("{\n  \"a\": tru, \"b\": 1\n}");
    FAIL() << "accepted a bad literal";
  } catch (const JsonParseError &e) {
    std::string text = parseErrorText(e);
    EXPECT_EQ(text.rfind("parse error at line 2, column ", 0), 0u) << text;
    EXPECT_EQ(text.find("[json.exception"), std::string::npos) << text;
  }
  // RFC 8259 only: no comments, no trailing commas.
  EXPECT_THROW(parseJson("[1,]"), JsonParseError);
  EXPECT_THROW(parseJson("// c\n1"), JsonParseError);
  EXPECT_THROW(parseJson("1 2"), JsonParseError);
}

TEST(Json, DumpKeepsMemberOrderAndSurvivesBytesThatAreNotUtf8) {
  Json j = parseJson(R"({ "b" : 1 , "a" : [ true , null ] , "c" : { } })");
  EXPECT_EQ(dumpJson(j), R"({"b":1,"a":[true,null],"c":{}})");
  // A path's bytes need not be UTF-8; JSON text must be, so the bad byte becomes U+FFFD.
  Json path = std::string("/tmp/\xff/k.json");
  EXPECT_EQ(dumpJson(path), "\"/tmp/\xef\xbf\xbd/k.json\"");
  // fp32 values written with 9 significant digits come back as the same float.
  for (float f : {0.1f, -3.18588114f, 1e-7f, 0.707106769f}) {
    char text[32];
    std::snprintf(text, sizeof text, "%.9g", f);
    EXPECT_EQ(static_cast<float>(parseJson(dumpJson(parseJson(text))).get<double>()), f) << text;
  }
}
