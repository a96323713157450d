// Launch.h — the manifest-driven launch rules: grid size, argument checks, argument packing.
#ifndef ABP_RUNTIME_LAUNCH_H
#define ABP_RUNTIME_LAUNCH_H

#include "runtime/Driver.h"
#include "runtime/HostBackend.h"
#include "runtime/Manifest.h"

#include <cstdint>

namespace abp::rt {

/// GPU grids are capped at this many blocks per multiprocessor (the kernels grid-stride).
constexpr int64_t kBlocksPerMultiprocessor = 32;
/// CPU launches of at most this many elements run on the calling thread.
constexpr int64_t kHostInlineElements = 1 << 15;
/// The largest element count (and row or column count) a launch takes: a grid-stride index
/// plus its stride stays within int64 (checkLaunchArgs refuses more; no tensor comes near it).
constexpr int64_t kMaxLaunchCount = int64_t{1} << 62;

struct LaunchConfig {
  int64_t grid = 0;  ///< blocks; 0 = nothing to launch
  int64_t block = 0; ///< threads per block
};

/// A total kernel's grid: ceil(ceil(n / chunk) / block) blocks, at least 1 (it runs even over
/// no elements, writing the reduction's identity) and at most kTotalMaxBlocks, whatever the
/// device: the combination order, and so the result, depend on n alone.
LaunchConfig gridForTotal(int64_t n, int chunk, int block);

/// docs/manifest.md's grid rule: `block` threads per block and
/// min(ceil(ceil(n / chunk) / block), maxBlocks) blocks (maxBlocks <= 0: no cap); n == 0 gives
/// grid 0.
LaunchConfig gridFor(int64_t n, int chunk, int block, int64_t maxBlocks);
/// docs/manifest.md's row-kernel grid rule: rows of at most warpMaxCols columns take one warp
/// each (block / 32 rows per block), longer rows one block each; at most maxBlocks blocks
/// (<= 0: no cap). rows == 0 gives grid 0; cols == 0 still launches (per-row outputs of empty
/// rows are written).
LaunchConfig gridForRows(int64_t rows, int64_t cols, int block, int64_t warpMaxCols,
                         int64_t maxBlocks);
/// The grid of a checked launch of `record` (either kind) with `args`.
LaunchConfig launchConfigFor(const KernelRecord &record, void *const *args, int nargs, int64_t n,
                             int64_t maxBlocks);

/// Checks a launch against its kernel record: `nargs` equals the manifest's argument count,
/// `args` and its entries are non-null, n >= 0 and the count argument (last) equals n — for
/// a row kernel, rows and cols (the last two) are >= 0 and rows * cols equals n.
/// Throws Error(InvalidArgument) naming the kernel and the argument. Allocates nothing.
void checkLaunchArgs(const KernelRecord &record, void *const *args, int nargs, int64_t n);

/// Runs a checked launch of `n` elements on the CPU: inline when small, else split over the
/// global thread pool. Synchronous.
void launchOnHost(HostEntry entry, const LaunchConfig &config, void **args, int64_t n);

/// cuLaunchKernel of a checked launch on `stream`. Asynchronous.
void launchOnDevice(Driver &driver, CUfunction function, const LaunchConfig &config,
                    CUstream stream, void **args);

/// Builds the `void **args` array of a launch from typed values, checking each against the
/// kernel's manifest roles (pointers for in/out, float for scalar, int64 for count). Holds the
/// values itself (no allocation), so it must outlive the launch call.
class ArgPack {
public:
  explicit ArgPack(const KernelRecord &record);
  ArgPack(const ArgPack &) = delete;
  ArgPack &operator=(const ArgPack &) = delete;

  /// The next in/out argument (a device pointer on the GPU, a host pointer on the CPU).
  ArgPack &pointer(const void *p);
  /// The next scalar argument: an f32 parameter, or an i64 one (the manifest says which).
  ArgPack &scalar(float value);
  ArgPack &scalarInt(int64_t value);
  /// The count (last) argument.
  ArgPack &count(int64_t n);
  /// A row kernel's shape (its last two arguments).
  ArgPack &shape(int64_t rows, int64_t cols);

  /// The argument array; InvalidArgument unless every argument was given.
  void **data();
  int size() const { return next_; }

private:
  const KernelArg &expect(const char *what);

  const KernelRecord &record_;
  union Value {
    const void *pointer;
    float scalar;
    int64_t count; ///< also i64 scalars
  };
  Value values_[kMaxKernelArgs];
  void *slots_[kMaxKernelArgs];
  int next_ = 0;
};

} // namespace abp::rt

#endif // ABP_RUNTIME_LAUNCH_H
