// ScalarOps.h — the scalar operations abp compiles into kernels, checked when IR is verified.
#ifndef ABP_DIALECT_SCALAROPS_H
#define ABP_DIALECT_SCALAROPS_H

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Block.h"
#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"

namespace abp {
/// The names of every scalar operation that may appear in an `abp.map` body or in a `func.func`
/// a map calls: exactly the set codegen translates (codegen/ScalarEmitter.cpp), listed in
/// docs/dialect.md, and proven by tests/lit/codegen/scalar-ops.mlir to translate.
llvm::ArrayRef<llvm::StringLiteral> compiledScalarOpNames();

/// Checks a map body or a scalar function's block: every op is a compiled scalar operation and
/// every value it defines is f32, i1 or i8..i64 (a call's callee is checked as a function). The
/// first violation gets a located error that names the op and lists what is supported.
mlir::LogicalResult verifyScalarBlock(mlir::Block &block);

/// Checks a `func.func` that kernels call or that the emitter will define: a body of one block
/// (verifyScalarBlock), scalar arguments and exactly one scalar result.
mlir::LogicalResult verifyScalarFunction(mlir::func::FuncOp fn);
} // namespace abp

#endif
