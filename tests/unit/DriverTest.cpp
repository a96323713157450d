// DriverTest.cpp — the dlopen'ed CUDA driver: a clear "no CUDA driver" without a GPU (missing
// library, stub library, not a driver), and context/memory basics when a GPU is present.
#include "runtime/Driver.h"
#include "runtime/Error.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <unistd.h>
#include <vector>

using namespace abp::rt;

namespace {
std::string openError(const std::string &path) {
  try {
    Driver::open(path);
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::NoDriver) << e.what();
    return e.what();
  }
  ADD_FAILURE() << path << " loaded as a CUDA driver";
  return "";
}
} // namespace

TEST(Driver, MissingLibraryIsNoDriver) {
  std::string message = openError("/nonexistent/libcuda.so.1");
  EXPECT_EQ(message.rfind("no CUDA driver", 0), 0u) << message;
  EXPECT_NE(message.find("/nonexistent/libcuda.so.1"), std::string::npos) << message;
}

TEST(Driver, StubLibraryIsNoDriver) {
  std::string stub = ABP_TEST_CUDA_STUB;
  // The path is the build machine's; a carried test binary may run where it does not exist.
  if (stub.empty() || access(stub.c_str(), R_OK) != 0)
    GTEST_SKIP() << "the CUDA toolkit has no stubs/libcuda.so here";
  std::string message = openError(stub);
  EXPECT_EQ(message.rfind("no CUDA driver", 0), 0u) << message;
  EXPECT_NE(message.find("CUDA_ERROR_STUB_LIBRARY"), std::string::npos) << message;
}

TEST(Driver, LibraryWithoutDriverSymbolsIsNoDriver) {
  std::string message = openError("libm.so.6");
  EXPECT_EQ(message.rfind("no CUDA driver", 0), 0u) << message;
  EXPECT_NE(message.find("lacks cuInit"), std::string::npos) << message;
}

TEST(Driver, WithoutAGpuTheProcessDriverIsUnavailableEveryTime) {
  if (Driver::available())
    GTEST_SKIP() << "a CUDA driver with a device is present";
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      Driver::get();
      FAIL() << "Driver::get() succeeded without a driver";
    } catch (const Error &e) {
      EXPECT_EQ(e.code(), ErrorCode::NoDriver);
      EXPECT_EQ(std::string(e.what()).rfind("no CUDA driver", 0), 0u) << e.what();
    }
  }
  EXPECT_FALSE(Driver::available());
}

// Run by ctest with ABP_CUDA_LIBRARY set at process start (tests/unit/CMakeLists.txt).
TEST(DriverFromEnvironment, ReportsNoDriverNamingTheVariable) {
  const char *expect = std::getenv("UNIT_EXPECT_DRIVER");
  const char *library = std::getenv("ABP_CUDA_LIBRARY");
  if (!expect || !library)
    GTEST_SKIP() << "runs as its own ctest with ABP_CUDA_LIBRARY and UNIT_EXPECT_DRIVER set";
  EXPECT_FALSE(Driver::available());
  try {
    Driver::get();
    FAIL();
  } catch (const Error &e) {
    std::string message = e.what();
    EXPECT_EQ(e.code(), ErrorCode::NoDriver);
    EXPECT_EQ(message.rfind("no CUDA driver", 0), 0u) << message;
    EXPECT_NE(message.find(std::string("ABP_CUDA_LIBRARY=") + library), std::string::npos)
        << message;
    if (std::string(expect) == "stub")
      EXPECT_NE(message.find("stub"), std::string::npos) << message;
    else
      EXPECT_NE(message.find("cannot load"), std::string::npos) << message;
  }
}

TEST(DriverGpu, DevicesContextsAndMemory) {
  if (!Driver::available())
    GTEST_SKIP() << "no CUDA driver with a device on this machine";
  Driver &driver = Driver::get();
  ASSERT_GE(driver.deviceCount(), 1);
  EXPECT_GE(driver.version(), 11000);
  const DeviceInfo &d = driver.device(0);
  EXPECT_EQ(d.arch, "sm_" + std::to_string(d.major * 10 + d.minor));
  EXPECT_GT(d.multiprocessors, 0);
  EXPECT_THROW(driver.device(driver.deviceCount()), Error);
  CUcontext a = driver.contextFor(0);
  EXPECT_NE(a, nullptr);
  EXPECT_EQ(driver.contextFor(0), a); // the current context is reused
  std::vector<int> host(1000), back(1000, -1);
  for (int i = 0; i < 1000; ++i)
    host[i] = i * 7;
  CUdeviceptr p = driver.allocate(host.size() * sizeof(int));
  driver.copyToDevice(p, host.data(), host.size() * sizeof(int));
  driver.copyToHost(back.data(), p, back.size() * sizeof(int));
  driver.synchronize();
  driver.release(p);
  EXPECT_EQ(back, host);
  try {
    driver.loadModule("not a module", "garbage");
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::Cuda);
    EXPECT_NE(std::string(e.what()).find("cuModuleLoadData failed for garbage"), std::string::npos);
  }
  EXPECT_NE(driver.errorText(1).find("CUDA_ERROR_INVALID_VALUE"), std::string::npos);
}
