// IrText.h — refuses IR text the parser would misread: NUL characters, and nesting deeper than
// it can recurse.
#ifndef ABP_DIALECT_IRTEXT_H
#define ABP_DIALECT_IRTEXT_H

#include "mlir/IR/MLIRContext.h"
#include "mlir/Support/LogicalResult.h"
#include "llvm/Support/SourceMgr.h"

namespace abp {

/// The deepest nesting of regions, attribute dictionaries, arrays and parentheses accepted. Real
/// operators nest under ten levels; MLIR's recursive-descent parser needs stack per level, and a
/// few thousand levels overflow it inside the caller's process.
constexpr unsigned kMaxIrNesting = 256;

/// Scans the main buffer of `sourceMgr` and emits a located error through `context`'s diagnostic
/// handler at the first NUL character (MLIR's lexer skips it, or stops there: binary data, or
/// text cut short, would compile as what remains), or at the first bracket (outside string
/// literals and `//` comments) that opens level kMaxIrNesting + 1. Run it before parsing.
mlir::LogicalResult checkIrText(llvm::SourceMgr &sourceMgr, mlir::MLIRContext *context);

} // namespace abp

#endif // ABP_DIALECT_IRTEXT_H
