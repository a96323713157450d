// LaunchTest.cpp — the grid rule, launch argument checks and the typed argument packer.
#include "runtime/Launch.h"
#include "runtime/Error.h"

#include "TestSupport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

using namespace abp::rt;

namespace {
const KernelRecord &scaleRecord() {
  static Manifest m = loadManifest(abp::test::dataDir() + "/test_kernels.json");
  return *m.findKernel("test_scale"); // in, scalar, out, count
}

std::string launchError(void *const *args, int nargs, int64_t n) {
  try {
    checkLaunchArgs(scaleRecord(), args, nargs, n);
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}
} // namespace

TEST(Launch, GridRule) {
  struct Case {
    int64_t n;
    int chunk, block;
    int64_t maxBlocks, grid;
  };
  const Case cases[] = {{0, 8, 256, 0, 0},
                        {1, 8, 256, 0, 1},
                        {2048, 8, 256, 0, 1},
                        {2049, 8, 256, 0, 2},
                        {8 * 256 * 10, 8, 256, 0, 10},
                        {int64_t(1) << 40, 8, 256, 132 * 32, 132 * 32},
                        {int64_t(1) << 30, 8, 256, 0, 524288},
                        {100, 1, 64, 1, 1},
                        {-5, 8, 256, 0, 0},
                        // (n + chunk - 1) overflowed to a negative grid here: no blocks.
                        {INT64_MAX, 8, 256, 132 * 32, 132 * 32},
                        {INT64_MAX, 1, 1, 0, INT64_MAX}};
  for (const Case &c : cases) {
    LaunchConfig config = gridFor(c.n, c.chunk, c.block, c.maxBlocks);
    EXPECT_EQ(config.grid, c.grid) << "n=" << c.n;
    EXPECT_EQ(config.block, c.block);
  }
}

TEST(Launch, TotalGridDependsOnTheCountAlone) {
  // At least one block (an empty tensor still writes the identity), at most kTotalMaxBlocks,
  // and no device cap: the combination order, and so the result, is the same everywhere.
  EXPECT_EQ(gridForTotal(0, 8, 256).grid, 1);
  EXPECT_EQ(gridForTotal(1, 8, 256).grid, 1);
  EXPECT_EQ(gridForTotal(8 * 256, 8, 256).grid, 1);
  EXPECT_EQ(gridForTotal(8 * 256 + 1, 8, 256).grid, 2);
  EXPECT_EQ(gridForTotal(int64_t{1} << 40, 8, 256).grid, kTotalMaxBlocks);
  EXPECT_EQ(gridForTotal(-1, 8, 256).grid, 0);
  EXPECT_EQ(gridForTotal(INT64_MAX, 8, 256).grid, kTotalMaxBlocks);
  EXPECT_EQ(gridForRows(INT64_MAX, 0, 256, 1024, 0).grid, INT64_MAX / 32 + 1);
  KernelRecord record;
  record.kind = KernelKind::Total;
  record.chunk = 8;
  record.block = 256;
  EXPECT_EQ(launchConfigFor(record, nullptr, 0, 1 << 30, /*maxBlocks=*/4).grid, kTotalMaxBlocks);
}

TEST(Launch, ArgumentChecksNameTheArgument) {
  float xs[10] = {}, ys[10] = {};
  const void *x = xs;
  float alpha = 1;
  int64_t n = 10, wrong = 11;
  void *y = ys;
  void *args[] = {&x, &alpha, &y, &n};
  EXPECT_NO_THROW(checkLaunchArgs(scaleRecord(), args, 4, 10));
  // A NULL data pointer is refused where there are elements to touch, allowed where there are none.
  const void *nowhere = nullptr;
  void *noData[] = {&nowhere, &alpha, &y, &n};
  EXPECT_NE(launchError(noData, 4, 10).find("args[0]: a NULL data pointer for 10 elements"),
            std::string::npos);
  int64_t zero = 0;
  void *empty[] = {&nowhere, &alpha, &y, &zero};
  EXPECT_NO_THROW(checkLaunchArgs(scaleRecord(), empty, 4, 0));
  EXPECT_NE(launchError(args, 3, 10).find("nargs: kernel test_scale takes 4 arguments"),
            std::string::npos);
  EXPECT_NE(launchError(nullptr, 4, 10).find("args: NULL"), std::string::npos);
  void *withNull[] = {&x, nullptr, &y, &n};
  EXPECT_NE(launchError(withNull, 4, 10).find("args[1]: NULL (kernel test_scale, role scalar)"),
            std::string::npos);
  void *mismatch[] = {&x, &alpha, &y, &wrong};
  EXPECT_NE(launchError(mismatch, 4, 10).find("args[3]: the count argument is 11 but n is 10"),
            std::string::npos);
  EXPECT_NE(launchError(args, 4, -1).find("n: must be >= 0"), std::string::npos);
}

TEST(Launch, ArgPackChecksRolesInOrder) {
  float in[4] = {}, out[4] = {};
  ArgPack pack(scaleRecord());
  pack.pointer(in).scalar(2.5f).pointer(out).count(4);
  void **args = pack.data();
  EXPECT_EQ(pack.size(), 4);
  EXPECT_EQ(*static_cast<const float *const *>(args[0]), in);
  EXPECT_EQ(*static_cast<float *>(args[1]), 2.5f);
  EXPECT_EQ(*static_cast<float *const *>(args[2]), out);
  EXPECT_EQ(*static_cast<int64_t *>(args[3]), 4);
  EXPECT_NO_THROW(checkLaunchArgs(scaleRecord(), args, pack.size(), 4));

  ArgPack wrongRole(scaleRecord());
  wrongRole.pointer(in);
  try {
    wrongRole.pointer(out);
    FAIL();
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("argument 1 of kernel test_scale has role scalar, but a "
                                         "pointer was given"),
              std::string::npos)
        << e.what();
  }
  ArgPack incomplete(scaleRecord());
  incomplete.pointer(in).scalar(1.0f);
  EXPECT_THROW(incomplete.data(), Error);
  ArgPack tooMany(scaleRecord());
  tooMany.pointer(in).scalar(1.0f).pointer(out).count(4);
  EXPECT_THROW(tooMany.count(4), Error);
  ArgPack countEarly(scaleRecord());
  EXPECT_THROW(countEarly.count(4), Error);
}

