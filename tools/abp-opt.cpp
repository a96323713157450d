// abp-opt.cpp — mlir-opt for the abp dialect: parse, verify, run any abp pass or the pipeline.
#include "dialect/AbpDialect.h"
#include "passes/Passes.h"

#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<abp::AbpDialect, mlir::arith::ArithDialect, mlir::math::MathDialect,
                  mlir::func::FuncDialect>();
  abp::registerAbpPassesAndPipeline();
  mlir::registerCanonicalizerPass();
  mlir::registerCSEPass();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "abp optimizer driver\n", registry));
}
