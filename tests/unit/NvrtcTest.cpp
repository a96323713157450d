// NvrtcTest.cpp — NVRTC through dlopen: loading, identity, options, PTX and cubin for sm_80 and
// sm_90 without a GPU, structured compile errors, and warnings kept on success.
#include "runtime/Nvrtc.h"
#include "runtime/Error.h"
#include "runtime/Files.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

using namespace abp::rt;
using abp::test::ScopedEnv;

namespace {
const char *const kSymbols[] = {
    "abp_test_scale_f32",      "abp_test_scale_f16",      "abp_test_scale_bf16",
    "abp_test_sign_codes_f32", "abp_test_sign_codes_f16", "abp_test_sign_codes_bf16",
    "abp_test_unpack_f32",     "abp_test_unpack_f16",     "abp_test_unpack_bf16",
    "abp_test_random_f32",     "abp_test_random_f16",     "abp_test_random_bf16"};

std::string fixtureSource() {
  return abp::test::readText(abp::test::dataDir() + "/test_kernels.cu");
}

NvrtcOutput compileFixture(const std::string &arch, OutputKind kind) {
  return Nvrtc::get().compile("test_kernels", "test_kernels.cu", fixtureSource(), arch, kind,
                              deviceHeaderSource());
}
} // namespace

TEST(Nvrtc, LoadsAndReportsVersionAndArchs) {
  Nvrtc &nvrtc = Nvrtc::get();
  EXPECT_EQ(&nvrtc, &Nvrtc::get());
  EXPECT_GE(nvrtc.majorVersion(), 12);
  const std::vector<int> &archs = nvrtc.supportedArchs();
  EXPECT_NE(std::find(archs.begin(), archs.end(), 80), archs.end());
  EXPECT_NE(std::find(archs.begin(), archs.end(), 90), archs.end());
  EXPECT_TRUE(std::is_sorted(archs.begin(), archs.end()));
  EXPECT_FALSE(nvrtc.libraryPath().empty());
}

TEST(Nvrtc, SearchPathPrefersNewestSonames) {
  std::vector<std::string> path = Nvrtc::searchPath();
  ASSERT_GE(path.size(), 3u);
  EXPECT_EQ(path[0], "libnvrtc.so.13");
  EXPECT_EQ(path[1], "libnvrtc.so.12");
  EXPECT_EQ(path[2], "libnvrtc.so");
  for (size_t i = 3; i < path.size(); ++i)
    EXPECT_EQ(path[i].rfind("/usr/local/cuda/lib64/libnvrtc.so", 0), 0u) << path[i];
}

TEST(Nvrtc, IdentityIsVersionPlusBuildBanner) {
  Nvrtc &nvrtc = Nvrtc::get();
  const std::string &id = nvrtc.identity();
  std::string version = "nvrtc " + std::to_string(nvrtc.majorVersion()) + "." +
                        std::to_string(nvrtc.minorVersion()) + "\n";
  EXPECT_EQ(id.rfind(version, 0), 0u) << id;
  EXPECT_NE(id.find("// "), std::string::npos) << id;
  EXPECT_NE(id.find("Cuda compilation tools"), std::string::npos) << id;
  EXPECT_EQ(&id, &nvrtc.identity()); // computed once
}

TEST(Nvrtc, OptionsAreCanonical) {
  ScopedEnv off("ABP_NVRTC_LINEINFO", std::nullopt);
  Nvrtc &nvrtc = Nvrtc::get();
  EXPECT_EQ(
      nvrtc.options(80, OutputKind::Cubin),
      (std::vector<std::string>{"--std=c++17", "-arch=sm_80", "-default-device", "--fmad=false"}));
  EXPECT_EQ(nvrtc.options(90, OutputKind::Ptx)[1], "-arch=compute_90");
  ScopedEnv on("ABP_NVRTC_LINEINFO", std::string("1"));
  EXPECT_EQ(nvrtc.options(80, OutputKind::Cubin).back(), "-lineinfo");
  for (const std::string &o : nvrtc.options(80, OutputKind::Cubin))
    EXPECT_EQ(o.find("fast_math"), std::string::npos);
}

