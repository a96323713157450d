// Passes.h — declarations and registration of every abp pass and of the default pipeline.
#ifndef ABP_PASSES_PASSES_H
#define ABP_PASSES_PASSES_H

#include "dialect/AbpDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassManager.h"

namespace abp {

#define GEN_PASS_DECL
#include "passes/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "passes/Passes.h.inc"

/// Appends the full lowering, from authored operators to kernel form, to `pm`:
/// verify-module → instantiate-variants → verify-residuals → lower-quantize → canonicalize →
/// fuse-kernels → cse → canonicalize → map-threads.
void buildAbpPipeline(mlir::OpPassManager &pm);

/// Registers every abp pass and the `abp-pipeline` pipeline with the global registry.
void registerAbpPassesAndPipeline();

} // namespace abp

#endif // ABP_PASSES_PASSES_H
