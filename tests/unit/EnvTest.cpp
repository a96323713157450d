// EnvTest.cpp — the typed environment registry: parsing, defaults, hard errors, typo warnings.
#include "runtime/Env.h"
#include "runtime/Error.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdio>
#include <unistd.h>

using namespace abp::rt;
using abp::test::ScopedEnv;

namespace {
ErrorCode codeOf(const std::function<void()> &fn, std::string *message = nullptr) {
  try {
    fn();
  } catch (const Error &e) {
    if (message)
      *message = e.what();
    return e.code();
  }
  ADD_FAILURE() << "expected an abp::rt::Error";
  return ErrorCode::Internal;
}
} // namespace

TEST(Env, RegistryHasTheDocumentedVariables) {
  struct Row {
    const char *name;
    EnvType type;
    const char *def;
  };
  const Row expected[] = {
      {"ABP_KERNEL_DIR", EnvType::Path, ""},     {"ABP_CACHE_DIR", EnvType::Path, "~/.cache/abp"},
      {"ABP_CACHE_DISABLE", EnvType::Bool, "0"}, {"ABP_CACHE_MAX_MB", EnvType::Int, "2048"},
      {"ABP_DUMP_DIR", EnvType::Path, ""},       {"ABP_OVERRIDE_DIR", EnvType::Path, ""},
      {"ABP_NVRTC_LIBRARY", EnvType::Path, ""},  {"ABP_CUDA_LIBRARY", EnvType::Path, ""},
      {"ABP_HOST_THREADS", EnvType::Int, "0"},   {"ABP_LOG", EnvType::Bool, "0"}};
  for (const Row &row : expected) {
    const EnvVarInfo &info = env::lookup(row.name);
    EXPECT_EQ(info.type, row.type) << row.name;
    EXPECT_STREQ(info.defaultValue, row.def) << row.name;
    EXPECT_EQ(&env::info(info.var), &info) << row.name;
  }
  // Exactly the variables that change a binary are part of the cache key.
  EXPECT_TRUE(env::lookup("ABP_NVRTC_LINEINFO").invalidatesCache);
  EXPECT_FALSE(env::lookup("ABP_CACHE_DIR").invalidatesCache);
  EXPECT_FALSE(env::lookup("ABP_DUMP_DIR").invalidatesCache);
}

TEST(Env, BooleansAcceptTheDocumentedSpellings) {
  for (const char *yes : {"1", "true", "yes", "on", "TRUE", "Yes", "ON"}) {
    ScopedEnv set("ABP_LOG", std::string(yes));
    EXPECT_TRUE(env::getBool(EnvVar::ABP_LOG)) << yes;
  }
  for (const char *no : {"0", "false", "no", "off", "False", "NO", "Off"}) {
    ScopedEnv set("ABP_LOG", std::string(no));
    EXPECT_FALSE(env::getBool(EnvVar::ABP_LOG)) << no;
  }
}

TEST(Env, MalformedBooleanIsAnErrorNamingTheVariable) {
  ScopedEnv set("ABP_CACHE_DISABLE", std::string("maybe"));
  std::string message;
  EXPECT_EQ(codeOf([] { env::getBool(EnvVar::ABP_CACHE_DISABLE); }, &message),
            ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("ABP_CACHE_DISABLE='maybe'"), std::string::npos) << message;
  EXPECT_EQ(codeOf([] { env::parseBool("2", "X_VAR"); }, &message), ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("X_VAR"), std::string::npos);
}

TEST(Env, UnsetOrEmptyMeansTheDefault) {
  {
    ScopedEnv unset("ABP_CACHE_MAX_MB", std::nullopt);
    EXPECT_EQ(env::getInt(EnvVar::ABP_CACHE_MAX_MB), 2048);
    EXPECT_EQ(env::raw(EnvVar::ABP_CACHE_MAX_MB), "");
  }
  {
    ScopedEnv empty("ABP_CACHE_MAX_MB", std::string(""));
    EXPECT_EQ(env::getInt(EnvVar::ABP_CACHE_MAX_MB), 2048);
  }
  {
    ScopedEnv set("ABP_CACHE_MAX_MB", std::string("17"));
    EXPECT_EQ(env::getInt(EnvVar::ABP_CACHE_MAX_MB), 17);
    EXPECT_EQ(env::raw(EnvVar::ABP_CACHE_MAX_MB), "17");
    EXPECT_EQ(env::effective(env::lookup("ABP_CACHE_MAX_MB")), "17");
  }
  ScopedEnv unset("ABP_CACHE_DISABLE", std::nullopt);
  EXPECT_FALSE(env::getBool(EnvVar::ABP_CACHE_DISABLE));
}

TEST(Env, IntegersMustBeNonNegativeDecimals) {
  for (const char *bad : {"-1", "abc", "1.5", "12x", "99999999999999999999"}) {
    ScopedEnv set("ABP_HOST_THREADS", std::string(bad));
    std::string message;
    EXPECT_EQ(codeOf([] { env::getInt(EnvVar::ABP_HOST_THREADS); }, &message),
              ErrorCode::InvalidArgument)
        << bad;
    EXPECT_NE(message.find("ABP_HOST_THREADS"), std::string::npos) << message;
  }
  EXPECT_EQ(env::parseInt("0", "X"), 0);
  EXPECT_EQ(env::parseInt("123456789", "X"), 123456789);
}

