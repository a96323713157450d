// DumpTest.cpp — ABP_DUMP_DIR writes every compile stage; ABP_OVERRIDE_DIR swaps in a source.
#include "runtime/Dump.h"
#include "runtime/HostCompile.h"
#include "runtime/Library.h"
#include "runtime/Nvrtc.h"
#include "runtime/Sha256.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

using namespace abp::rt;
using abp::test::ScopedEnv;
using abp::test::TempDir;

TEST(Dump, WritesEveryStageOfACompile) {
  TempDir dir;
  ScopedEnv dump("ABP_DUMP_DIR", dir.path());
  std::string binary = "PTX TEXT";
  DumpRecord r;
  r.unit = "gelu";
  r.keyHash = "0123456789abcdef";
  r.source = "source text";
  r.kind = OutputKind::Ptx;
  r.arch = "sm_80";
  r.binary = &binary;
  r.log = "warning: x";
  r.options = {"--std=c++17", "-arch=compute_80"};
  std::string where = dumpCompile(r);
  EXPECT_EQ(where, dir / "gelu-01234567");
  EXPECT_EQ(abp::test::listDir(where),
            (std::vector<std::string>{"compile.log", "kernel.cu", "kernel.ptx", "options.txt"}));
  EXPECT_EQ(abp::test::readText(where + "/kernel.cu"), "source text");
  EXPECT_EQ(abp::test::readText(where + "/kernel.ptx"), "PTX TEXT");
  EXPECT_EQ(abp::test::readText(where + "/compile.log"), "warning: x");
  std::string options = abp::test::readText(where + "/options.txt");
  EXPECT_EQ(options.rfind("--std=c++17\n-arch=compute_80\n", 0), 0u) << options;
  EXPECT_NE(options.find("arch: sm_80, output: ptx"), std::string::npos) << options;
  // A failed compile has no binary: the rest is still written.
  r.binary = nullptr;
  r.kind = OutputKind::Cubin;
  r.keyHash = "fedcba9876543210";
  where = dumpCompile(r);
  EXPECT_EQ(abp::test::listDir(where),
            (std::vector<std::string>{"compile.log", "kernel.cu", "options.txt"}));
}

TEST(Dump, NothingWithoutTheVariable) {
  ScopedEnv unset("ABP_DUMP_DIR", std::nullopt);
  DumpRecord r;
  r.unit = "x";
  r.keyHash = "0123456789";
  EXPECT_EQ(dumpCompile(r), "");
}

TEST(Dump, UnwritableDumpDirIsAWarningNotAFailure) {
  TempDir dir;
  abp::test::writeText(dir / "file", "x");
  ScopedEnv dump("ABP_DUMP_DIR", dir / "file");
  DumpRecord r;
  r.unit = "x";
  r.keyHash = "0123456789";
  testing::internal::CaptureStderr();
  EXPECT_NO_THROW(dumpCompile(r));
  EXPECT_NE(testing::internal::GetCapturedStderr().find("abp: warning: ABP_DUMP_DIR"),
            std::string::npos);
}

TEST(Override, FoundBySourceHashAndAnnounced) {
  TempDir dir;
  ScopedEnv over("ABP_OVERRIDE_DIR", dir.path());
  const std::string source = "generated source\n";
  EXPECT_FALSE(findOverride(source, "gelu"));
  abp::test::writeText(dir / (Sha256::hex(source) + ".cu"), "hand-edited\n");
  testing::internal::CaptureStderr();
  std::optional<SourceOverride> o = findOverride(source, "gelu");
  std::string err = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(o);
  EXPECT_EQ(o->source, "hand-edited\n");
  EXPECT_EQ(o->path, dir / (Sha256::hex(source) + ".cu"));
  EXPECT_NE(err.find("ABP_OVERRIDE_DIR"), std::string::npos) << err;
  EXPECT_NE(err.find("gelu"), std::string::npos) << err;
  EXPECT_FALSE(findOverride("another source", "gelu"));
  ScopedEnv unset("ABP_OVERRIDE_DIR", std::nullopt);
  EXPECT_FALSE(findOverride(source, "gelu"));
}

