// CApiTest.cpp — libabp.so through abp.h only: statuses, thread-local messages, the CPU path,
// offline compiles, cache statistics, the env registry and the no-driver behaviour.
#include "bindings/c/abp.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using abp::test::ScopedEnv;
using abp::test::TempDir;

namespace {
struct LibraryHandle {
  abp_library *lib = nullptr;
  explicit LibraryHandle(const std::string &dir) {
    EXPECT_EQ(abp_library_open(dir.c_str(), &lib), ABP_OK) << abp_last_error();
  }
  ~LibraryHandle() { abp_library_close(lib); }
};
} // namespace

TEST(CApi, Version) { EXPECT_STREQ(abp_version(), ABP_VERSION_STRING); }

TEST(CApi, OpenLookupAndLaunchOnTheCpu) {
  LibraryHandle h(abp::test::dataDir());
  ASSERT_NE(h.lib, nullptr);
  abp_kernel *scale = nullptr;
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &scale), ABP_OK);
  const int64_t n = 1000;
  std::vector<float> x(n), y(n, 0);
  for (int64_t i = 0; i < n; ++i)
    x[i] = float(i) - 500.0f;
  const float *px = x.data();
  float *py = y.data();
  float alpha = 0.25f;
  int64_t count = n;
  void *args[] = {&px, &alpha, &py, &count};
  ASSERT_EQ(abp_kernel_prepare(scale, -1), ABP_OK);
  ASSERT_EQ(abp_kernel_launch(scale, -1, args, 4, n, nullptr), ABP_OK) << abp_last_error();
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(y[i], x[i] * 0.25f) << i;
}

