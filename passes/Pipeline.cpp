// Pipeline.cpp — the default abp lowering pipeline and global pass registration.
#include "passes/Passes.h"

#include "mlir/Transforms/Passes.h"

using namespace mlir;

void abp::buildAbpPipeline(OpPassManager &pm) {
  // Before anything rewrites the module (a stray top-level op can make the canonicalizer loop).
  pm.addPass(createAbpVerifyModule());
  // Instantiate first: each instance then gets its own residual check and saved-bits count.
  pm.addPass(createAbpInstantiateVariants());
  pm.addPass(createAbpVerifyResiduals());
  pm.addPass(createAbpLowerQuantize());
  pm.addPass(createCanonicalizerPass());
  pm.addPass(createAbpFuseKernels());
  pm.addPass(createCSEPass());
  pm.addPass(createCanonicalizerPass());
  pm.addPass(createAbpMapThreads());
}

void abp::registerAbpPassesAndPipeline() {
  registerAbpPasses();
  PassPipelineRegistration<>("abp-pipeline",
                             "lower authored abp operators to fused, thread-mapped kernels",
                             buildAbpPipeline);
}
