// LibraryTest.cpp — kernel directories, lookups, the operators JSON, exact CPU-path launches of
// the fixture kernels for every dtype, offline NVRTC compiles, and (with a GPU) device launches.
#include "runtime/Library.h"
#include "runtime/Driver.h"
#include "runtime/Error.h"
#include "runtime/Launch.h"
#include "runtime/Nvrtc.h"

#include "abp_device.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <cstring>

using namespace abp::rt;
using abp::test::TempDir;

namespace {
std::unique_ptr<Library> fixture() { return Library::open(abp::test::dataDir()); }

ErrorCode errorOf(const std::function<void()> &fn, std::string *message = nullptr) {
  try {
    fn();
  } catch (const Error &e) {
    if (message)
      *message = e.what();
    return e.code();
  }
  ADD_FAILURE() << "expected an error";
  return ErrorCode::Internal;
}

/// Values exactly representable in every storage type, of both signs, around the code borders.
float sample(int64_t i) { return float((i * 37) % 41 - 20) * 0.125f; }

template <typename T> std::vector<T> stored(int64_t n, int64_t pad = 0) {
  std::vector<T> v(static_cast<size_t>(n + pad));
  for (int64_t i = 0; i < n; ++i)
    abp::fromFloat(sample(i), v[static_cast<size_t>(i + pad)]);
  return v;
}

template <typename T> const char *dtypeOf();
template <> const char *dtypeOf<float>() { return "f32"; }
template <> const char *dtypeOf<abp::f16>() { return "f16"; }
template <> const char *dtypeOf<abp::bf16>() { return "bf16"; }

/// Runs every fixture kernel of dtype T on the CPU path and checks the results exactly;
/// `offset` shifts the dense pointers off 16-byte alignment (the scalar path).
template <typename T> void checkHostKernels(Library &lib, int64_t n, int64_t offset) {
  SCOPED_TRACE(std::string(dtypeOf<T>()) + " n=" + std::to_string(n) +
               " offset=" + std::to_string(offset));
  // scale: y = x * 0.5
  std::vector<T> x = stored<T>(n, offset), y(static_cast<size_t>(n + offset));
  Kernel &scale = lib.kernel("test_scale", dtypeOf<T>());
  ArgPack scaleArgs(scale.record());
  scaleArgs.pointer(x.data() + offset).scalar(0.5f).pointer(y.data() + offset).count(n);
  scale.launch(-1, scaleArgs.data(), scaleArgs.size(), n, nullptr);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(abp::toFloat(y[static_cast<size_t>(i + offset)]), sample(i) * 0.5f) << i;

  // sign_codes: y = x, 2-bit codes; bytes past the stream stay untouched.
  size_t codeBytes = static_cast<size_t>((2 * n + 7) / 8);
  std::vector<abp::u8> codes(codeBytes + 16, 0xAA);
  std::vector<T> copy(static_cast<size_t>(n + offset));
  Kernel &sign = lib.kernel("test_sign_codes", dtypeOf<T>());
  ArgPack signArgs(sign.record());
  signArgs.pointer(x.data() + offset).pointer(copy.data() + offset).pointer(codes.data()).count(n);
  sign.launch(-1, signArgs.data(), signArgs.size(), n, nullptr);
  std::vector<abp::u8> want(codeBytes, 0);
  for (int64_t i = 0; i < n; ++i) {
    float v = sample(i);
    unsigned code = v < -1 ? 0 : v < 0 ? 1 : v < 1 ? 2 : 3;
    want[static_cast<size_t>(i / 4)] |= abp::u8(code << (2 * (i % 4)));
    ASSERT_EQ(abp::toFloat(copy[static_cast<size_t>(i + offset)]), v) << i;
  }
  for (size_t b = 0; b < codeBytes; ++b)
    ASSERT_EQ(codes[b], want[b]) << "code byte " << b;
  for (size_t b = codeBytes; b < codes.size(); ++b)
    ASSERT_EQ(codes[b], 0xAA) << "wrote past the code stream at byte " << b;

  // unpack: y = code
  std::vector<T> unpacked(static_cast<size_t>(n + offset));
  Kernel &unpack = lib.kernel("test_unpack", dtypeOf<T>());
  ArgPack unpackArgs(unpack.record());
  unpackArgs.pointer(codes.data()).pointer(unpacked.data() + offset).count(n);
  unpack.launch(-1, unpackArgs.data(), unpackArgs.size(), n, nullptr);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(abp::toFloat(unpacked[static_cast<size_t>(i + offset)]),
              float((want[static_cast<size_t>(i / 4)] >> (2 * (i % 4))) & 3u))
        << i;

  // random: Philox at counter i, rounded to T
  std::vector<T> random(static_cast<size_t>(n + offset));
  Kernel &rng = lib.kernel("test_random", dtypeOf<T>());
  ArgPack rngArgs(rng.record());
  rngArgs.scalar(1.5f).pointer(random.data() + offset).count(n);
  rng.launch(-1, rngArgs.data(), rngArgs.size(), n, nullptr);
  for (int64_t i = 0; i < n; ++i) {
    abp::Philox4 ctr = {{abp::u32(i), abp::u32(uint64_t(i) >> 32), 0, 0}};
    T expected;
    abp::fromFloat(abp::uniformFromBits(abp::philox4x32_10(ctr, abp::floatBits(1.5f), 0xabcd).v[0]),
                   expected);
    ASSERT_EQ(std::memcmp(&random[static_cast<size_t>(i + offset)], &expected, sizeof(T)), 0) << i;
  }
}
} // namespace