TEST(Override, CompileUnitUsesTheOverrideAndDumpsIt) {
  TempDir overrides, dumps;
  ScopedEnv over("ABP_OVERRIDE_DIR", overrides.path());
  ScopedEnv dump("ABP_DUMP_DIR", dumps.path());
  const std::string generated =
      "#include \"abp_device.h\"\nABP_KERNEL void abp_generated_kernel(float *p) { p[0] = 1; }\n";
  const std::string edited =
      "#include \"abp_device.h\"\nABP_KERNEL void abp_edited_kernel(float *p) { p[0] = 2; }\n";
  abp::test::writeText(overrides / (Sha256::hex(generated) + ".cu"), edited);
  testing::internal::CaptureStderr();
  CacheLookup r = compileUnit("override_test", "override_test.cu", generated, "sm_80",
                              OutputKind::Ptx, "offline");
  testing::internal::GetCapturedStderr();
  EXPECT_NE(r.artifact->binary.find("abp_edited_kernel"), std::string::npos);
  EXPECT_EQ(r.artifact->binary.find("abp_generated_kernel"), std::string::npos);
  std::vector<std::string> dirs = abp::test::listDir(dumps.path());
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_EQ(dirs[0].rfind("override_test-", 0), 0u) << dirs[0];
  EXPECT_EQ(abp::test::readText(dumps / (dirs[0] + "/kernel.cu")), edited);
  EXPECT_NE(abp::test::readText(dumps / (dirs[0] + "/kernel.ptx")).find("abp_edited_kernel"),
            std::string::npos);
}

TEST(Dump, TheCpuPathsHostCompilesAreDumpedToo) {
  // compile_operators on a machine without a GPU builds the host library only: ABP_DUMP_DIR
  // must show that compile as well (source, the compiler's flags, its log and the library).
  TempDir out, dumps;
  ScopedEnv dump("ABP_DUMP_DIR", dumps.path());
  const std::string source = "extern \"C\" int abp_dump_test_symbol() { return 7; }\n";
  compileHostLibrary("host_dump_test", source, out / "lib.host.so");
  std::vector<std::string> dirs = abp::test::listDir(dumps.path());
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_EQ(dirs[0].rfind("host_dump_test-", 0), 0u) << dirs[0];
  std::string where = dumps / dirs[0];
  EXPECT_EQ(abp::test::listDir(where),
            (std::vector<std::string>{"compile.log", "kernel.cu", "kernel.host.so", "options.txt"}));
  EXPECT_EQ(abp::test::readText(where + "/kernel.cu"), source);
  EXPECT_EQ(abp::test::readText(where + "/kernel.host.so"), abp::test::readText(out / "lib.host.so"));
  std::string options = abp::test::readText(where + "/options.txt");
  EXPECT_NE(options.find("-DABP_HOST=1\n"), std::string::npos) << options;
  EXPECT_NE(options.find("output: host shared library"), std::string::npos) << options;
  EXPECT_EQ(options.find(".tmp-"), std::string::npos) << options; // no scratch paths: keyed by what compiles
  // A failed compile: the source and the log, no library.
  EXPECT_THROW(compileHostLibrary("host_dump_broken", "not C++ at all\n", out / "broken.host.so"),
               abp::rt::Error);
  dirs = abp::test::listDir(dumps.path());
  ASSERT_EQ(dirs.size(), 2u);
  std::string broken = dumps / (dirs[0].rfind("host_dump_broken-", 0) == 0 ? dirs[0] : dirs[1]);
  EXPECT_EQ(abp::test::listDir(broken), (std::vector<std::string>{"compile.log", "kernel.cu", "options.txt"}));
  EXPECT_FALSE(abp::test::readText(broken + "/compile.log").empty());
}
