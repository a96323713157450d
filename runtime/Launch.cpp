// Launch.cpp — grid sizing, launch argument checks and packing (docs/manifest.md).
#include "runtime/Launch.h"

#include "runtime/Env.h"
#include "runtime/Error.h"

#include <cstdint>
#include <cstring>
#include <string>

namespace abp::rt {

/// ⌈a / b⌉ for a >= 0, b > 0, without the overflow of (a + b - 1) / b near INT64_MAX (which
/// made a grid of no blocks: a launch that returned OK and did nothing).
static int64_t ceilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0); }

LaunchConfig gridFor(int64_t n, int chunk, int block, int64_t maxBlocks) {
  LaunchConfig config;
  config.block = block;
  if (n <= 0 || chunk <= 0 || block <= 0)
    return config;
  int64_t blocks = ceilDiv(ceilDiv(n, chunk), block);
  if (maxBlocks > 0 && blocks > maxBlocks)
    blocks = maxBlocks;
  config.grid = blocks;
  return config;
}

LaunchConfig gridForRows(int64_t rows, int64_t cols, int block, int64_t warpMaxCols,
                         int64_t maxBlocks) {
  LaunchConfig config;
  config.block = block;
  if (rows <= 0 || cols < 0 || block < 32)
    return config;
  // Rows of at most warpMaxCols / 4 columns take 8 lanes each, up to warpMaxCols a warp, longer
  // ones the block (the generated drivers choose the same way).
  int64_t rowsPerBlock = cols <= warpMaxCols / 4 ? block / 8 : cols <= warpMaxCols ? block / 32 : 1;
  int64_t blocks = ceilDiv(rows, rowsPerBlock);
  if (maxBlocks > 0 && blocks > maxBlocks)
    blocks = maxBlocks;
  config.grid = blocks;
  return config;
}

LaunchConfig gridForTotal(int64_t n, int chunk, int block) {
  LaunchConfig config;
  config.block = block;
  if (n < 0 || chunk <= 0 || block <= 0)
    return config;
  // A function of n alone (docs/manifest.md): the result's bits do not depend on the device.
  int64_t blocks = ceilDiv(ceilDiv(n, chunk), block);
  config.grid = blocks < 1 ? 1 : blocks > kTotalMaxBlocks ? kTotalMaxBlocks : blocks;
  return config;
}

static int64_t argInt64(void *const *args, int i) {
  int64_t value;
  std::memcpy(&value, args[i], sizeof value);
  return value;
}

LaunchConfig launchConfigFor(const KernelRecord &record, void *const *args, int nargs, int64_t n,
                             int64_t maxBlocks) {
  if (record.kind == KernelKind::Rows)
    return gridForRows(argInt64(args, nargs - 2), argInt64(args, nargs - 1), record.block,
                       record.warpMaxCols, maxBlocks);
  if (record.kind == KernelKind::Total)
    return gridForTotal(n, record.chunk, record.block);
  return gridFor(n, record.chunk, record.block, maxBlocks);
}

void checkLaunchArgs(const KernelRecord &record, void *const *args, int nargs, int64_t n) {
  const int expected = static_cast<int>(record.args.size());
  if (nargs != expected)
    throw Error(ErrorCode::InvalidArgument,
                "nargs: kernel " + record.name + " takes " + std::to_string(expected) +
                    " arguments (docs/manifest.md order), got " + std::to_string(nargs));
  if (!args)
    throw Error(ErrorCode::InvalidArgument, "args: NULL argument array for kernel " + record.name);
  if (n < 0 || n > kMaxLaunchCount)
    throw Error(ErrorCode::InvalidArgument,
                "n: must be >= 0 and at most 2^62 (a kernel's indices must not overflow int64), got " +
                    std::to_string(n) + " (kernel " + record.name + ")");
  for (int i = 0; i < nargs; ++i)
    if (!args[i])
      throw Error(ErrorCode::InvalidArgument, "args[" + std::to_string(i) + "]: NULL (kernel " +
                                                  record.name + ", role " +
                                                  argRoleName(record.args[i].role) + ")");
  if (record.kind == KernelKind::Rows) {
    int64_t rows = argInt64(args, nargs - 2), cols = argInt64(args, nargs - 1);
    std::string where = " (kernel " + record.name + ")";
    if (rows < 0 || cols < 0 || rows > kMaxLaunchCount || cols > kMaxLaunchCount)
      throw Error(ErrorCode::InvalidArgument, "args[" + std::to_string(nargs - 2) +
                                                  "], args[" + std::to_string(nargs - 1) +
                                                  "]: rows and cols must be >= 0 and at most 2^62, got " +
                                                  std::to_string(rows) + " and " +
                                                  std::to_string(cols) + where);
    if (cols != 0 && rows > INT64_MAX / cols)
      throw Error(ErrorCode::InvalidArgument, "rows * cols overflows int64" + where);
    if (rows * cols != n)
      throw Error(ErrorCode::InvalidArgument,
                  "n: must be rows * cols = " + std::to_string(rows * cols) + ", got " +
                      std::to_string(n) + where);
    // Packed codes of row r start at bit r * cols * bits: a whole byte unless it is one row.
    for (int i = 0; i < nargs; ++i) {
      const KernelArg &arg = record.args[static_cast<size_t>(i)];
      if (arg.layout == ArgLayout::Packed && rows > 1 && (cols * arg.bits) % 8 != 0)
        throw Error(ErrorCode::InvalidArgument,
                    "args[" + std::to_string(i) + "]: " + std::to_string(arg.bits) +
                        "-bit codes of rows of " + std::to_string(cols) +
                        " columns do not start on a byte; cols * bits must be a multiple of 8 "
                        "when there is more than one row" + where);
    }
  } else {
    int64_t count = argInt64(args, nargs - 1);
    if (count != n)
      throw Error(ErrorCode::InvalidArgument,
                  "args[" + std::to_string(nargs - 1) + "]: the count argument is " +
                      std::to_string(count) + " but n is " + std::to_string(n) + " (kernel " +
                      record.name + ")");
  }
  // Last, once the sizes agree: a tensor's data pointer may only be NULL when there is nothing
  // to read or write (a tensor without storage, e.g. a FakeTensor's, would crash the process).
  // A total kernel runs even over no elements: its result, scratch and total inputs are read
  // or written regardless.
  for (int i = 0; i < nargs; ++i) {
    const KernelArg &arg = record.args[static_cast<size_t>(i)];
    if ((arg.role == ArgRole::Scratch || arg.layout == ArgLayout::Total) &&
        !*static_cast<void *const *>(args[i]))
      throw Error(ErrorCode::InvalidArgument,
                  "args[" + std::to_string(i) + "]: a NULL pointer (kernel " + record.name +
                      ", role " + argRoleName(arg.role) + ", one value or the scratch)");
  }
  if (n > 0)
    for (int i = 0; i < nargs; ++i) {
      ArgRole role = record.args[static_cast<size_t>(i)].role;
      if ((role == ArgRole::In || role == ArgRole::Out) && !*static_cast<void *const *>(args[i]))
        throw Error(ErrorCode::InvalidArgument,
                    "args[" + std::to_string(i) + "]: a NULL data pointer for " +
                        std::to_string(n) + " elements (kernel " + record.name + ", role " +
                        argRoleName(role) + ")");
    }
}

