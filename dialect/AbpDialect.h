// AbpDialect.h — the public C++ header of the abp dialect (types, attributes, ops).
#ifndef ABP_DIALECT_ABPDIALECT_H
#define ABP_DIALECT_ABPDIALECT_H

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/SymbolTable.h"
#include "mlir/Interfaces/ControlFlowInterfaces.h"
#include "mlir/Interfaces/InferTypeOpInterface.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialect/AbpDialect.h.inc"

#include "dialect/AbpEnums.h.inc"

#define GET_TYPEDEF_CLASSES
#include "dialect/AbpTypes.h.inc"

#define GET_ATTRDEF_CLASSES
#include "dialect/AbpAttrs.h.inc"

#define GET_OP_CLASSES
#include "dialect/AbpOps.h.inc"

namespace abp {
/// The number of bits one element of a residual of type `type` occupies when saved, or
/// std::nullopt for values that are not per-element (f32 scalars).
std::optional<unsigned> savedBitsPerElement(mlir::Type type);

/// A module of abp IR holds only abp.operator, abp.kernel and func.func at its top level; the
/// first other op gets a located error naming `stage`. Checked before anything rewrites the
/// module (pass abp-verify-module) and again by the emitter.
mlir::LogicalResult verifyModuleContents(mlir::ModuleOp module, llvm::StringRef stage);
} // namespace abp

#endif // ABP_DIALECT_ABPDIALECT_H