namespace {
std::atomic<int> calls{0};
std::atomic<int64_t> blocksRun{0};
std::thread::id lastThread;
void countingEntry(void **, int64_t, int64_t, int64_t b0, int64_t b1) {
  ++calls;
  blocksRun += b1 - b0;
  lastThread = std::this_thread::get_id();
}
} // namespace

TEST(Launch, HostLaunchRunsSmallLaunchesInlineAndSplitsLargeOnes) {
  calls = 0;
  blocksRun = 0;
  launchOnHost(countingEntry, gridFor(1000, 8, 64, 0), nullptr, 1000);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(blocksRun.load(), 2);
  EXPECT_EQ(lastThread, std::this_thread::get_id());

  calls = 0;
  blocksRun = 0;
  LaunchConfig big = gridFor(kHostInlineElements * 4, 8, 64, 0);
  launchOnHost(countingEntry, big, nullptr, kHostInlineElements * 4);
  EXPECT_EQ(blocksRun.load(), big.grid);
  EXPECT_EQ(calls.load(),
            static_cast<int>(std::min<int64_t>(big.grid, ThreadPool::global().size())));

  calls = 0;
  launchOnHost(countingEntry, gridFor(0, 8, 64, 0), nullptr, 0);
  EXPECT_EQ(calls.load(), 0);
}

TEST(Launch, RowGridRule) {
  // Rows up to warp_max_cols columns: one warp each, block / 32 rows per block; longer: a block.
  EXPECT_EQ(gridForRows(0, 768, 256, 1024, 0).grid, 0);
  EXPECT_EQ(gridForRows(1, 768, 256, 1024, 0).grid, 1);
  EXPECT_EQ(gridForRows(8, 768, 256, 1024, 0).grid, 1);
  EXPECT_EQ(gridForRows(9, 1024, 256, 1024, 0).grid, 2);
  EXPECT_EQ(gridForRows(9, 1025, 256, 1024, 0).grid, 9);
  // Short rows (<= warp_max_cols / 4): 8 lanes each, 32 rows per 256-thread block.
  EXPECT_EQ(gridForRows(32, 256, 256, 1024, 0).grid, 1);
  EXPECT_EQ(gridForRows(33, 256, 256, 1024, 0).grid, 2);
  EXPECT_EQ(gridForRows(33, 257, 256, 1024, 0).grid, 5);
  EXPECT_EQ(gridForRows(4096, 8192, 256, 1024, 132 * 32).grid, 4096);
  EXPECT_EQ(gridForRows(int64_t(1) << 30, 64, 256, 1024, 132 * 32).grid, 132 * 32);
  // Empty rows still run (their per-row outputs are written); negative shapes launch nothing.
  EXPECT_EQ(gridForRows(5, 0, 256, 1024, 0).grid, 1);
  EXPECT_EQ(gridForRows(-1, 8, 256, 1024, 0).grid, 0);
  EXPECT_EQ(gridForRows(5, 8, 256, 0, 0).grid, 5); // warp_max_cols 0: always a block per row
  EXPECT_EQ(gridForRows(5, 8, 256, 1024, 0).block, 256);
}

