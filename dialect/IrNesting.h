// IrNesting.h — refuses IR nested deeper than the parser can recurse.
#ifndef ABP_DIALECT_IRNESTING_H
#define ABP_DIALECT_IRNESTING_H

#include "mlir/IR/MLIRContext.h"
#include "mlir/Support/LogicalResult.h"
#include "llvm/Support/SourceMgr.h"

namespace abp {

/// The deepest nesting of regions, attribute dictionaries, arrays and parentheses accepted. Real
/// operators nest under ten levels; MLIR's recursive-descent parser needs stack per level, and a
/// few thousand levels overflow it inside the caller's process.
constexpr unsigned kMaxIrNesting = 256;

/// Scans the main buffer of `sourceMgr` (outside string literals and `//` comments) and emits a
/// located error through `context`'s diagnostic handler at the first bracket that opens level
/// kMaxIrNesting + 1. Run it before parsing.
mlir::LogicalResult checkIrNesting(llvm::SourceMgr &sourceMgr, mlir::MLIRContext *context);

} // namespace abp

#endif // ABP_DIALECT_IRNESTING_H