TEST(Nvrtc, FixtureCompilesToPtxForSm80AndSm90) {
  for (const char *arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = compileFixture(arch, OutputKind::Ptx);
    std::string target = std::string(".target ") + arch;
    EXPECT_NE(out.binary.find(target), std::string::npos) << arch;
    for (const char *symbol : kSymbols)
      EXPECT_NE(out.binary.find(std::string(".entry ") + symbol), std::string::npos)
          << arch << " " << symbol;
    EXPECT_NE(out.binary.back(), '\0');
    EXPECT_EQ(out.options[1], std::string("-arch=compute_") + (arch + 3));
  }
}

TEST(Nvrtc, FixtureCompilesToCubinForSm80AndSm90) {
  for (const char *arch : {"sm_80", "sm_90"}) {
    NvrtcOutput out = compileFixture(arch, OutputKind::Cubin);
    ASSERT_GT(out.binary.size(), 4u);
    EXPECT_EQ(out.binary.substr(0, 4), "\x7f"
                                       "ELF")
        << arch;
    for (const char *symbol : kSymbols)
      EXPECT_NE(out.binary.find(symbol), std::string::npos) << arch << " " << symbol;
  }
}

TEST(Nvrtc, DeviceHeaderAloneCompilesWithoutCudaHeaders) {
  // Every template of the header, instantiated for every storage type.
  const std::string source = R"(#include "abp_device.h"
template <typename T> ABP_FN void all(T *p, abp::u8 *codes, float *out) {
  float e[8];
  abp::loadChunk<8>(p, 0, 8, abp::aligned16(p), e);
  abp::storeChunk<8>(p, 0, 8, false, e);
  abp::u32 c[8] = {};
  abp::storePacked<2>(codes, 0, 2, abp::packCodes<2, 8>(c));
  abp::unpackCodes<2, 8>(abp::loadPacked<2>(codes, 0, 2), c);
  abp::Philox4 ctr = {{0, 0, 0, 0}};
  out[0] = abp::uniformFromBits(abp::philox4x32_10(ctr, 1, 2).v[0]) + abp::erf(e[0]) +
           abp::exp(e[1]) + abp::expm1(e[2]) + abp::log(e[3]) + abp::log1p(e[4]) +
           abp::tanh(e[5]) + abp::sqrt(e[6]) + abp::rsqrt(e[7]) + abp::abs(e[0]) +
           abp::pow(e[1], 2.0f) + abp::fmax(e[2], e[3]) + abp::fmin(e[4], e[5]) +
           abp::maximum(e[6], e[7]) + abp::minimum(e[0], e[1]) + (abp::isnan(e[2]) ? 1.f : 0.f) +
           (float)abp::globalThread() + (float)abp::gridThreads();
}
ABP_KERNEL void k32(float *p, abp::u8 *c, float *o) { all(p, c, o); }
ABP_KERNEL void k16(abp::f16 *p, abp::u8 *c, float *o) { all(p, c, o); }
ABP_KERNEL void kb16(abp::bf16 *p, abp::u8 *c, float *o) { all(p, c, o); }
)";
  for (const char *arch : {"sm_80", "sm_90"})
    for (OutputKind kind : {OutputKind::Ptx, OutputKind::Cubin}) {
      NvrtcOutput out =
          Nvrtc::get().compile("header", "header.cu", source, arch, kind, deviceHeaderSource());
      EXPECT_FALSE(out.binary.empty()) << arch;
    }
}

