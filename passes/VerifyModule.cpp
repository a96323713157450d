// VerifyModule.cpp — refuses top-level ops that are not operators, kernels or their callees.
#include "passes/Passes.h"

namespace abp {
#define GEN_PASS_DEF_ABPVERIFYMODULE
#include "passes/Passes.h.inc"
} // namespace abp

namespace {
struct VerifyModule : abp::impl::AbpVerifyModuleBase<VerifyModule> {
  void runOnOperation() override {
    if (mlir::failed(abp::verifyModuleContents(getOperation(), "lowered")))
      signalPassFailure();
  }
};
} // namespace
