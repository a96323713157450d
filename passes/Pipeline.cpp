// Pipeline.cpp — the default abp lowering pipeline and global pass registration.
#include "passes/Passes.h"

#include "mlir/Transforms/Passes.h"

using namespace mlir;

void abp::buildAbpPipeline(OpPassManager &pm) {
  pm.addPass(createAbpVerifyResiduals());
  pm.addPass(createAbpInstantiateVariants());
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
