// IrText.cpp — textual checks that run before MLIR's parser: NUL characters, nesting depth.
#include "dialect/IrText.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Location.h"

using namespace mlir;

namespace abp {

LogicalResult checkIrText(llvm::SourceMgr &sourceMgr, MLIRContext *context) {
  const llvm::MemoryBuffer *buffer = sourceMgr.getMemoryBuffer(sourceMgr.getMainFileID());
  llvm::StringRef text = buffer->getBuffer();
  auto locationOf = [&](size_t i) -> Location {
    auto [line, column] = sourceMgr.getLineAndColumn(llvm::SMLoc::getFromPointer(text.data() + i));
    return FileLineColLoc::get(context, buffer->getBufferIdentifier(), line, column);
  };
  size_t nul = text.find('\0');
  if (nul != llvm::StringRef::npos)
    return emitError(locationOf(nul))
           << "a NUL character (U+0000) in the IR text: IR is text (binary data, or a file read in "
              "binary?)";
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
      if (++depth > kMaxIrNesting)
        return emitError(locationOf(i)) << "IR nested deeper than " << kMaxIrNesting
                              << " levels (regions, attribute dictionaries, arrays or "
                                 "parentheses); abp does not parse it";
    } else if ((c == '}' || c == ')' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return success();
}

} // namespace abp
