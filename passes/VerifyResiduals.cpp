// VerifyResiduals.cpp — checks that every saved residual is used and records saved bits per element and per row.
#include "passes/Passes.h"

#include "llvm/ADT/SmallPtrSet.h"

namespace abp {
#define GEN_PASS_DEF_ABPVERIFYRESIDUALS
#include "passes/Passes.h.inc"
} // namespace abp

using namespace mlir;
using namespace abp;

namespace {
struct VerifyResiduals : abp::impl::AbpVerifyResidualsBase<VerifyResiduals> {
  void runOnOperation() override {
    getOperation().walk([&](OperatorOp op) {
      ReturnOp ret = op.getForwardReturn();
      Block &backward = op.getBackward().front();
      llvm::SmallPtrSet<Value, 4> seen;
      int64_t bits = 0, rowBits = 0;
      int64_t inputRank = 0;
      for (BlockArgument arg : op.getTensorInputs())
        inputRank = std::max(inputRank, cast<RankedTensorType>(arg.getType()).getRank());
      for (auto [i, saved] : llvm::enumerate(ret.getSaved())) {
        if (!seen.insert(saved).second) {
          ret.emitOpError() << "saves the same value twice (residual #" << i << ")";
          return signalPassFailure();
        }
        if (backward.getArgument(i).use_empty()) {
          InFlightDiagnostic diag = ret.emitOpError()
                                    << "saves residual #" << i << " but backward never uses it";
          diag.attachNote(backward.getArgument(i).getLoc()) << "the unused backward argument";
          return signalPassFailure();
        }
        // A shared output is the consumer's own tensor: it costs this operator nothing.
        if (isa_and_nonnull<ShareSavedOp>(saved.getDefiningOp()))
          continue;
        // A per-column vector (read through abp.broadcast_cols: a norm's gain) is a forward input
        // saved as it is, the caller's own tensor; its cols values do not grow with the batch.
        auto perColumn = [](Value v) {
          return llvm::any_of(v.getUsers(), [](Operation *u) { return isa<BroadcastColsOp>(u); });
        };
        if (perColumn(saved) || perColumn(backward.getArgument(i)))
          continue;
        std::optional<unsigned> b = savedBitsPerElement(saved.getType());
        if (!b)
          continue;
        auto tensor = dyn_cast<RankedTensorType>(saved.getType());
        if (tensor && tensor.getRank() < inputRank)
          rowBits += *b; // one value per row
        else
          bits += *b;
      }
      auto i64 = IntegerType::get(&getContext(), 64);
      op->setAttr("abp.saved_bits", IntegerAttr::get(i64, bits));
      if (rowBits)
        op->setAttr("abp.saved_row_bits", IntegerAttr::get(i64, rowBits));
    });
  }
};
} // namespace
