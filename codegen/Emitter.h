// Emitter.h — turns kernel-form IR into CUDA C++ source and its launch manifest.
#ifndef ABP_CODEGEN_EMITTER_H
#define ABP_CODEGEN_EMITTER_H

#include "dialect/AbpDialect.h"

#include "mlir/IR/BuiltinOps.h"

#include <string>
#include <vector>

namespace abp {

/// A storage dtype a kernel is specialised for, and the type its math runs in.
struct Dtype {
  const char *name;        ///< manifest / Python name: "f32", "f16", "bf16", "f64"
  const char *cppType;     ///< element type in the generated source
  const char *computeType; ///< "float", or "double" for f64
};
/// Elementwise kernels: f32, f16, bf16 (fp32 math).
const std::vector<Dtype> &kernelDtypes();
/// Row kernels: those plus f64 (fp64 math and per-row values), so that fp64 references can
/// check exact backward formulas tightly.
const std::vector<Dtype> &rowKernelDtypes();

/// A kernel's symbol per dtype: (dtype name, extern "C" symbol).
using KernelSymbols = std::vector<std::pair<std::string, std::string>>;

/// 8 hex digits identifying a kernel's generated code, so a profiler name leads to its source.
std::string shortHash(const std::string &text);

struct EmitOptions {
  std::string inputFile;   ///< recorded in the manifest ("ops/lowmembp/regelu2.mlir")
  std::string sourceName;  ///< file name of the .cu next to the manifest
  std::string hostLibrary; ///< file name of the host shared object next to the manifest
};

struct EmittedBundle {
  std::string source;   ///< CUDA C++ (also valid host C++ with ABP_HOST)
  std::string manifest; ///< JSON, docs/manifest.md
};

/// Emits the source and manifest for a module in kernel form (after `abp-pipeline`). Emits a
/// located diagnostic and fails on IR it cannot translate.
mlir::FailureOr<EmittedBundle> emitBundle(mlir::ModuleOp module, const EmitOptions &options);

// Pieces, one file each.
/// Emits every func.func of the module as a device function (EmitFunctions.cpp).
mlir::LogicalResult emitScalarFunctions(mlir::ModuleOp module, class SourceWriter &out);
/// Emits the body function, the dtype-generic loop and the extern "C" entries of one kernel;
/// returns the symbol per dtype in `symbols` (EmitElementwise.cpp).
mlir::LogicalResult emitElementwiseKernel(KernelOp kernel, class SourceWriter &out,
                                          KernelSymbols &symbols);
/// Emits a row kernel (`rows`): uniforms, stages, sweeps, GPU and CPU drivers, entries
/// (EmitRows.cpp).
mlir::LogicalResult emitRowKernel(KernelOp kernel, class SourceWriter &out,
                                  KernelSymbols &symbols);
/// Emits a total kernel (`total`): the thread partials and the GPU and CPU entries that combine
/// them over the whole launch (EmitTotal.cpp).
mlir::LogicalResult emitTotalKernel(KernelOp kernel, class SourceWriter &out,
                                    KernelSymbols &symbols);
/// Emits the manifest JSON (EmitManifest.cpp).
std::string emitManifest(mlir::ModuleOp module, const EmitOptions &options,
                         const std::vector<std::pair<KernelOp, KernelSymbols>> &kernels);

} // namespace abp

#endif // ABP_CODEGEN_EMITTER_H