TEST(Env, PathsExpandHome) {
  ScopedEnv home("HOME", std::string("/home/someone"));
  {
    ScopedEnv unset("ABP_CACHE_DIR", std::nullopt);
    EXPECT_EQ(env::getString(EnvVar::ABP_CACHE_DIR), "/home/someone/.cache/abp");
  }
  ScopedEnv set("ABP_CACHE_DIR", std::string("~/elsewhere"));
  EXPECT_EQ(env::getString(EnvVar::ABP_CACHE_DIR), "/home/someone/elsewhere");
  EXPECT_EQ(env::expandHome("~"), "/home/someone");
  EXPECT_EQ(env::expandHome("~user/x"), "~user/x"); // only the caller's own home
  EXPECT_EQ(env::expandHome("/abs/~"), "/abs/~");
}

TEST(Env, ReadingAsTheWrongTypeIsAnInternalError) {
  EXPECT_EQ(codeOf([] { env::getBool(EnvVar::ABP_CACHE_DIR); }), ErrorCode::Internal);
  EXPECT_EQ(codeOf([] { env::getInt(EnvVar::ABP_LOG); }), ErrorCode::Internal);
  EXPECT_EQ(codeOf([] { env::getString(EnvVar::ABP_CACHE_MAX_MB); }), ErrorCode::Internal);
}

TEST(Env, UnregisteredNameIsAHardError) {
  std::string message;
  EXPECT_EQ(codeOf([] { env::lookup("ABP_NOT_A_THING_AT_ALL"); }, &message),
            ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("not a registered"), std::string::npos) << message;
  EXPECT_EQ(codeOf([] { env::lookup("ABP_CACHE_DIRR"); }, &message), ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("did you mean ABP_CACHE_DIR?"), std::string::npos) << message;
}

TEST(Env, EffectiveValuesAreCanonical) {
  ScopedEnv set("ABP_CACHE_DISABLE", std::string("yes"));
  EXPECT_EQ(env::effective(env::lookup("ABP_CACHE_DISABLE")), "1");
  ScopedEnv off("ABP_LOG", std::string("off"));
  EXPECT_EQ(env::effective(env::lookup("ABP_LOG")), "0");
}

TEST(Env, CacheAffectingListsInvalidatingVariablesAtEffectiveValues) {
  auto valueOf = [](const char *name) {
    for (const auto &[n, v] : env::cacheAffecting())
      if (n == name)
        return v;
    return std::string("<absent>");
  };
  {
    ScopedEnv unset("ABP_NVRTC_LINEINFO", std::nullopt);
    EXPECT_EQ(valueOf("ABP_NVRTC_LINEINFO"), "0");
  }
  {
    ScopedEnv on("ABP_NVRTC_LINEINFO", std::string("on"));
    EXPECT_EQ(valueOf("ABP_NVRTC_LINEINFO"), "1");
  }
  EXPECT_EQ(valueOf("ABP_CACHE_DIR"), "<absent>");
}

TEST(Env, UnknownVariablesAndTypoWarnings) {
  const char *envp[] = {"PATH=/bin",          "ABP_CACHE_DIRR=/x", "ABP_LOG=1",
                        "ABP_QQQQQQQQQQQQ=1", "ABP_DUMP_DIR",      nullptr};
  std::vector<std::string> unknown = env::unknownVariables(envp);
  ASSERT_EQ(unknown.size(), 2u);
  EXPECT_EQ(unknown[0], "ABP_CACHE_DIRR");
  EXPECT_EQ(unknown[1], "ABP_QQQQQQQQQQQQ");
  std::vector<std::string> warnings = env::typoWarnings(envp);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_NE(warnings[0].find("did you mean ABP_CACHE_DIR?"), std::string::npos) << warnings[0];
  EXPECT_EQ(warnings[1].find("did you mean"), std::string::npos) << warnings[1];
  EXPECT_EQ(env::closestName("ABP_CAHCE_DIR"), "ABP_CACHE_DIR");
  EXPECT_EQ(env::closestName("ABP_SOMETHING_ELSE_ENTIRELY"), "");
}

// Run in a child process (so the once-per-process flag is fresh): see the test below.
TEST(EnvTypoWarning, ChildProcess) {
  if (!std::getenv("UNIT_ENV_CHILD"))
    GTEST_SKIP() << "runs only as the child of EnvTypoWarning.PrintedOncePerProcess";
  env::warnUnknownOnce();
  env::warnUnknownOnce();
}

TEST(EnvTypoWarning, PrintedOncePerProcess) {
  char self[PATH_MAX] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof self - 1), 0);
  std::string command = std::string("UNIT_ENV_CHILD=1 ABP_CACHE_DIRR=/x '") + self +
                        "' --gtest_filter=EnvTypoWarning.ChildProcess 2>&1";
  FILE *pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  while (size_t got = std::fread(buffer, 1, sizeof buffer, pipe))
    output.append(buffer, got);
  EXPECT_EQ(::pclose(pipe), 0) << output;
  EXPECT_EQ(abp::test::countOf(output, "ABP_CACHE_DIRR is set but is not an abp environment"), 1u)
      << output;
  EXPECT_NE(output.find("did you mean ABP_CACHE_DIR?"), std::string::npos) << output;
}

TEST(Env, DescribeListsEveryVariable) {
  std::string table = env::describe();
  for (const EnvVarInfo &row : env::registry())
    EXPECT_NE(table.find(row.name), std::string::npos) << row.name;
  EXPECT_NE(table.find("part of the cache key"), std::string::npos);
}