TEST(CApi, StatusesAndThreadLocalMessages) {
  LibraryHandle h(abp::test::dataDir());
  abp_kernel *k = nullptr;
  EXPECT_EQ(abp_kernel_get(h.lib, "nope", "f32", &k), ABP_ERROR_NOT_FOUND);
  EXPECT_NE(std::string(abp_last_error()).find("no kernel named 'nope'"), std::string::npos);
  EXPECT_EQ(abp_kernel_get(h.lib, "test_scale", "f128", &k), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("dtype"), std::string::npos);
  EXPECT_EQ(abp_kernel_get(nullptr, "test_scale", "f32", &k), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(abp_last_error(), "lib: must not be NULL");
  EXPECT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", nullptr), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(abp_kernel_launch(nullptr, -1, nullptr, 0, 0, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &k), ABP_OK);
  float alpha = 1, data[4] = {};
  float *tensor = data;
  int64_t n = 4;
  void *args[] = {&tensor, &alpha, &tensor, &n};
  EXPECT_EQ(abp_kernel_launch(k, -1, args, 3, 4, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("nargs"), std::string::npos);
  EXPECT_EQ(abp_kernel_launch(k, -1, args, 4, 5, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  // Messages are per thread: another thread sees its own (empty) message.
  std::string other = "unset";
  std::thread([&] { other = abp_last_error(); }).join();
  EXPECT_EQ(other, "");
  abp_library *missing = nullptr;
  EXPECT_EQ(abp_library_open("/nonexistent/kernels", &missing), ABP_ERROR_NOT_FOUND);
  EXPECT_EQ(missing, nullptr);
  EXPECT_NE(std::string(abp_last_error()).find("/nonexistent/kernels does not exist"), std::string::npos);
  // A file is there, not a directory (it said "does not exist").
  EXPECT_EQ(abp_library_open("/dev/null", &missing), ABP_ERROR_NOT_FOUND);
  EXPECT_NE(std::string(abp_last_error()).find("/dev/null is not a directory"), std::string::npos)
      << abp_last_error();
  EXPECT_EQ(abp_library_open(nullptr, nullptr), ABP_ERROR_INVALID_ARGUMENT);
}

TEST(CApi, ANullDataPointerIsAnErrorNotACrash) {
  // A tensor without storage (a FakeTensor's data_ptr() is 0) handed to a launch of n > 0.
  LibraryHandle h(abp::test::dataDir());
  abp_kernel *scale = nullptr;
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &scale), ABP_OK);
  std::vector<float> y(8);
  const float *px = nullptr;
  float *py = y.data();
  float alpha = 2;
  int64_t count = 8;
  void *args[] = {&px, &alpha, &py, &count};
  EXPECT_EQ(abp_kernel_launch(scale, -1, args, 4, 8, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("args[0]: a NULL data pointer for 8 elements"),
            std::string::npos)
      << abp_last_error();
  const float *px2 = y.data();
  float *pnull = nullptr;
  void *args2[] = {&px2, &alpha, &pnull, &count};
  EXPECT_EQ(abp_kernel_launch(scale, -1, args2, 4, 8, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  // Nothing to touch: NULL is fine.
  int64_t zero = 0;
  void *empty[] = {&px, &alpha, &pnull, &zero};
  EXPECT_EQ(abp_kernel_launch(scale, -1, empty, 4, 0, nullptr), ABP_OK) << abp_last_error();
}

TEST(CApi, AClosedLibraryIsRefusedAndClosingTwiceIsANoOp) {
  abp_library *lib = nullptr;
  ASSERT_EQ(abp_library_open(abp::test::dataDir().c_str(), &lib), ABP_OK);
  abp_library_close(lib);
  abp_library_close(lib); // was a double free
  abp_library_close(nullptr);
  abp_kernel *k = nullptr;
  EXPECT_EQ(abp_kernel_get(lib, "test_scale", "f32", &k), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("lib: not an open library"), std::string::npos);
}

TEST(CApi, AKernelOfAClosedLibraryIsRefusedNotRead) {
  // A kernel handle outlived its library (and a library handle passed as a kernel): launching
  // or preparing it read freed memory (a crash under ASan, garbage messages without).
  abp_library *lib = nullptr;
  ASSERT_EQ(abp_library_open(abp::test::dataDir().c_str(), &lib), ABP_OK);
  abp_kernel *scale = nullptr;
  ASSERT_EQ(abp_kernel_get(lib, "test_scale", "f32", &scale), ABP_OK);
  float alpha = 1, data[4] = {};
  float *tensor = data;
  int64_t n = 4;
  void *args[] = {&tensor, &alpha, &tensor, &n};
  ASSERT_EQ(abp_kernel_launch(scale, -1, args, 4, 4, nullptr), ABP_OK) << abp_last_error();
  EXPECT_EQ(abp_kernel_launch(reinterpret_cast<abp_kernel *>(lib), -1, args, 4, 4, nullptr),
            ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("kernel: not a kernel of an open library"),
            std::string::npos)
      << abp_last_error();
  abp_library_close(lib);
  EXPECT_EQ(abp_kernel_launch(scale, -1, args, 4, 4, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("its library was closed"), std::string::npos);
  EXPECT_EQ(abp_kernel_prepare(scale, -1), ABP_ERROR_INVALID_ARGUMENT);
  // Another library's kernels are unaffected by the close.
  LibraryHandle h(abp::test::dataDir());
  abp_kernel *again = nullptr;
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &again), ABP_OK);
  EXPECT_EQ(abp_kernel_launch(again, -1, args, 4, 4, nullptr), ABP_OK) << abp_last_error();
}

TEST(CApi, ACountBeyondWhatAKernelIndexesIsRefused) {
  // n near INT64_MAX overflowed the grid computation to no blocks: the launch returned OK and
  // did nothing.
  LibraryHandle h(abp::test::dataDir());
  abp_kernel *scale = nullptr;
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &scale), ABP_OK);
  float alpha = 1, data[4] = {};
  float *tensor = data;
  for (int64_t n : {INT64_MAX, (int64_t{1} << 62) + 1}) {
    int64_t count = n;
    void *args[] = {&tensor, &alpha, &tensor, &count};
    EXPECT_EQ(abp_kernel_launch(scale, -1, args, 4, n, nullptr), ABP_ERROR_INVALID_ARGUMENT) << n;
    EXPECT_NE(std::string(abp_last_error()).find("at most 2^62"), std::string::npos)
        << abp_last_error();
  }
}

/// 0 if a 4-element CPU launch under ABP_HOST_THREADS=abc fails naming the variable.
static int smallLaunchUnderUnparsableHostThreads() {
  ::setenv("ABP_HOST_THREADS", "abc", 1);
  abp_library *lib = nullptr;
  abp_kernel *scale = nullptr;
  if (abp_library_open(abp::test::dataDir().c_str(), &lib) != ABP_OK ||
      abp_kernel_get(lib, "test_scale", "f32", &scale) != ABP_OK)
    return 2;
  float alpha = 1, data[4] = {};
  float *tensor = data;
  int64_t n = 4;
  void *args[] = {&tensor, &alpha, &tensor, &n};
  abp_status status = abp_kernel_launch(scale, -1, args, 4, 4, nullptr);
  bool named = std::string(abp_last_error()).find("ABP_HOST_THREADS='abc'") != std::string::npos;
  return status != ABP_OK && named ? 0 : 1;
}

TEST(CApiDeathTest, AnUnparsableHostThreadsFailsSmallLaunchesToo) {
  // The pool reads ABP_HOST_THREADS when the first launch too large to run inline makes it, so
  // a value that does not parse failed only launches over 32768 elements. Checked in a fresh
  // process (the "threadsafe" style re-runs this binary), where no launch has run yet.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::_Exit(smallLaunchUnderUnparsableHostThreads()), ::testing::ExitedWithCode(0), "");
}

TEST(CApi, DefaultDirectoryFollowsAbpKernelDir) {
  ScopedEnv dir("ABP_KERNEL_DIR", abp::test::dataDir());
  abp_library *lib = nullptr;
  ASSERT_EQ(abp_library_open(nullptr, &lib), ABP_OK) << abp_last_error();
  abp_kernel *k = nullptr;
  EXPECT_EQ(abp_kernel_get(lib, "test_random", "bf16", &k), ABP_OK);
  abp_library_close(lib);
}

TEST(CApi, OperatorsJson) {
  LibraryHandle h(abp::test::dataDir());
  const char *json = nullptr;
  ASSERT_EQ(abp_library_operators_json(h.lib, &json), ABP_OK);
  std::string text = json;
  EXPECT_EQ(text.front(), '[');
  EXPECT_NE(text.find(R"("name":"test_sign")"), std::string::npos) << text;
  EXPECT_NE(text.find(R"("kernels":[{"name":"test_sign_codes")"), std::string::npos) << text;
  EXPECT_EQ(abp_library_operators_json(h.lib, nullptr), ABP_ERROR_INVALID_ARGUMENT);
  // Each operator names the manifest it came from, as the runtime resolved it.
  EXPECT_NE(text.find(R"("manifest":{"path":")"), std::string::npos) << text;
}

TEST(CApi, ManifestJsonIsTheDocumentTheRuntimeRead) {
  LibraryHandle h(abp::test::dataDir());
  const char *json = nullptr;
  ASSERT_EQ(abp_library_manifest_json(h.lib, "test_sign", &json), ABP_OK) << abp_last_error();
  std::string text = json;
  EXPECT_EQ(text.rfind(R"({"format":)", 0), 0u) << text;
  EXPECT_NE(text.find(R"("name":"test_sign")"), std::string::npos) << text;
  EXPECT_EQ(abp_library_manifest_json(h.lib, "no_such_operator", &json), ABP_ERROR_NOT_FOUND);
  EXPECT_NE(std::string(abp_last_error()).find("no_such_operator"), std::string::npos);
  EXPECT_EQ(abp_library_manifest_json(h.lib, nullptr, &json), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(abp_library_manifest_json(h.lib, "test_sign", nullptr), ABP_ERROR_INVALID_ARGUMENT);
}

TEST(CApi, CompileForArchWithoutAGpu) {
  LibraryHandle h(abp::test::dataDir());
  size_t ptx = 0, cubin = 0;
  ASSERT_EQ(abp_compile_for_arch(h.lib, "test_scale", "sm_80", "ptx", &ptx), ABP_OK)
      << abp_last_error();
  ASSERT_EQ(abp_compile_for_arch(h.lib, "test_scale", "sm_90", "cubin", &cubin), ABP_OK)
      << abp_last_error();
  EXPECT_GT(ptx, 1000u);
  EXPECT_GT(cubin, 1000u);
  EXPECT_EQ(abp_compile_for_arch(h.lib, "test_scale", "sm_80", "host", &ptx),
            ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(abp_compile_for_arch(h.lib, "test_scale", "sm_80", "elf", &ptx),
            ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(abp_compile_for_arch(h.lib, "test_scale", "sm_20", "ptx", &ptx),
            ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(abp_compile_for_arch(h.lib, "nope", "sm_80", "ptx", &ptx), ABP_ERROR_NOT_FOUND);
}

TEST(CApi, CompileFailuresCarryLogAndNumberedSource) {
  TempDir dir;
  abp::test::writeText(dir / "test_kernels.json",
                       abp::test::readText(abp::test::dataDir() + "/test_kernels.json"));
  abp::test::writeText(dir / "test_kernels.cu",
                       "#include \"abp_device.h\"\nABP_KERNEL void broken( { }\n");
  LibraryHandle h(dir.path());
  size_t size = 0;
  EXPECT_EQ(abp_compile_for_arch(h.lib, "test_scale", "sm_80", "ptx", &size), ABP_ERROR_COMPILE);
  std::string message = abp_last_error(), detail = abp_last_error_detail();
  EXPECT_NE(message.find("failed to compile test_kernels.cu"), std::string::npos) << message;
  EXPECT_NE(detail.find("test_kernels.cu(2)"), std::string::npos) << detail;
  EXPECT_NE(detail.find(">    2 | ABP_KERNEL void broken( { }"), std::string::npos) << detail;
  // A later non-compile failure has no detail.
  abp_kernel *k = nullptr;
  EXPECT_EQ(abp_kernel_get(h.lib, "nope", "f32", &k), ABP_ERROR_NOT_FOUND);
  EXPECT_STREQ(abp_last_error_detail(), "");
}

TEST(CApi, CacheStatsAndClear) {
  LibraryHandle h(abp::test::dataDir());
  size_t size = 0;
  ASSERT_EQ(abp_compile_for_arch(h.lib, "test_unpack", "sm_90", "ptx", &size), ABP_OK);
  ASSERT_EQ(abp_compile_for_arch(h.lib, "test_unpack", "sm_90", "ptx", &size), ABP_OK);
  const char *json = nullptr;
  ASSERT_EQ(abp_cache_stats(&json), ABP_OK);
  std::string stats = json;
  EXPECT_NE(stats.find("\"memory_hits\":1"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"disk_hits\":"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"misses\":"), std::string::npos) << stats;
  EXPECT_NE(stats.find("\"compile_ms\":"), std::string::npos) << stats;
  ASSERT_EQ(abp_cache_clear(), ABP_OK);
  const char *dir = std::getenv("ABP_CACHE_DIR");
  if (dir && *dir) { // no entry's two-hex-digit prefix directory remains (tmp/ and what others
                     // keep under the root, e.g. the Python package's plan-lane/ builds, stay)
    for (const std::string &name : abp::test::listDir(dir)) {
      bool prefix = name.size() == 2 && std::isxdigit(static_cast<unsigned char>(name[0])) &&
                    std::isxdigit(static_cast<unsigned char>(name[1]));
      EXPECT_FALSE(prefix) << "cache entry prefix " << name << " left after abp_cache_clear";
    }
  }
  // After clear() the next compile is a miss, not a hit.
  ASSERT_EQ(abp_compile_for_arch(h.lib, "test_unpack", "sm_90", "ptx", &size), ABP_OK);
  ASSERT_EQ(abp_cache_stats(&json), ABP_OK);
  EXPECT_NE(std::string(json).find("\"memory_hits\":1,"), std::string::npos) << json;
  EXPECT_EQ(abp_cache_stats(nullptr), ABP_ERROR_INVALID_ARGUMENT);
}

TEST(CApi, EnvGetReturnsEffectiveValues) {
  const char *value = nullptr;
  {
    ScopedEnv unset("ABP_CACHE_MAX_MB", std::nullopt);
    ASSERT_EQ(abp_env_get("ABP_CACHE_MAX_MB", &value), ABP_OK);
    EXPECT_STREQ(value, "2048");
  }
  {
    ScopedEnv set("ABP_LOG", std::string("yes"));
    ASSERT_EQ(abp_env_get("ABP_LOG", &value), ABP_OK);
    EXPECT_STREQ(value, "1");
  }
  {
    ScopedEnv bad("ABP_LOG", std::string("sometimes"));
    EXPECT_EQ(abp_env_get("ABP_LOG", &value), ABP_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(abp_last_error()).find("ABP_LOG='sometimes'"), std::string::npos);
  }
  EXPECT_EQ(abp_env_get("ABP_NOT_REGISTERED", &value), ABP_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(abp_last_error()).find("not a registered"), std::string::npos);
  EXPECT_EQ(abp_env_get(nullptr, &value), ABP_ERROR_INVALID_ARGUMENT);
}

TEST(CApi, WithoutADriverCudaCallsSayNoDriver) {
  if (abp_cuda_available())
    GTEST_SKIP() << "a CUDA driver with a device is present";
  EXPECT_EQ(abp_cuda_available(), 0);
  void *p = nullptr;
  EXPECT_EQ(abp_cuda_malloc(0, 16, &p), ABP_ERROR_NO_DRIVER);
  EXPECT_EQ(std::string(abp_last_error()).rfind("no CUDA driver", 0), 0u) << abp_last_error();
  char host[4] = {};
  EXPECT_EQ(abp_cuda_free(0, nullptr), ABP_ERROR_NO_DRIVER);
  EXPECT_EQ(abp_cuda_memcpy_htod(0, host, host, 4), ABP_ERROR_NO_DRIVER);
  EXPECT_EQ(abp_cuda_memcpy_dtoh(0, host, host, 4), ABP_ERROR_NO_DRIVER);
  EXPECT_EQ(abp_cuda_synchronize(0), ABP_ERROR_NO_DRIVER);
  const char *arch = nullptr;
  EXPECT_EQ(abp_cuda_device_arch(0, &arch), ABP_ERROR_NO_DRIVER);
  LibraryHandle h(abp::test::dataDir());
  abp_kernel *k = nullptr;
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &k), ABP_OK);
  EXPECT_EQ(abp_kernel_prepare(k, 0), ABP_ERROR_NO_DRIVER);
  float v = 1;
  const float *pv = &v;
  float *out = &v;
  int64_t n = 1;
  void *args[] = {&pv, &v, &out, &n};
  EXPECT_EQ(abp_kernel_launch(k, 0, args, 4, 1, nullptr), ABP_ERROR_NO_DRIVER);
}

// Run by ctest with ABP_CUDA_LIBRARY pointing nowhere (tests/unit/CMakeLists.txt).
TEST(CApiDriverFromEnvironment, MissingLibraryIsNoDriver) {
  if (!std::getenv("UNIT_EXPECT_DRIVER"))
    GTEST_SKIP() << "runs as its own ctest with ABP_CUDA_LIBRARY set";
  EXPECT_EQ(abp_cuda_available(), 0);
  const char *arch = nullptr;
  EXPECT_EQ(abp_cuda_device_arch(0, &arch), ABP_ERROR_NO_DRIVER);
  EXPECT_NE(std::string(abp_last_error()).find(std::getenv("ABP_CUDA_LIBRARY")), std::string::npos)
      << abp_last_error();
}

TEST(CApiGpu, MemoryRoundTripAndDeviceLaunch) {
  if (!abp_cuda_available())
    GTEST_SKIP() << "no CUDA driver with a device on this machine";
  const char *arch = nullptr;
  ASSERT_EQ(abp_cuda_device_arch(0, &arch), ABP_OK);
  EXPECT_EQ(std::string(arch).rfind("sm_", 0), 0u);
  const int64_t n = 4096;
  std::vector<float> x(n), y(n, 0);
  for (int64_t i = 0; i < n; ++i)
    x[i] = float(i);
  void *dx = nullptr, *dy = nullptr;
  ASSERT_EQ(abp_cuda_malloc(0, n * 4, &dx), ABP_OK) << abp_last_error();
  ASSERT_EQ(abp_cuda_malloc(0, n * 4, &dy), ABP_OK) << abp_last_error();
  ASSERT_EQ(abp_cuda_memcpy_htod(0, dx, x.data(), n * 4), ABP_OK);
  LibraryHandle h(abp::test::dataDir());
  abp_kernel *k = nullptr;
  ASSERT_EQ(abp_kernel_get(h.lib, "test_scale", "f32", &k), ABP_OK);
  float alpha = 3;
  int64_t count = n;
  void *args[] = {&dx, &alpha, &dy, &count};
  ASSERT_EQ(abp_kernel_launch(k, 0, args, 4, n, nullptr), ABP_OK) << abp_last_error();
  ASSERT_EQ(abp_cuda_synchronize(0), ABP_OK);
  ASSERT_EQ(abp_cuda_memcpy_dtoh(0, y.data(), dy, n * 4), ABP_OK);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(y[i], x[i] * 3) << i;
  EXPECT_EQ(abp_cuda_free(0, dx), ABP_OK);
  EXPECT_EQ(abp_cuda_free(0, dy), ABP_OK);
}
