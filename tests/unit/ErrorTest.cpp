// ErrorTest.cpp — structured compile errors: log parsing, numbered source, marked lines.
#include "runtime/Error.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

using namespace abp::rt;
using abp::test::ScopedEnv;

TEST(Error, LinesMentionedByNvrtcLogs) {
  std::string log = "k.cu(3): error: identifier \"x\" is undefined\n"
                    "k.cu(12): warning #177-D: variable \"y\" was declared but never referenced\n"
                    "other.cu(5): error: elsewhere\n"
                    "2 errors detected in the compilation of \"k.cu\".\n";
  EXPECT_EQ(linesMentioned(log, "k.cu"), (std::set<int>{3, 12}));
  EXPECT_EQ(linesMentioned(log, "other.cu"), (std::set<int>{5}));
  EXPECT_EQ(linesMentioned(log, ""), (std::set<int>{3, 5, 12}));
}

TEST(Error, LinesMentionedByGccLogs) {
  std::string log = "/tmp/build/k.cu:7:3: error: 'z' was not declared\n"
                    "k.cu:9: note: here\n"
                    "In file included from k.cu:1:\n"
                    "abp_device.h:40:1: error: header line\n";
  EXPECT_EQ(linesMentioned(log, "k.cu"), (std::set<int>{1, 7, 9}));
  // A name must match whole: "xk.cu" is another file.
  EXPECT_TRUE(linesMentioned("xk.cu:4:1: error\n", "k.cu").empty());
}

TEST(Error, NumberedSourceMarksLines) {
  EXPECT_EQ(numberedSource("a\nb\nc", {2}), "     1 | a\n>    2 | b\n     3 | c\n");
  EXPECT_EQ(numberedSource("x\n", {}), "     1 | x\n");
}

TEST(Error, CompileFailureMessagePrintsLogThenMarkedSource) {
  CompileFailure f;
  f.stage = "nvrtc";
  f.kernel = "gelu";
  f.arch = "sm_80";
  f.options = {"--std=c++17", "-arch=sm_80"};
  f.result = "NVRTC_ERROR_COMPILATION";
  f.log = "gelu.cu(2): error: expected a \";\"\n";
  f.sourceName = "gelu.cu";
  f.source = "#include \"abp_device.h\"\nint x = 1\nint y;\n";
  Error e("NVRTC failed to compile gelu.cu", f);
  EXPECT_EQ(e.code(), ErrorCode::Compile);
  ASSERT_TRUE(e.hasFailure());
  EXPECT_EQ(e.failure().arch, "sm_80");
  EXPECT_EQ(e.failure().stage, "nvrtc");
  std::string what = e.what();
  size_t headline = what.find("NVRTC failed to compile gelu.cu");
  size_t options = what.find("options: --std=c++17 -arch=sm_80");
  size_t log = what.find("gelu.cu(2): error");
  size_t marked = what.find(">    2 | int x = 1");
  size_t unmarked = what.find("     3 | int y;");
  EXPECT_EQ(headline, 0u) << what;
  EXPECT_NE(options, std::string::npos) << what;
  EXPECT_LT(options, log) << what;
  EXPECT_LT(log, marked) << what;
  EXPECT_NE(unmarked, std::string::npos) << what;
  EXPECT_NE(what.find("(NVRTC_ERROR_COMPILATION)"), std::string::npos) << what;
  // detail(): the log then the numbered source, without the headline.
  EXPECT_EQ(e.detail().find("NVRTC failed"), std::string::npos);
  EXPECT_NE(e.detail().find(">    2 | int x = 1"), std::string::npos);
  EXPECT_EQ(e.detail(), formatFailureDetail(f));
}

TEST(Error, PlainErrorsCarryCodeAndMessage) {
  Error e(ErrorCode::NotFound, "no kernel named 'x'");
  EXPECT_EQ(e.code(), ErrorCode::NotFound);
  EXPECT_STREQ(e.what(), "no kernel named 'x'");
  EXPECT_FALSE(e.hasFailure());
  EXPECT_EQ(e.detail(), "");
  EXPECT_STREQ(errorCodeName(ErrorCode::NoDriver), "no CUDA driver");
  EXPECT_STREQ(errorCodeName(ErrorCode::Compile), "compile error");
  // The numeric values are the C API's abp_status codes.
  EXPECT_EQ(static_cast<int>(ErrorCode::InvalidArgument), 1);
  EXPECT_EQ(static_cast<int>(ErrorCode::Internal), 8);
}

TEST(Error, DiagnosticsGoToStderr) {
  testing::internal::CaptureStderr();
  warning("careful");
  notice("noted");
  {
    ScopedEnv off("ABP_LOG", std::nullopt);
    logInfo("hidden");
  }
  {
    ScopedEnv bad("ABP_LOG", std::string("bogus")); // never turns logging into a failure
    logInfo("hidden too");
  }
  {
    ScopedEnv on("ABP_LOG", std::string("1"));
    logInfo("shown");
  }
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("abp: warning: careful\n"), std::string::npos) << err;
  EXPECT_NE(err.find("abp: noted\n"), std::string::npos) << err;
  EXPECT_NE(err.find("abp: shown\n"), std::string::npos) << err;
  EXPECT_EQ(err.find("hidden"), std::string::npos) << err;
}
