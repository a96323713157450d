// VerifyResiduals.cpp — checks that every saved residual is used and records saved bits/element.
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
      int64_t bits = 0;
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
        if (std::optional<unsigned> b = savedBitsPerElement(saved.getType()))
          bits += *b;
      }
      op->setAttr("abp.saved_bits", IntegerAttr::get(IntegerType::get(&getContext(), 64), bits));
    });
  }
};
} // namespace