TEST(Library, OpensTheFixtureDirectory) {
  auto lib = fixture();
  EXPECT_EQ(lib->directory(), abp::test::dataDir());
  ASSERT_EQ(lib->manifests().size(), 1u);
  EXPECT_EQ(lib->manifests()[0]->stem(), "test_kernels");
  Kernel &k = lib->kernel("test_sign_codes", "bf16");
  EXPECT_EQ(k.symbol(), "abp_test_sign_codes_bf16");
  EXPECT_EQ(k.dtype(), Dtype::BF16);
  EXPECT_EQ(k.name(), "test_sign_codes");
  EXPECT_EQ(k.numArgs(), 4);
  EXPECT_EQ(&k.manifest(), lib->manifests()[0]);
  EXPECT_EQ(&k.record(), k.manifest().findKernel("test_sign_codes"));
  EXPECT_EQ(&lib->kernel("test_sign_codes", "bf16"), &k); // stable handles
}

TEST(Library, LookupErrors) {
  auto lib = fixture();
  std::string message;
  EXPECT_EQ(errorOf([&] { lib->kernel("test_scale", "f128"); }, &message),
            ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("dtype: 'f128'"), std::string::npos) << message;
  EXPECT_EQ(errorOf([&] { lib->kernel("nope", "f32"); }, &message), ErrorCode::NotFound);
  EXPECT_NE(message.find("no kernel named 'nope'"), std::string::npos) << message;
  EXPECT_EQ(errorOf([] { Library::open("/nonexistent/kernels"); }, &message), ErrorCode::NotFound);
  EXPECT_NE(message.find("/nonexistent/kernels does not exist"), std::string::npos);
}

TEST(Library, MissingDtypeIsNotFound) {
  TempDir dir;
  Json m = parseJson(abp::test::readText(abp::test::dataDir() + "/test_kernels.json"));
  for (Json &k : m.at("kernels")) // drop every bf16 symbol
    k.at("symbols").erase("bf16");
  abp::test::writeText(dir / "k.json", m.dump());
  auto lib = Library::open(dir.path());
  std::string message;
  EXPECT_EQ(errorOf([&] { lib->kernel("test_scale", "bf16"); }, &message), ErrorCode::NotFound);
  EXPECT_NE(message.find("has no bf16 specialisation"), std::string::npos) << message;
}

TEST(Library, KernelDefinedByTwoManifestsIsRejected) {
  TempDir dir;
  std::string text = abp::test::readText(abp::test::dataDir() + "/test_kernels.json");
  abp::test::writeText(dir / "a.json", text);
  abp::test::writeText(dir / "b.json", text);
  std::string message;
  EXPECT_EQ(errorOf([&] { Library::open(dir.path()); }, &message), ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("defined by both " + (dir / "a.json") + " and " + (dir / "b.json")),
            std::string::npos)
      << message;
}

TEST(Library, BadManifestIsNamed) {
  TempDir dir;
  abp::test::writeText(dir / "broken.json", "{\"format\": 7}");
  std::string message;
  EXPECT_EQ(errorOf([&] { Library::open(dir.path()); }, &message), ErrorCode::InvalidArgument);
  EXPECT_NE(message.find(dir / "broken.json"), std::string::npos) << message;
}

TEST(Library, EmptyDirectoryIsAnEmptyLibrary) {
  TempDir dir;
  auto lib = Library::open(dir.path());
  EXPECT_TRUE(lib->manifests().empty());
  EXPECT_EQ(lib->operatorsJson(), "[]");
}

