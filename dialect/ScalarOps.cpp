// ScalarOps.cpp — the scalar operations abp compiles, and the checks that keep every other one out
// of map bodies and scalar functions at verification time (before a pass or the emitter sees it).
#include "dialect/ScalarOps.h"
#include "dialect/AbpDialect.h"

#include "llvm/ADT/STLExtras.h"

#include <string>

using namespace mlir;

// One list: the verifier accepts these, codegen/ScalarEmitter.cpp translates each of them, and
// tests/lit/codegen/scalar-ops.mlir compiles every one so that the two cannot drift apart.
static constexpr llvm::StringLiteral kCompiledScalarOps[] = {
    // arith: float arithmetic, compares and selects
    "arith.constant", "arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.remf",
    "arith.negf", "arith.maximumf", "arith.minimumf", "arith.maxnumf", "arith.minnumf",
    "arith.cmpf", "arith.select",
    // arith: integer arithmetic on codes
    "arith.addi", "arith.subi", "arith.muli", "arith.andi", "arith.ori", "arith.xori",
    "arith.cmpi", "arith.minui",
    // arith: casts
    "arith.extui", "arith.extsi", "arith.trunci", "arith.uitofp", "arith.sitofp", "arith.fptoui",
    "arith.fptosi",
    // math
    "math.absf", "math.ceil", "math.copysign", "math.cos", "math.erf", "math.exp", "math.exp2",
    "math.expm1", "math.floor", "math.log", "math.log1p", "math.log2", "math.powf",
    "math.round", "math.roundeven", "math.rsqrt", "math.sin", "math.sqrt", "math.tanh",
    "math.trunc",
    // calls of other scalar functions, and the terminators
    "func.call", "func.return", "abp.yield"};

llvm::ArrayRef<llvm::StringLiteral> abp::compiledScalarOpNames() { return kCompiledScalarOps; }

static bool isScalarType(Type type) {
  return type.isF32() || type.isInteger(1) || type.isInteger(8) || type.isInteger(16) ||
         type.isInteger(32) || type.isInteger(64);
}

static std::string supportedList() {
  std::string list;
  for (llvm::StringLiteral name : kCompiledScalarOps)
    list += (list.empty() ? "" : ", ") + name.str();
  return list;
}

LogicalResult abp::verifyScalarBlock(Block &block) {
  for (BlockArgument arg : block.getArguments())
    if (!isScalarType(arg.getType()))
      return emitError(arg.getLoc())
             << "scalar argument #" << arg.getArgNumber() << " has type " << arg.getType()
             << "; kernel scalars are f32, i1, i8, i16, i32 or i64";
  for (Operation &op : block) {
    if (!llvm::is_contained(kCompiledScalarOps, op.getName().getStringRef()))
      return op.emitOpError() << "is not a scalar operation abp compiles into kernels; "
                                 "supported (docs/dialect.md#scalar-operations): "
                              << supportedList();
    if (op.getNumRegions() != 0)
      return op.emitOpError() << "has a region, which a kernel's scalar code cannot hold";
    for (Type t : op.getResultTypes())
      if (!isScalarType(t))
        return op.emitOpError() << "produces " << t
                                << "; kernel scalars are f32, i1, i8, i16, i32 or i64";
  }
  return success();
}

LogicalResult abp::verifyScalarFunction(func::FuncOp fn) {
  if (fn.isExternal())
    return fn.emitOpError() << "is declared without a body; abp compiles only defined functions";
  if (!fn.getBody().hasOneBlock())
    return fn.emitOpError() << "has " << fn.getBody().getBlocks().size()
                            << " blocks; a kernel's scalar function is one block (use "
                               "arith.select for branches)";
  if (fn.getFunctionType().getNumResults() != 1)
    return fn.emitOpError() << "returns " << fn.getFunctionType().getNumResults()
                            << " values; a kernel's scalar function returns exactly one";
  if (!isScalarType(fn.getFunctionType().getResult(0)))
    return fn.emitOpError() << "returns " << fn.getFunctionType().getResult(0)
                            << "; kernel scalars are f32, i1, i8, i16, i32 or i64";
  return verifyScalarBlock(fn.getBody().front());
}