void launchOnHost(HostEntry entry, const LaunchConfig &config, void **args, int64_t n) {
  // ABP_HOST_THREADS is read when the pool is made, by the first launch too large to run inline;
  // read here as well (once it parses), so that a value that does not parse fails every CPU
  // launch alike, not only the large ones a small test never makes.
  static const bool threadsParse = (env::getInt(EnvVar::ABP_HOST_THREADS), true);
  (void)threadsParse;
  if (config.grid <= 0)
    return;
  if (n <= kHostInlineElements)
    entry(args, config.grid, config.block, 0, config.grid);
  else
    ThreadPool::global().run(entry, args, config.grid, config.block);
}

void launchOnDevice(Driver &driver, CUfunction function, const LaunchConfig &config,
                    CUstream stream, void **args) {
  if (config.grid <= 0)
    return;
  constexpr int64_t kMaxGridX = 2147483647;
  int64_t grid = config.grid < kMaxGridX ? config.grid : kMaxGridX;
  driver.launch(function, static_cast<unsigned>(grid), static_cast<unsigned>(config.block), stream,
                args);
}

ArgPack::ArgPack(const KernelRecord &record) : record_(record) {
  for (int i = 0; i < kMaxKernelArgs; ++i)
    slots_[i] = &values_[i];
}

const KernelArg &ArgPack::expect(const char *what) {
  if (next_ >= static_cast<int>(record_.args.size()))
    throw Error(ErrorCode::InvalidArgument,
                std::string("argument ") + std::to_string(next_) + " (" + what + "): kernel " +
                    record_.name + " takes only " + std::to_string(record_.args.size()));
  return record_.args[static_cast<size_t>(next_)];
}

static Error roleMismatch(const KernelRecord &record, int index, const char *given) {
  return Error(ErrorCode::InvalidArgument,
               "argument " + std::to_string(index) + " of kernel " + record.name + " has role " +
                   argRoleName(record.args[static_cast<size_t>(index)].role) + ", but " + given +
                   " was given");
}

ArgPack &ArgPack::pointer(const void *p) {
  const KernelArg &arg = expect("a pointer");
  if (arg.role != ArgRole::In && arg.role != ArgRole::Out && arg.role != ArgRole::Scratch)
    throw roleMismatch(record_, next_, "a pointer");
  values_[next_++].pointer = p;
  return *this;
}

ArgPack &ArgPack::scalarInt(int64_t value) {
  const KernelArg &arg = expect("an i64 scalar");
  if (arg.role != ArgRole::Scalar || arg.scalarType != ScalarType::I64)
    throw roleMismatch(record_, next_, "an i64 scalar");
  values_[next_++].count = value;
  return *this;
}

ArgPack &ArgPack::scalar(float value) {
  const KernelArg &arg = expect("a scalar");
  if (arg.role != ArgRole::Scalar || arg.scalarType != ScalarType::F32)
    throw roleMismatch(record_, next_, "an f32 scalar");
  values_[next_++].scalar = value;
  return *this;
}

ArgPack &ArgPack::count(int64_t n) {
  const KernelArg &arg = expect("the count");
  if (arg.role != ArgRole::Count)
    throw roleMismatch(record_, next_, "the count");
  values_[next_++].count = n;
  return *this;
}

ArgPack &ArgPack::shape(int64_t rows, int64_t cols) {
  if (expect("the rows").role != ArgRole::Rows)
    throw roleMismatch(record_, next_, "the rows");
  values_[next_++].count = rows;
  if (expect("the cols").role != ArgRole::Cols)
    throw roleMismatch(record_, next_, "the cols");
  values_[next_++].count = cols;
  return *this;
}

void **ArgPack::data() {
  if (next_ != static_cast<int>(record_.args.size()))
    throw Error(ErrorCode::InvalidArgument,
                "kernel " + record_.name + " takes " + std::to_string(record_.args.size()) +
                    " arguments, only " + std::to_string(next_) + " were packed");
  return slots_;
}

} // namespace abp::rt
