// MapThreads.cpp — picks block size and per-thread chunk of every kernel, and the warp/block
// split of row kernels.
#include "passes/Passes.h"

#include <numeric>

namespace abp {
#define GEN_PASS_DEF_ABPMAPTHREADS
#include "passes/Passes.h.inc"
} // namespace abp

using namespace mlir;
using namespace abp;

namespace {
/// Dense arguments are read/written as 128-bit vectors: 8 elements at 16-bit dtypes (two
/// vectors at fp32), so one chunk size serves every launch dtype.
constexpr int64_t kDenseElementsPerVector = 8;

int64_t chunkFor(KernelOp kernel) {
  int64_t chunk = 1;
  for (Attribute layout : llvm::concat<const Attribute>(kernel.getIns(), kernel.getOuts())) {
    if (isa<DenseLayoutAttr>(layout))
      chunk = std::lcm(chunk, kDenseElementsPerVector);
    else if (auto packed = dyn_cast<PackedLayoutAttr>(layout))
      chunk = std::lcm(chunk, int64_t{8} / std::gcd(int64_t{packed.getBits()}, int64_t{8}));
  }
  return chunk;
}

struct MapThreads : abp::impl::AbpMapThreadsBase<MapThreads> {
  using AbpMapThreadsBase::AbpMapThreadsBase;
  void runOnOperation() override {
    if (blockSize <= 0 || blockSize > 1024 || blockSize % 32 != 0) {
      getOperation().emitError() << "abp-map-threads: block-size must be a multiple of 32 in "
                                    "[32, 1024], got "
                                 << static_cast<int64_t>(blockSize.getValue());
      return signalPassFailure();
    }
    Builder builder(&getContext());
    if (warpMaxCols < 0) {
      getOperation().emitError() << "abp-map-threads: warp-max-cols must be >= 0, got "
                                 << static_cast<int64_t>(warpMaxCols.getValue());
      return signalPassFailure();
    }
    getOperation().walk([&](KernelOp kernel) {
      kernel.setChunkAttr(builder.getI64IntegerAttr(chunkFor(kernel)));
      kernel.setBlockSizeAttr(builder.getI64IntegerAttr(blockSize));
      if (kernel.isRowKernel())
        kernel.setWarpMaxColsAttr(builder.getI64IntegerAttr(warpMaxCols));
    });
  }
};
} // namespace
