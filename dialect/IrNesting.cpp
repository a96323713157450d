// IrNesting.cpp — a textual depth check that runs before MLIR's recursive parser.
#include "dialect/IrNesting.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Location.h"

using namespace mlir;

namespace abp {

LogicalResult checkIrNesting(llvm::SourceMgr &sourceMgr, MLIRContext *context) {
  const llvm::MemoryBuffer *buffer = sourceMgr.getMemoryBuffer(sourceMgr.getMainFileID());
  llvm::StringRef text = buffer->getBuffer();
  unsigned depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '"') { // a string literal: brackets inside do not nest
      for (++i; i < text.size() && text[i] != '"'; ++i)
        if (text[i] == '\\')
          ++i;
      continue;
    }
    if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      i = text.find('\n', i);
      if (i == llvm::StringRef::npos)
        break;
      continue;
    }
    if (c == '{' || c == '(' || c == '[') {
      if (++depth > kMaxIrNesting) {
        auto [line, column] = sourceMgr.getLineAndColumn(llvm::SMLoc::getFromPointer(text.data() + i));
        Location loc = FileLineColLoc::get(context, buffer->getBufferIdentifier(), line, column);
        return emitError(loc) << "IR nested deeper than " << kMaxIrNesting
                              << " levels (regions, attribute dictionaries, arrays or "
                                 "parentheses); abp does not parse it";
      }
    } else if ((c == '}' || c == ')' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return success();
}

} // namespace abp
