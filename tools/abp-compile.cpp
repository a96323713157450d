// abp-compile.cpp — the compiler driver: every stage of an operator file can be emitted.
//
//   abp-compile FILE --emit=mlir|kernel|cuda|manifest|bundle|ptx|cubin|host [--arch=sm_XX] [-o OUT]
//
// mlir: the parsed, verified input; kernel: after abp-pipeline; cuda: the generated source;
// manifest: its launch manifest; bundle: OUT/NAME.cu + OUT/NAME.json (what the build runs over
// ops/); ptx/cubin: NVRTC output for --arch (no GPU needed); host: the CPU path's shared object.
// With ABP_DUMP_DIR set, every stage of the run is also written to $ABP_DUMP_DIR/NAME/.
#include "codegen/Emitter.h"
#include "dialect/AbpDialect.h"
#include "dialect/IrText.h"
#include "passes/Passes.h"
#include "runtime/Env.h"
#include "runtime/HostCompile.h"
#include "runtime/Nvrtc.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassInstrumentation.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/ToolOutputFile.h"

#include <cstdlib>

using namespace mlir;
namespace cl = llvm::cl;

namespace {
enum class Emit { Mlir, Kernel, Cuda, Manifest, Bundle, Ptx, Cubin, Host };

// --help lists these alone: the binary links all of LLVM, whose hundreds of backend options
// would bury them. MLIR's printing options still work and are listed by --help-hidden.
cl::OptionCategory abpCategory("abp-compile options");
cl::opt<std::string> inputFile(cl::Positional, cl::desc("<operator file.mlir>"),
                               cl::cat(abpCategory));
cl::opt<bool> printEnv("print-env",
                       cl::desc("print every ABP_* environment variable the runtime reads (its "
                                "effective value, default and meaning) and exit"),
                       cl::cat(abpCategory));
cl::opt<Emit> emitLevel(
    "emit", cl::desc("the stage to emit"), cl::init(Emit::Cuda),
    cl::values(clEnumValN(Emit::Mlir, "mlir", "the parsed and verified input IR"),
               clEnumValN(Emit::Kernel, "kernel", "the kernel-form IR after abp-pipeline"),
               clEnumValN(Emit::Cuda, "cuda", "the generated CUDA C++ source"),
               clEnumValN(Emit::Manifest, "manifest", "the launch manifest (JSON)"),
               clEnumValN(Emit::Bundle, "bundle", "NAME.cu and NAME.json into directory -o"),
               clEnumValN(Emit::Ptx, "ptx", "PTX for --arch, through NVRTC"),
               clEnumValN(Emit::Cubin, "cubin", "a cubin for --arch, through NVRTC"),
               clEnumValN(Emit::Host, "host", "the CPU path's shared object (needs -o)")),
    cl::cat(abpCategory));
cl::opt<std::string> outputFile("o", cl::desc("output file (directory for --emit=bundle)"),
                                cl::init("-"), cl::cat(abpCategory));
cl::opt<std::string> arch("arch", cl::desc("GPU architecture for ptx/cubin, e.g. sm_80"),
                          cl::init("sm_80"), cl::cat(abpCategory));
cl::opt<std::string>
    displayPath("display-path",
                cl::desc("the path recorded in the manifest (default: the input path)"),
                cl::init(""), cl::cat(abpCategory));

/// Writes the IR after every pass to `<dir>/after-NN-<pass>.mlir` (ABP_DUMP_DIR).
struct DumpAfterPass : PassInstrumentation {
  explicit DumpAfterPass(std::string dir) : dir(std::move(dir)) {}
  void runAfterPass(Pass *pass, Operation *op) override {
    std::string path =
        llvm::formatv("{0}/after-{1:02}-{2}.mlir", dir, ++count, pass->getArgument()).str();
    std::error_code ec;
    llvm::raw_fd_ostream os(path, ec);
    if (!ec)
      op->print(os);
  }
  std::string dir;
  int count = 0;
};

/// Remembers the last pass that failed so the driver can name it.
struct RecordFailure : PassInstrumentation {
  void runAfterPassFailed(Pass *pass, Operation *) override { failed = pass->getArgument().str(); }
  std::string failed;
};

int writeOutput(StringRef text, StringRef path) {
  std::string error;
  std::unique_ptr<llvm::ToolOutputFile> out = openOutputFile(path, &error);
  if (!out) {
    llvm::errs() << "abp-compile: " << error << "\n";
    return 1;
  }
  out->os() << text;
  out->keep();
  return 0;
}
} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  registerAsmPrinterCLOptions();
  registerMLIRContextCLOptions();
  // Hidden, not ReallyHidden (cl::HideUnrelatedOptions): --help-hidden still lists MLIR's.
  for (auto &[name, option] : cl::getRegisteredOptions())
    if (!llvm::is_contained(option->Categories, &abpCategory) && !name.starts_with("help") &&
        name != "version")
      option->setHiddenFlag(cl::Hidden);
  cl::ParseCommandLineOptions(argc, argv,
                              "abp compiler driver (--help-hidden also lists MLIR's options)\n");
  if (printEnv) {
    for (const abp::rt::EnvVarInfo &row : abp::rt::env::registry()) {
      // The value as set (the runtime checks its type when it reads it); unset: the default.
      std::string value = abp::rt::env::raw(row.var);
      llvm::outs() << row.name << "=" << (value.empty() ? "(unset)" : value) << "  (default \""
                   << row.defaultValue << "\""
                   << (row.invalidatesCache ? ", part of every compile-cache key" : "") << ")\n    "
                   << row.doc << "\n";
    }
    return EXIT_SUCCESS;
  }
  if (inputFile.empty()) {
    llvm::errs() << "abp-compile: no input file (abp-compile <operator file.mlir> --emit=...; "
                    "--help lists the options)\n";
    return EXIT_FAILURE;
  }

  DialectRegistry registry;
  registry.insert<abp::AbpDialect, arith::ArithDialect, math::MathDialect, func::FuncDialect>();
  MLIRContext context(registry);
  context.loadAllAvailableDialects();

  llvm::SourceMgr sourceMgr;
  SourceMgrDiagnosticHandler diagnostics(sourceMgr, &context);
  std::string error;
  std::unique_ptr<llvm::MemoryBuffer> buffer = openInputFile(inputFile, &error);
  if (!buffer) {
    llvm::errs() << "abp-compile: " << error << "\n";
    return 1;
  }
  sourceMgr.AddNewSourceBuffer(std::move(buffer), llvm::SMLoc());
  if (failed(abp::checkIrText(sourceMgr, &context)))
    return 1;
  OwningOpRef<ModuleOp> module = parseSourceFile<ModuleOp>(sourceMgr, &context);
  if (!module)
    return 1; // the parser/verifier already reported file:line:col

  std::string stem = llvm::sys::path::stem(inputFile).str();
  std::string dumpDir;
  if (const char *dump = std::getenv("ABP_DUMP_DIR"); dump && *dump) {
    dumpDir = std::string(dump) + "/" + stem;
    llvm::sys::fs::create_directories(dumpDir);
    std::string text;
    llvm::raw_string_ostream os(text);
    module->print(os);
    writeOutput(text, dumpDir + "/input.mlir");
  }
  if (emitLevel == Emit::Mlir) {
    // "Verified" includes the module-level rules the pipeline's first pass checks.
    if (failed(abp::verifyModuleContents(*module, "compiled")))
      return 1;
    std::string text;
    llvm::raw_string_ostream os(text);
    module->print(os);
    return writeOutput(text, outputFile);
  }

  PassManager pm(&context);
  abp::buildAbpPipeline(pm);
  auto failure = std::make_unique<RecordFailure>();
  RecordFailure *failureRef = failure.get();
  pm.addInstrumentation(std::move(failure));
  if (!dumpDir.empty())
    pm.addInstrumentation(std::make_unique<DumpAfterPass>(dumpDir));
  if (mlir::failed(pm.run(*module))) {
    llvm::errs() << "abp-compile: pass '" << failureRef->failed << "' failed on " << inputFile
                 << "\n";
    return 1;
  }
  if (emitLevel == Emit::Kernel) {
    std::string text;
    llvm::raw_string_ostream os(text);
    module->print(os);
    return writeOutput(text, outputFile);
  }

  abp::EmitOptions options;
  options.inputFile = displayPath.empty() ? inputFile.getValue() : displayPath.getValue();
  options.sourceName = stem + ".cu";
  options.hostLibrary = stem + ".host.so";
  FailureOr<abp::EmittedBundle> bundle = abp::emitBundle(*module, options);
  if (mlir::failed(bundle))
    return 1;
  if (!dumpDir.empty()) {
    writeOutput(bundle->source, dumpDir + "/kernel.cu");
    writeOutput(bundle->manifest, dumpDir + "/manifest.json");
  }

  switch (emitLevel) {
  case Emit::Cuda:
    return writeOutput(bundle->source, outputFile);
  case Emit::Manifest:
    return writeOutput(bundle->manifest, outputFile);
  case Emit::Bundle: {
    if (outputFile == "-") {
      llvm::errs() << "abp-compile: --emit=bundle needs -o DIRECTORY\n";
      return 1;
    }
    llvm::sys::fs::create_directories(outputFile);
    // Write the manifest last: the runtime treats a manifest as the sign of a complete bundle.
    int rc = writeOutput(bundle->source, outputFile + "/" + options.sourceName);
    return rc ? rc : writeOutput(bundle->manifest, outputFile + "/" + stem + ".json");
  }
  case Emit::Ptx:
  case Emit::Cubin: {
    abp::rt::NvrtcOutput out;
    std::string log;
    if (!abp::rt::compileWithNvrtcNoThrow(stem, stem + ".cu", bundle->source, arch,
                                          emitLevel == Emit::Ptx ? abp::rt::OutputKind::Ptx
                                                                 : abp::rt::OutputKind::Cubin,
                                          out, log)) {
      llvm::errs() << log << "\n";
      return 1;
    }
    const std::string &binary = out.binary;
    if (!dumpDir.empty())
      writeOutput(binary, dumpDir + (emitLevel == Emit::Ptx ? "/kernel.ptx" : "/kernel.cubin"));
    return writeOutput(binary, outputFile);
  }
  case Emit::Host: {
    if (outputFile == "-") {
      llvm::errs() << "abp-compile: --emit=host needs -o FILE.so\n";
      return 1;
    }
    std::string log;
    if (!abp::rt::compileHostLibraryNoThrow(stem, bundle->source, outputFile, log)) {
      llvm::errs() << log << "\n";
      return 1;
    }
    return 0;
  }
  default:
    return 0;
  }
}