TEST(Nvrtc, CompileErrorsAreStructured) {
  const std::string source = "#include \"abp_device.h\"\n"
                             "ABP_KERNEL void k(float *p) {\n"
                             "  p[0] = undefined_thing();\n"
                             "}\n";
  try {
    Nvrtc::get().compile("broken", "broken.cu", source, "sm_80", OutputKind::Cubin,
                         deviceHeaderSource());
    FAIL() << "compiled a broken source";
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::Compile);
    ASSERT_TRUE(e.hasFailure());
    const CompileFailure &f = e.failure();
    EXPECT_EQ(f.stage, "nvrtc");
    EXPECT_EQ(f.kernel, "broken");
    EXPECT_EQ(f.arch, "sm_80");
    EXPECT_EQ(f.result, "NVRTC_ERROR_COMPILATION");
    EXPECT_EQ(f.options, Nvrtc::get().options(80, OutputKind::Cubin));
    EXPECT_EQ(f.source, source);
    EXPECT_NE(f.log.find("broken.cu(3)"), std::string::npos) << f.log;
    EXPECT_NE(f.log.find("undefined_thing"), std::string::npos) << f.log;
    EXPECT_NE(e.detail().find(">    3 |   p[0] = undefined_thing();"), std::string::npos)
        << e.detail();
    EXPECT_NE(std::string(e.what()).find("failed to compile broken.cu"), std::string::npos);
  }
}

TEST(Nvrtc, WarningsOfASuccessfulCompileStayInTheLog) {
  const std::string source = "#include \"abp_device.h\"\n"
                             "ABP_KERNEL void k(float *p) { int unused_variable; p[0] = 1.0f; }\n";
  NvrtcOutput out = Nvrtc::get().compile("warn", "warn.cu", source, "sm_80", OutputKind::Ptx,
                                         deviceHeaderSource());
  EXPECT_FALSE(out.binary.empty());
  EXPECT_NE(out.log.find("unused_variable"), std::string::npos) << out.log;
}

TEST(Nvrtc, BadArchsAreInvalidArguments) {
  for (const char *arch : {"sm_20", "gfx90a", "sm_", "sm_8x", "compute_80"}) {
    try {
      compileFixture(arch, OutputKind::Cubin);
      FAIL() << arch;
    } catch (const Error &e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << arch << ": " << e.what();
    }
  }
  EXPECT_EQ(parseSmArch("sm_90"), 90);
  EXPECT_EQ(parseSmArch("sm_120"), 120);
  EXPECT_THROW(compileFixture("sm_80", OutputKind::HostLibrary), Error);
}

TEST(Nvrtc, OpenFailuresSayNoNvrtc) {
  try {
    Nvrtc::open("/nonexistent/libnvrtc.so.13");
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::NoNvrtc);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/libnvrtc.so.13"), std::string::npos);
  }
  try {
    Nvrtc::open("libm.so.6"); // loads, but is no NVRTC
    FAIL();
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::NoNvrtc);
    EXPECT_NE(std::string(e.what()).find("missing nvrtc"), std::string::npos) << e.what();
  }
  std::unique_ptr<Nvrtc> direct = Nvrtc::open(Nvrtc::get().libraryPath());
  EXPECT_EQ(direct->majorVersion(), Nvrtc::get().majorVersion());
}

TEST(Nvrtc, NoThrowEntryPointForToolsWithoutExceptions) {
  NvrtcOutput out;
  std::string message;
  EXPECT_TRUE(compileWithNvrtcNoThrow("test_kernels", "test_kernels.cu", fixtureSource(), "sm_90",
                                      OutputKind::Ptx, out, message));
  EXPECT_NE(out.binary.find(".target sm_90"), std::string::npos);
  EXPECT_FALSE(compileWithNvrtcNoThrow("bad", "bad.cu", "this is not C++", "sm_90", OutputKind::Ptx,
                                       out, message));
  EXPECT_NE(message.find("bad.cu(1)"), std::string::npos) << message;
  EXPECT_NE(message.find(">    1 | this is not C++"), std::string::npos) << message;
}
