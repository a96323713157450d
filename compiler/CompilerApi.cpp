// CompilerApi.cpp — libabp_compiler.so: compiles operator IR text to source + manifest at run time.
//
// The runtime stays MLIR-free: it dlopen()s this library only when a *new* operator is compiled
// from IR (abp_compile_ir in the C API); the op library in ops/ is compiled at build time. The
// entry points are declared, with their contract, in runtime/CompilerPlugin.h.
#include "runtime/CompilerPlugin.h"

#include "codegen/Emitter.h"
#include "dialect/AbpDialect.h"
#include "dialect/IrText.h"
#include "passes/Passes.h"

#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdlib>
#include <cstring>

using namespace mlir;

namespace {
char *copyOut(const std::string &text) {
  char *out = static_cast<char *>(std::malloc(text.size() + 1));
  if (out)
    std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}
} // namespace

extern "C" ABP_COMPILER_EXPORT int abp_compiler_compile(const char *irText, const char *bufferName,
                                                        const char *stem, char **source,
                                                        char **manifest, char **diagnostics) {
  *source = *manifest = *diagnostics = nullptr;
  DialectRegistry registry;
  registry.insert<abp::AbpDialect, arith::ArithDialect, math::MathDialect, func::FuncDialect>();
  MLIRContext context(registry, MLIRContext::Threading::DISABLED);
  context.loadAllAvailableDialects();

  std::string diagText;
  llvm::raw_string_ostream diagStream(diagText);
  llvm::SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(llvm::MemoryBuffer::getMemBufferCopy(irText, bufferName),
                               llvm::SMLoc());
  SourceMgrDiagnosticHandler handler(sourceMgr, &context, diagStream);

  if (failed(abp::checkIrText(sourceMgr, &context))) { // before the parser recurses
    *diagnostics = copyOut(diagText);
    return 1;
  }
  OwningOpRef<ModuleOp> module = parseSourceFile<ModuleOp>(sourceMgr, &context);
  if (!module) {
    *diagnostics = copyOut(diagText);
    return 1;
  }
  PassManager pm(&context);
  abp::buildAbpPipeline(pm);
  if (failed(pm.run(*module))) {
    *diagnostics = copyOut(diagText);
    return 1;
  }
  abp::EmitOptions options;
  options.inputFile = bufferName;
  options.sourceName = std::string(stem) + ".cu";
  options.hostLibrary = std::string(stem) + ".host.so";
  FailureOr<abp::EmittedBundle> bundle = abp::emitBundle(*module, options);
  if (failed(bundle)) {
    *diagnostics = copyOut(diagText);
    return 1;
  }
  *source = copyOut(bundle->source);
  *manifest = copyOut(bundle->manifest);
  *diagnostics = copyOut(diagText);
  return 0;
}

extern "C" ABP_COMPILER_EXPORT void abp_compiler_free(char *text) { std::free(text); }
