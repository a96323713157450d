// KernelDirTest.cpp — every manifest of a kernel directory (the build's, filled by the compiler
// from ops/): valid, NVRTC-compiles to cubin for sm_80 and sm_90, and its host library exports
// an S__host entry for every symbol.
//
// The suite is instantiated over the manifests of $UNIT_KERNEL_DIR, read when the test binary
// starts: ctest runs it as one test (runtime.kernel-dir) with UNIT_KERNEL_DIR set to the build's
// kernels/, so the list is always current. By hand, with the filter
// --gtest_filter='KernelDir.*:*KernelDirManifest.*':
//   UNIT_KERNEL_DIR=build/kernels build/bin/abp-runtime-tests --gtest_filter=...
#include "runtime/Files.h"
#include "runtime/HostBackend.h"
#include "runtime/Manifest.h"
#include "runtime/Nvrtc.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <dirent.h>

using namespace abp::rt;

namespace {
std::string kernelDir() {
  const char *dir = std::getenv("UNIT_KERNEL_DIR");
  return dir ? std::string(dir) : std::string();
}

std::vector<std::string> manifestsIn(const std::string &dir) {
  std::vector<std::string> names;
  if (DIR *d = dir.empty() ? nullptr : ::opendir(dir.c_str())) {
    while (dirent *e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0)
        names.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

class KernelDirManifest : public testing::TestWithParam<std::string> {
protected:
  Manifest manifest() const { return loadManifest(kernelDir() + "/" + GetParam()); }
};
} // namespace

TEST(KernelDir, HasManifests) {
  if (kernelDir().empty())
    GTEST_SKIP() << "runs as the ctest runtime.kernel-dir, with UNIT_KERNEL_DIR set";
  if (manifestsIn(kernelDir()).empty())
    GTEST_SKIP() << "no manifests in " << kernelDir()
                 << " yet: configure with ABP_ENABLE_COMPILER=ON and build to fill it";
  SUCCEED();
}

TEST_P(KernelDirManifest, CompilesForSm80AndSm90) {
  Manifest m = manifest();
  std::string source = readFile(m.sourcePath());
  for (const char *arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = Nvrtc::get().compile(m.stem(), m.source, source, arch, OutputKind::Cubin,
                                           deviceHeaderSource());
    ASSERT_EQ(out.binary.substr(0, 4), "\x7f"
                                       "ELF")
        << arch;
    for (const KernelRecord &k : m.kernels)
      for (const auto &[dtype, symbol] : k.symbols)
        EXPECT_NE(out.binary.find(symbol), std::string::npos) << arch << " lacks " << symbol;
  }
}

TEST_P(KernelDirManifest, HostLibraryHasEveryEntry) {
  Manifest m = manifest();
  if (m.hostLibrary.empty())
    GTEST_SKIP() << m.path << " names no host library";
  HostLibrary lib(m.hostLibraryPath());
  for (const KernelRecord &k : m.kernels)
    for (const auto &[dtype, symbol] : k.symbols)
      EXPECT_NE(lib.entry(symbol), nullptr) << symbol;
}

INSTANTIATE_TEST_SUITE_P(Build, KernelDirManifest, testing::ValuesIn(manifestsIn(kernelDir())),
                         [](const testing::TestParamInfo<std::string> &info) {
                           std::string name = info.param.substr(0, info.param.size() - 5);
                           for (char &c : name)
                             if (!std::isalnum(static_cast<unsigned char>(c)))
                               c = '_';
                           return name;
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(KernelDirManifest);