namespace {
/// A row kernel record: in dense, in rows, out dense, rows, cols.
KernelRecord rowRecord() {
  Manifest m = parseManifest(R"({"format": 2, "file": "", "source": "r.cu", "host_library": "",
    "operators": [], "kernels": [{"name": "r", "kind": "rows", "warp_max_cols": 1024,
    "symbols": {"f64": "abp_r_f64"}, "block": 256, "chunk": 8,
    "args": [{"role": "in", "layout": "dense"}, {"role": "in", "layout": "rows"},
             {"role": "out", "layout": "dense"}, {"role": "rows"}, {"role": "cols"}]}]})",
                             "/m/r.json");
  return m.kernels.at(0);
}
} // namespace

TEST(Launch, RowKernelChecksAndPacking) {
  KernelRecord record = rowRecord();
  EXPECT_EQ(record.kind, KernelKind::Rows);
  EXPECT_EQ(record.warpMaxCols, 1024);
  EXPECT_EQ(record.args[1].layout, ArgLayout::Rows);
  double x[6] = {}, r[2] = {}, y[6] = {};
  ArgPack pack(record);
  pack.pointer(x).pointer(r).pointer(y).shape(2, 3);
  void **args = pack.data();
  EXPECT_NO_THROW(checkLaunchArgs(record, args, pack.size(), 6));
  EXPECT_EQ(launchConfigFor(record, args, pack.size(), 6, 0).grid, 1);
  try {
    checkLaunchArgs(record, args, pack.size(), 7);
    ADD_FAILURE() << "accepted n != rows * cols";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("n: must be rows * cols = 6, got 7"), std::string::npos)
        << e.what();
  }
  ArgPack negative(record);
  negative.pointer(x).pointer(r).pointer(y).shape(-2, 3);
  EXPECT_THROW(checkLaunchArgs(record, negative.data(), negative.size(), -6), Error);
  ArgPack huge(record);
  huge.pointer(x).pointer(r).pointer(y).shape(int64_t(1) << 40, int64_t(1) << 40);
  EXPECT_THROW(checkLaunchArgs(record, huge.data(), huge.size(), 0), Error);
  ArgPack countInstead(record);
  countInstead.pointer(x).pointer(r).pointer(y);
  EXPECT_THROW(countInstead.count(6), Error);
}

namespace {
/// A GACT-like row kernel: x, an i64 seed, then per-row minima and 2-bit codes.
KernelRecord codedRowRecord() {
  Manifest m = parseManifest(R"({"format": 2, "file": "c.mlir", "source": "c.cu",
    "host_library": "c.host.so", "operators": [], "kernels": [{"name": "c_fwd", "kind": "rows",
    "warp_max_cols": 1024, "symbols": {"f32": "abp_c_fwd_f32"}, "block": 256, "chunk": 8,
    "args": [{"role": "in", "layout": "dense"}, {"role": "scalar", "type": "i64"},
             {"role": "out", "layout": "rows"}, {"role": "out", "layout": "packed", "bits": 2},
             {"role": "rows"}, {"role": "cols"}]}]})",
                             "/m/c.json");
  return m.kernels.at(0);
}
} // namespace

TEST(Launch, I64ScalarsAndPackedCodesInRowKernels) {
  KernelRecord record = codedRowRecord();
  EXPECT_EQ(record.args[1].scalarType, ScalarType::I64);
  EXPECT_EQ(record.args[3].layout, ArgLayout::Packed);
  float x[12] = {}, m[3] = {};
  uint8_t codes[3] = {};
  ArgPack pack(record);
  pack.pointer(x).scalarInt(int64_t(1) << 40).pointer(m).pointer(codes).shape(3, 4);
  void **args = pack.data();
  EXPECT_EQ(*static_cast<int64_t *>(args[1]), int64_t(1) << 40);
  EXPECT_NO_THROW(checkLaunchArgs(record, args, pack.size(), 12));

  ArgPack floatSeed(record);
  floatSeed.pointer(x);
  try {
    floatSeed.scalar(1.0f);
    ADD_FAILURE() << "an f32 was accepted for an i64 scalar";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("has role scalar, but an f32 scalar was given"),
              std::string::npos)
        << e.what();
  }
  // 3 columns of 2-bit codes: row 1 would start at bit 6, inside a byte.
  ArgPack ragged(record);
  ragged.pointer(x).scalarInt(7).pointer(m).pointer(codes).shape(4, 3);
  try {
    checkLaunchArgs(record, ragged.data(), ragged.size(), 12);
    ADD_FAILURE() << "accepted rows that do not start on a byte";
  } catch (const Error &e) {
    EXPECT_NE(std::string(e.what()).find("args[3]: 2-bit codes of rows of 3 columns do not start "
                                         "on a byte"),
              std::string::npos)
        << e.what();
  }
  // A single row may have any length: its codes start at byte 0.
  ArgPack oneRow(record);
  oneRow.pointer(x).scalarInt(7).pointer(m).pointer(codes).shape(1, 11);
  EXPECT_NO_THROW(checkLaunchArgs(record, oneRow.data(), oneRow.size(), 11));
}