TEST(Library, OperatorsJsonAddsTheKernelsEachOperatorUses) {
  auto lib = fixture();
  Json ops = parseJson(lib->operatorsJson());
  ASSERT_EQ(ops.size(), 3u);
  const Json &scale = ops[0];
  EXPECT_EQ(scale.at("name"), "test_scale");
  // Appended after the written members: the kernels, then where the manifest was read from.
  std::vector<std::string> keys;
  for (const auto &item : scale.items())
    keys.push_back(item.key());
  ASSERT_GE(keys.size(), 2u);
  EXPECT_EQ(keys[keys.size() - 2], "kernels");
  EXPECT_EQ(keys.back(), "manifest");
  const Json &where = scale.at("manifest");
  EXPECT_EQ(where.at("path"), lib->manifests()[0]->path);
  EXPECT_EQ(where.at("source_path"), lib->manifests()[0]->sourcePath());
  EXPECT_EQ(lib->manifestJson("test_scale"), lib->manifests()[0]->json.dump());
  EXPECT_THROW(lib->manifestJson("no_such_operator"), Error);
  // forward and backward use the same kernel: listed once.
  ASSERT_EQ(scale.at("kernels").size(), 1u);
  EXPECT_EQ(scale.at("kernels")[0].at("name"), "test_scale");
  const Json &sign = ops[1];
  ASSERT_EQ(sign.at("kernels").size(), 2u);
  EXPECT_EQ(sign.at("kernels")[0].at("name"), "test_sign_codes");
  EXPECT_EQ(sign.at("kernels")[1].at("name"), "test_unpack");
  EXPECT_EQ(sign.at("tables").dump(), R"([{"borders":[-1,0,1],"levels":[0,1,2,3]}])");
  const Json &random = ops[2];
  EXPECT_TRUE(random.at("backward").is_null());
  EXPECT_EQ(random.at("kernels").size(), 1u);
  // The kernel records are the manifest's, member for member.
  Manifest m = loadManifest(abp::test::dataDir() + "/test_kernels.json");
  EXPECT_EQ(sign.at("kernels")[1], m.findKernel("test_unpack")->json);
}

TEST(Library, HostLaunchesAreExactForEveryDtype) {
  auto lib = fixture();
  for (int64_t n : {1, 8, 1003}) {
    for (int64_t offset : {0, 1}) {
      checkHostKernels<float>(*lib, n, offset);
      checkHostKernels<abp::f16>(*lib, n, offset);
      checkHostKernels<abp::bf16>(*lib, n, offset);
    }
  }
}

TEST(Library, LargeHostLaunchesUseTheThreadPool) {
  auto lib = fixture();
  checkHostKernels<float>(*lib, kHostInlineElements * 3 + 5, 0);
  checkHostKernels<abp::bf16>(*lib, kHostInlineElements * 3 + 5, 1);
}

TEST(Library, ZeroElementsLaunchNothing) {
  auto lib = fixture();
  Kernel &scale = lib->kernel("test_scale", "f32");
  float x = 3, y = -1;
  ArgPack args(scale.record());
  args.pointer(&x).scalar(2.0f).pointer(&y).count(0);
  scale.launch(-1, args.data(), args.size(), 0, nullptr);
  EXPECT_EQ(y, -1.0f);
  // n == 0 on a GPU device needs no driver at all.
  EXPECT_NO_THROW(scale.launch(0, args.data(), args.size(), 0, nullptr));
}

TEST(Library, LaunchArgumentsAreChecked) {
  auto lib = fixture();
  Kernel &scale = lib->kernel("test_scale", "f32");
  float x = 3, y = 0, alpha = 2;
  const float *px = &x;
  float *py = &y;
  int64_t n = 1;
  void *args[] = {&px, &alpha, &py, &n};
  EXPECT_EQ(errorOf([&] { scale.launch(-1, args, 3, 1, nullptr); }), ErrorCode::InvalidArgument);
  EXPECT_EQ(errorOf([&] { scale.launch(-1, args, 4, 2, nullptr); }), ErrorCode::InvalidArgument);
  scale.launch(-1, args, 4, 1, nullptr);
  EXPECT_EQ(y, 6.0f);
}

TEST(Library, PrepareResolvesTheHostEntry) {
  auto lib = fixture();
  EXPECT_NO_THROW(lib->kernel("test_random", "f16").prepare(-1));
  TempDir dir; // a manifest whose host library is missing
  abp::test::writeText(dir / "test_kernels.json",
                       abp::test::readText(abp::test::dataDir() + "/test_kernels.json"));
  auto broken = Library::open(dir.path());
  EXPECT_EQ(errorOf([&] { broken->kernel("test_random", "f16").prepare(-1); }), ErrorCode::Io);
}

TEST(Library, GpuPathWithoutADriverSaysNoDriver) {
  if (Driver::available())
    GTEST_SKIP() << "a CUDA driver is present";
  auto lib = fixture();
  Kernel &scale = lib->kernel("test_scale", "f32");
  float x = 1, y = 0;
  ArgPack args(scale.record());
  args.pointer(&x).scalar(1.0f).pointer(&y).count(1);
  std::string message;
  EXPECT_EQ(errorOf([&] { scale.launch(0, args.data(), args.size(), 1, nullptr); }, &message),
            ErrorCode::NoDriver);
  EXPECT_EQ(message.rfind("no CUDA driver", 0), 0u) << message;
  EXPECT_EQ(errorOf([&] { scale.prepare(0); }), ErrorCode::NoDriver);
}

