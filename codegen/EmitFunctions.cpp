// EmitFunctions.cpp — emits the module's scalar func.func definitions as device function templates
// over the compute type.
#include "codegen/Emitter.h"
#include "codegen/ScalarEmitter.h"

using namespace mlir;
using namespace abp;

static FailureOr<std::string> signatureOf(func::FuncOp fn) {
  FunctionType type = fn.getFunctionType();
  if (type.getNumResults() != 1)
    return fn.emitOpError() << "must return exactly one scalar to be emitted by abp codegen";
  std::string params;
  for (auto [i, t] : llvm::enumerate(type.getInputs())) {
    std::string cpp = t.isF32() ? "C" : ScalarEmitter::cppType(t);
    if (cpp.empty())
      return fn.emitOpError() << "has argument #" << i << " of type " << t
                              << ", which abp codegen cannot hold";
    params += fmt::format("{}{} a{}", params.empty() ? "" : ", ", cpp, i);
  }
  Type resultType = type.getResult(0);
  std::string result = resultType.isF32() ? "C" : ScalarEmitter::cppType(resultType);
  if (result.empty())
    return fn.emitOpError() << "returns " << resultType << ", which abp codegen cannot hold";
  // A template over the compute type C (float, or double in fp64 row kernels).
  return fmt::format("template <typename C> ABP_FN {} {}({})", result,
                     ScalarEmitter::functionName(fn.getSymName()), params);
}

/// The functions kernel bodies call, directly or through other functions, in module order.
/// The pipeline inlines the callees of abp.map into the kernels it fuses, so these are the
/// functions hand-written abp.kernel ops call; the rest would be dead code in the source.
static SmallVector<func::FuncOp> calledFunctions(ModuleOp module) {
  llvm::DenseSet<Operation *> called;
  SmallVector<Operation *> work;
  auto visit = [&](Operation *root) {
    root->walk([&](func::CallOp call) {
      auto fn = SymbolTable::lookupNearestSymbolFrom<func::FuncOp>(call, call.getCalleeAttr());
      if (fn && called.insert(fn).second)
        work.push_back(fn);
    });
  };
  for (KernelOp kernel : module.getOps<KernelOp>())
    visit(kernel);
  while (!work.empty())
    visit(work.pop_back_val());
  SmallVector<func::FuncOp> fns;
  for (func::FuncOp fn : module.getOps<func::FuncOp>())
    if (called.contains(fn))
      fns.push_back(fn);
  return fns;
}

LogicalResult abp::emitScalarFunctions(ModuleOp module, SourceWriter &out) {
  SmallVector<func::FuncOp> fns = calledFunctions(module);
  if (fns.empty())
    return success();
  out.line("// Scalar functions of the module (func.func), called from kernel bodies.");
  for (func::FuncOp fn : fns) { // declarations first: bodies may call each other in any order
    FailureOr<std::string> sig = signatureOf(fn);
    if (failed(sig))
      return failure();
    if (fn.isExternal())
      return fn.emitOpError() << "is declared without a body; abp codegen needs its definition";
    out.line("{};", *sig);
  }
  for (func::FuncOp fn : fns) {
    if (!fn.getBody().hasOneBlock())
      return fn.emitOpError() << "must have a single block to be emitted by abp codegen";
    out.line("{} {{", *signatureOf(fn));
    out.indent();
    ScalarEmitter scalars(out, "C");
    Block &block = fn.getBody().front();
    for (BlockArgument arg : block.getArguments())
      scalars.bind(arg, "a" + std::to_string(arg.getArgNumber()));
    for (Operation &op : block.without_terminator())
      if (failed(scalars.emit(&op)))
        return failure();
    auto ret = cast<func::ReturnOp>(block.getTerminator());
    out.line("return {};", scalars.name(ret.getOperand(0)));
    out.dedent();
    out.line("}}");
  }
  out.blank();
  return success();
}