TEST(Library, CompileForArchGoesThroughTheCache) {
  auto lib = fixture();
  CacheStats before = Cache::global().stats();
  std::shared_ptr<const Artifact> ptx =
      lib->compileForArch("test_unpack", "sm_80", OutputKind::Ptx);
  EXPECT_NE(ptx->binary.find(".target sm_80"), std::string::npos);
  std::shared_ptr<const Artifact> again =
      lib->compileForArch("test_scale", "sm_80", OutputKind::Ptx); // same source: same entry
  EXPECT_EQ(again.get(), ptx.get());
  std::shared_ptr<const Artifact> cubin =
      lib->compileForArch("test_scale", "sm_90", OutputKind::Cubin);
  EXPECT_EQ(cubin->binary.substr(0, 4), "\x7f"
                                        "ELF");
  CacheStats after = Cache::global().stats();
  EXPECT_EQ(after.memoryHits - before.memoryHits, 1u);
  EXPECT_EQ((after.misses + after.diskHits) - (before.misses + before.diskHits), 2u);
  EXPECT_EQ(errorOf([&] { lib->compileForArch("nope", "sm_80", OutputKind::Ptx); }),
            ErrorCode::NotFound);
  EXPECT_EQ(errorOf([&] { lib->compileForArch("test_scale", "sm_80", OutputKind::HostLibrary); }),
            ErrorCode::InvalidArgument);
}

TEST(Library, TargetForPrefersACubinElsePtxForTheNewestOlderArch) {
  const std::vector<int> archs = {75, 80, 86, 90};
  EXPECT_EQ(targetFor(80, archs), std::make_pair(std::string("sm_80"), OutputKind::Cubin));
  EXPECT_EQ(targetFor(89, archs), std::make_pair(std::string("sm_86"), OutputKind::Ptx));
  EXPECT_EQ(targetFor(120, archs), std::make_pair(std::string("sm_90"), OutputKind::Ptx));
  EXPECT_THROW(targetFor(70, archs), Error);
}

TEST(LibraryGpu, DeviceLaunchesMatchTheCpuPath) {
  if (!Driver::available())
    GTEST_SKIP() << "no CUDA driver with a device on this machine";
  auto lib = fixture();
  Driver &driver = Driver::get();
  const int64_t n = 100003;
  for (const char *dtype : {"f32", "f16", "bf16"}) {
    size_t elem = dtype == std::string("f32") ? 4 : 2;
    std::vector<uint8_t> x(static_cast<size_t>(n) * elem);
    for (int64_t i = 0; i < n; ++i) {
      float v = sample(i);
      if (elem == 4)
        std::memcpy(&x[static_cast<size_t>(i) * 4], &v, 4);
      else if (dtype == std::string("f16"))
        abp::fromFloat(v, reinterpret_cast<abp::f16 *>(x.data())[i]);
      else
        abp::fromFloat(v, reinterpret_cast<abp::bf16 *>(x.data())[i]);
    }
    size_t codeBytes = static_cast<size_t>((2 * n + 7) / 8);
    std::vector<uint8_t> hostY(x.size()), hostCodes(codeBytes), gpuY(x.size()), gpuCodes(codeBytes);
    Kernel &sign = lib->kernel("test_sign_codes", dtype);
    ArgPack hostArgs(sign.record());
    hostArgs.pointer(x.data()).pointer(hostY.data()).pointer(hostCodes.data()).count(n);
    sign.launch(-1, hostArgs.data(), hostArgs.size(), n, nullptr);

    driver.contextFor(0);
    CUdeviceptr dx = driver.allocate(x.size()), dy = driver.allocate(x.size()),
                dc = driver.allocate(codeBytes);
    driver.copyToDevice(dx, x.data(), x.size());
    ArgPack gpuArgs(sign.record());
    gpuArgs.pointer(reinterpret_cast<void *>(dx))
        .pointer(reinterpret_cast<void *>(dy))
        .pointer(reinterpret_cast<void *>(dc))
        .count(n);
    sign.launch(0, gpuArgs.data(), gpuArgs.size(), n, nullptr);
    driver.synchronize();
    driver.copyToHost(gpuY.data(), dy, gpuY.size());
    driver.copyToHost(gpuCodes.data(), dc, codeBytes);
    driver.release(dx);
    driver.release(dy);
    driver.release(dc);
    EXPECT_EQ(gpuY, hostY) << dtype;
    EXPECT_EQ(gpuCodes, hostCodes) << dtype;
  }
}
