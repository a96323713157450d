// AbpOps.cpp — verifiers and helpers of the abp ops.
#include "dialect/AbpDialect.h"
#include "dialect/ScalarOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/SetVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringSet.h"

#include <functional>

using namespace mlir;
using namespace abp;

//===----------------------------------------------------------------------===//
// OperatorOp's regions: `forward {...} backward {...}`
//===----------------------------------------------------------------------===//

/// The SSA name (`%x`, `%12`) that starts at `at`, or "" if none does.
static StringRef ssaNameAt(const char *at) {
  if (*at != '%')
    return "";
  const char *end = at + 1;
  while (llvm::isAlnum(*end) || llvm::is_contained(StringRef("_$.-"), *end))
    ++end;
  return StringRef(at, end - at);
}

/// Where (line, column) lies in the text that begins at `start`, which is at (startLine,
/// startColumn); nullptr if the text ends first.
static const char *pointerAt(const char *start, unsigned startLine, unsigned startColumn,
                             unsigned line, unsigned column) {
  const char *p = start;
  for (; startLine < line; ++p) {
    if (*p == '\0')
      return nullptr;
    if (*p == '\n') {
      ++startLine;
      startColumn = 1;
    }
  }
  for (; startColumn < column; ++p, ++startColumn)
    if (*p == '\0' || *p == '\n')
      return nullptr;
  return p;
}

/// The position of `%name` as a whole token in [begin, end), outside `//` comments, or nullptr.
static const char *findToken(const char *begin, const char *end, StringRef name) {
  StringRef all(begin, end - begin);
  for (size_t from = 0;; ++from) {
    size_t at = all.find(name, from);
    if (at == StringRef::npos)
      return nullptr;
    size_t lineStart = all.rfind('\n', at) + 1; // npos + 1 == 0: the first line
    if (ssaNameAt(begin + at) == name && !all.slice(lineStart, at).contains("//"))
      return begin + at;
    from = at;
  }
}

/// The two regions are separate scopes. A backward region that uses a value of the forward one
/// would get MLIR's bare "use of undeclared SSA value name", reported after the whole module is
/// parsed (a name unresolved in a region may still be defined further out). Here, right after
/// backward is parsed, such a use of a name the forward region defines is refused with the name
/// and how to make the value cross (save it).
static ParseResult parseDirections(OpAsmParser &parser, Region &forward, Region &backward) {
  if (parser.parseKeyword("forward"))
    return failure();
  llvm::SMLoc forwardBegin = parser.getCurrentLocation();
  if (parser.parseRegion(forward))
    return failure();
  llvm::SMLoc forwardEnd = parser.getCurrentLocation();
  if (parser.parseKeyword("backward") || parser.parseRegion(backward))
    return failure();
  auto anchor = dyn_cast<FileLineColLoc>(parser.getEncodedSourceLoc(forwardBegin));
  if (!anchor)
    return success();
  // The parser stands in for an unresolved name with a placeholder op outside any block,
  // located at the use.
  const char *use = nullptr, *def = nullptr;
  StringRef name;
  backward.walk([&](Operation *op) {
    for (Value operand : op->getOperands()) {
      Operation *placeholder = operand.getDefiningOp();
      if (!placeholder || placeholder->getBlock())
        continue;
      auto loc = dyn_cast<FileLineColLoc>(placeholder->getLoc());
      use = loc ? pointerAt(forwardBegin.getPointer(), anchor.getLine(), anchor.getColumn(),
                            loc.getLine(), loc.getColumn())
                : nullptr;
      name = use ? ssaNameAt(use) : "";
      def = name.empty() ? nullptr
                         : findToken(forwardBegin.getPointer(), forwardEnd.getPointer(), name);
      if (def)
        return WalkResult::interrupt();
    }
    return WalkResult::advance();
  });
  if (!def)
    return success(); // any other unresolved name is MLIR's to report
  InFlightDiagnostic diag = parser.emitError(llvm::SMLoc::getFromPointer(use))
                            << "'" << name
                            << "' is a value of the forward region, which backward cannot see: "
                               "only residuals cross. Save it (`abp.return ... saves "
                            << name
                            << " : <type>`) and take it as a backward block argument, before "
                               "the output gradients";
  diag.attachNote(parser.getEncodedSourceLoc(llvm::SMLoc::getFromPointer(def)))
      << "'" << name << "' in the forward region";
  return diag;
}

static void printDirections(OpAsmPrinter &printer, Operation *, Region &forward,
                            Region &backward) {
  printer << "forward ";
  printer.printRegion(forward);
  printer << " backward ";
  printer.printRegion(backward);
}

#define GET_OP_CLASSES
#include "dialect/AbpOps.cpp.inc"

//===----------------------------------------------------------------------===//
// OperatorOp
//===----------------------------------------------------------------------===//

ReturnOp OperatorOp::getForwardReturn() {
  return dyn_cast<ReturnOp>(getForward().front().getTerminator());
}

ReturnOp OperatorOp::getBackwardReturn() {
  return dyn_cast<ReturnOp>(getBackward().front().getTerminator());
}

SmallVector<BlockArgument> OperatorOp::getTensorInputs() {
  SmallVector<BlockArgument> inputs;
  for (BlockArgument arg : getForward().front().getArguments())
    if (isa<RankedTensorType>(arg.getType()))
      inputs.push_back(arg);
  return inputs;
}

SmallVector<BlockArgument> OperatorOp::getDifferentiableInputs() {
  SmallVector<BlockArgument> inputs;
  ArrayRef<int64_t> noGrad = getNoGrad() ? *getNoGrad() : ArrayRef<int64_t>();
  for (BlockArgument arg : getTensorInputs())
    if (!llvm::is_contained(noGrad, static_cast<int64_t>(arg.getArgNumber())))
      inputs.push_back(arg);
  return inputs;
}

/// Every value used inside `region` must be defined inside it: the two directions of an operator
/// only communicate through residuals. Reports the first offending use with a note at its
/// definition.
static LogicalResult verifyDirectionIsClosed(OperatorOp op, Region &region, StringRef direction) {
  WalkResult result = region.walk([&](Operation *user) {
    for (OpOperand &use : user->getOpOperands()) {
      Value value = use.get();
      Region *defRegion = value.getParentRegion();
      if (defRegion == &region || region.isAncestor(defRegion))
        continue;
      InFlightDiagnostic diag = user->emitOpError()
                                << "uses a value in " << direction << " that is neither ";
      if (direction == "backward")
        diag << "a residual nor a backward argument; save it in forward with `abp.return ... "
                "saves` and receive it as a backward block argument";
      else
        diag << "a forward argument nor defined in forward";
      if (Operation *def = value.getDefiningOp())
        diag.attachNote(def->getLoc()) << "value defined here";
      else
        diag.attachNote(cast<BlockArgument>(value).getOwner()->getParentOp()->getLoc())
            << "value is a block argument of another region";
      return WalkResult::interrupt();
    }
    return WalkResult::advance();
  });
  return failure(result.wasInterrupted());
}

/// An operator that shares a saved tensor (abp.share_saved) may save nothing else per element:
/// only per-row statistics (one rank less than its widest tensor input) and f32 parameters. So
/// its backward provably reads the shared output and those statistics, never the input.
static LogicalResult verifySharedResiduals(OperatorOp op) {
  ReturnOp ret = op.getForwardReturn();
  auto isShared = [](Value v) { return isa_and_nonnull<ShareSavedOp>(v.getDefiningOp()); };
  if (llvm::none_of(ret.getSaved(), isShared))
    return success();
  int64_t inputRank = 0;
  for (BlockArgument arg : op.getTensorInputs())
    inputRank = std::max(inputRank, cast<RankedTensorType>(arg.getType()).getRank());
  for (auto [i, saved] : llvm::enumerate(ret.getSaved())) {
    if (isShared(saved) || saved.getType().isF32())
      continue;
    auto tensor = dyn_cast<RankedTensorType>(saved.getType());
    if (tensor && tensor.getRank() == inputRank - 1)
      continue;
    InFlightDiagnostic diag = ret.emitOpError() << "shares a saved tensor, so residual #" << i
                                                << " must be a per-row statistic (a rank-"
                                                << inputRank - 1 << " tensor) or an f32 "
                                                << "parameter, got " << saved.getType();
    if (auto arg = dyn_cast<BlockArgument>(saved))
      diag << "; backward would read forward input #" << arg.getArgNumber()
           << ", which the shared output is meant to replace";
    else
      diag.attachNote(saved.getLoc()) << "the full-size residual is computed here";
    return diag;
  }
  return success();
}

/// A C / Python identifier: what parameter names become in the manifest and generated code.
static bool isIdentifier(StringRef name) {
  if (name.empty() || !(llvm::isAlpha(name.front()) || name.front() == '_'))
    return false;
  return llvm::all_of(name, [](char c) { return llvm::isAlnum(c) || c == '_'; });
}

LogicalResult abp::verifyModuleContents(ModuleOp module, StringRef stage) {
  for (Operation &op : module.getBody()->getOperations()) {
    if (!isa<OperatorOp, KernelOp, func::FuncOp>(op))
      return op.emitOpError() << "cannot be " << stage
                              << ": a module of abp IR holds only abp.operator, abp.kernel and "
                                 "func.func at its top level";
    // Each becomes a C++ function or kernel symbol (operators check their own name).
    StringRef name = cast<SymbolOpInterface>(op).getName();
    if (!isIdentifier(name))
      return op.emitOpError() << "name '" << name
                              << "' must be an identifier (a letter or '_', then letters, digits "
                                 "or '_'): it becomes a C++ function name";
    // The emitter defines every function, called or not.
    if (auto fn = dyn_cast<func::FuncOp>(op); fn && failed(verifyScalarFunction(fn)))
      return failure();
  }
  return success();
}

LogicalResult OperatorOp::verifyRegions() {
  // An attribute without a dialect prefix is one of the operator's own; any other such name is a
  // misspelling (`no_gard`, `parms`) that would otherwise be kept and ignored, its meaning lost.
  for (NamedAttribute attr : (*this)->getAttrs()) {
    StringRef name = attr.getName().getValue();
    if (name.contains('.') || llvm::is_contained(getAttributeNames(), attr.getName()) ||
        name == SymbolTable::getVisibilityAttrName())  // MLIR's own, on any symbol
      continue;
    return emitOpError() << "has no attribute '" << name
                         << "'; an operator takes 'params', 'no_grad' and 'variants' (other "
                            "attributes need a dialect prefix, as 'abp.saved_bits')";
  }
  // The name becomes kernel symbols (<name>_fwd) in generated C++ and keys in the manifest.
  if (!isIdentifier(getSymName()))
    return emitOpError() << "name '" << getSymName()
                         << "' must be an identifier (a letter or '_', then letters, digits or "
                            "'_'): it names the generated kernels";
  ReturnOp fwdReturn = getForwardReturn();
  ReturnOp bwdReturn = getBackwardReturn();
  if (!fwdReturn || !bwdReturn)
    return emitOpError() << "expects both regions to end in 'abp.return'";
  if (!bwdReturn.getSaved().empty())
    return bwdReturn.emitOpError() << "in backward cannot save residuals";

  for (BlockArgument arg : getForward().front().getArguments())
    if (!isa<RankedTensorType>(arg.getType()) && !arg.getType().isF32() &&
        !arg.getType().isInteger(64))
      return emitOpError() << "forward argument #" << arg.getArgNumber()
                           << " must be a ranked tensor, an f32 parameter or an i64 parameter "
                              "(a seed or offset), got "
                           << arg.getType();

  // Backward arguments: the residuals, then one gradient per forward output.
  Block &bwd = getBackward().front();
  size_t numSaved = fwdReturn.getSaved().size();
  size_t numOutputs = fwdReturn.getResults().size();
  if (bwd.getNumArguments() != numSaved + numOutputs)
    return emitOpError() << "expects backward to take " << numSaved << " residual(s) and "
                         << numOutputs << " output gradient(s) (" << numSaved + numOutputs
                         << " block arguments), got " << bwd.getNumArguments();
  for (auto [i, saved] : llvm::enumerate(fwdReturn.getSaved()))
    if (bwd.getArgument(i).getType() != saved.getType())
      return emitOpError() << "backward argument #" << i << " receives residual #" << i
                           << " of type " << saved.getType() << " but is declared as "
                           << bwd.getArgument(i).getType();
  for (auto [i, out] : llvm::enumerate(fwdReturn.getResults())) {
    Type gradType = bwd.getArgument(numSaved + i).getType();
    if (gradType != out.getType())
      return emitOpError() << "backward argument #" << numSaved + i
                           << " is the gradient of output #" << i << " and must have its type "
                           << out.getType() << ", got " << gradType;
  }

  // params names the scalar parameters (the manifest's keyword names): one valid, distinct
  // identifier per non-tensor forward argument. (ODS checks it is an array of strings.)
  if (std::optional<ArrayAttr> params = getParams()) {
    int64_t scalars = llvm::count_if(getForward().front().getArguments(), [](BlockArgument a) {
      return !isa<RankedTensorType>(a.getType());
    });
    if (static_cast<int64_t>(params->size()) != scalars)
      return emitOpError() << "params names " << params->size() << " parameter(s) but forward takes "
                           << scalars << " scalar argument(s); name each one, in order";
    llvm::StringSet<> seen;
    for (auto [i, attr] : llvm::enumerate(params->getAsValueRange<StringAttr>())) {
      if (!isIdentifier(attr))
        return emitOpError() << "params entry #" << i << " ('" << attr
                             << "') must be an identifier (a letter or '_', then letters, digits "
                                "or '_')";
      if (!seen.insert(attr).second)
        return emitOpError() << "params names '" << attr << "' twice";
    }
  }

  // no_grad names tensor inputs, each once.
  if (std::optional<ArrayRef<int64_t>> noGrad = getNoGrad()) {
    Block &fwd = getForward().front();
    for (auto [i, position] : llvm::enumerate(*noGrad)) {
      if (position < 0 || position >= static_cast<int64_t>(fwd.getNumArguments()) ||
          !isa<RankedTensorType>(fwd.getArgument(position).getType()))
        return emitOpError() << "no_grad entry #" << i << " (" << position
                             << ") must name a tensor argument of forward (it has "
                             << fwd.getNumArguments() << " argument(s))";
      if (llvm::count(*noGrad, position) > 1)
        return emitOpError() << "no_grad lists forward argument #" << position << " twice";
    }
  }
  // Integer tensors (row indices) are never differentiable.
  for (BlockArgument arg : getDifferentiableInputs())
    if (!cast<RankedTensorType>(arg.getType()).getElementType().isF32())
      return emitOpError() << "forward argument #" << arg.getArgNumber() << " of type "
                           << arg.getType()
                           << " has no gradient; list it in no_grad (row indices select rows, "
                              "they are not differentiated)";

  // Backward results: one gradient per differentiable tensor input, of the input's type.
  SmallVector<BlockArgument> inputs = getDifferentiableInputs();
  if (bwdReturn.getResults().size() != inputs.size())
    return bwdReturn.emitOpError() << "expects one gradient per tensor input not in no_grad ("
                                   << inputs.size() << "), got "
                                   << bwdReturn.getResults().size();
  for (auto [i, grad] : llvm::enumerate(bwdReturn.getResults()))
    if (grad.getType() != inputs[i].getType())
      return bwdReturn.emitOpError() << "gradient #" << i << " must have the type of forward "
                                     << "argument #" << inputs[i].getArgNumber() << " ("
                                     << inputs[i].getType() << "), got " << grad.getType();

  if (failed(verifyDirectionIsClosed(*this, getForward(), "forward")) ||
      failed(verifyDirectionIsClosed(*this, getBackward(), "backward")))
    return failure();
  if (failed(verifySharedResiduals(*this)))
    return failure();

  if (std::optional<DictionaryAttr> variants = getVariants()) {
    DictionaryAttr dict = *variants;
    for (NamedAttribute variant : dict)
      if (!isa<BucketsAttr>(variant.getValue()))
        return emitOpError() << "variant '" << variant.getName().strref()
                             << "' must be a #abp.buckets scheme, got " << variant.getValue();
  }
  return success();
}

//===----------------------------------------------------------------------===//
// ReturnOp
//===----------------------------------------------------------------------===//

LogicalResult ReturnOp::verify() {
  for (Value v : getResults())
    if (isa_and_nonnull<ReduceTensorOp>(v.getDefiningOp()))
      return emitOpError() << "returns a whole-tensor reduction (abp.reduce_tensor); an output "
                              "is a tensor: use the value in an abp.map, or save it";
  for (Value v : getSaved())
    if (!isa<RankedTensorType, CodesType>(v.getType()) && !v.getType().isF32())
      return emitOpError() << "can only save tensors, codes or f32 parameters, got "
                           << v.getType();
  return success();
}

//===----------------------------------------------------------------------===//
// MapOp
//===----------------------------------------------------------------------===//

/// The scalar type the body of an elementwise op sees for an input or result: a tensor's
/// element type (f32 for floats, the compute type; the integer type for codes), and a scalar
/// parameter as it is.
static Type scalarTypeOf(Type type) {
  if (auto tensor = dyn_cast<RankedTensorType>(type))
    return tensor.getElementType();
  return type;
}

LogicalResult MapOp::verify() {
  SmallVector<Type> types;
  for (Type t : getInputs().getTypes())
    if (isa<RankedTensorType>(t))
      types.push_back(t);
  if (types.empty())
    return emitOpError() << "expects at least one tensor input (scalar parameters are seen by "
                            "every element of the tensors)";
  if (getResults().empty())
    return emitOpError() << "expects at least one result";
  Type first = types.front();
  auto shape = cast<RankedTensorType>(first).getShape();
  auto sameShape = [&](Type t) { return cast<RankedTensorType>(t).getShape() == shape; };
  llvm::append_range(types, getResults().getTypes());
  for (Type t : types)
    if (!sameShape(t))
      return emitOpError() << "expects all tensor inputs and results to have the same shape, got "
                           << t << " and " << first;
  for (Type t : types) {
    Type elem = cast<RankedTensorType>(t).getElementType();
    if (!elem.isF32() && !elem.isInteger(8))
      return emitOpError() << "expects f32 tensors (values) or i8 tensors (codes), got " << t;
  }

  if (getBody().empty() != getCallee().has_value())
    return emitOpError() << "expects exactly one of a body region or a callee";
  return success(); // the callee's signature is checked in verifySymbolUses, a body below
}

/// The body is checked after the ops in it (and its terminator's presence): verify() runs
/// before the region is, and reading the terminator of an unterminated block there overflowed.
LogicalResult MapOp::verifyRegions() {
  if (getBody().empty())
    return success();
  Block &body = getBody().front();
  if (body.getNumArguments() != getInputs().size())
    return emitOpError() << "expects the body to take " << getInputs().size()
                         << " scalar argument(s), got " << body.getNumArguments();
  for (auto [i, arg] : llvm::enumerate(body.getArguments())) {
    Type expected = scalarTypeOf(getInputs()[i].getType());
    if (arg.getType() != expected)
      return emitOpError() << "body argument #" << i << " must be " << expected << ", got "
                           << arg.getType();
  }
  auto yield = dyn_cast<YieldOp>(body.getTerminator());
  if (!yield)
    return emitOpError() << "expects the body to end in 'abp.yield'";
  if (yield.getValues().size() != getResults().size())
    return yield.emitOpError() << "yields " << yield.getValues().size()
                               << " value(s) but the map has " << getResults().size()
                               << " result(s)";
  for (auto [i, v] : llvm::enumerate(yield.getValues())) {
    Type expected = scalarTypeOf(getResults()[i].getType());
    if (v.getType() != expected)
      return yield.emitOpError() << "value #" << i << " must be " << expected << ", got "
                                 << v.getType();
  }
  return verifyScalarBlock(body);
}

LogicalResult MapOp::verifySymbolUses(SymbolTableCollection &symbolTable) {
  std::optional<StringRef> callee = getCallee();
  if (!callee)
    return success();
  auto fn = symbolTable.lookupNearestSymbolFrom<func::FuncOp>(*this, getCalleeAttr());
  if (!fn)
    return emitOpError() << "references an undefined function @" << *callee;
  if (!isIdentifier(*callee))
    return emitOpError() << "calls @\"" << *callee
                         << "\", whose name is not an identifier: it becomes a C++ function name";
  FunctionType type = fn.getFunctionType();
  SmallVector<Type> ins, outs;
  for (Type t : getInputs().getTypes())
    ins.push_back(scalarTypeOf(t));
  for (Type t : getResults().getTypes())
    outs.push_back(scalarTypeOf(t));
  if (type.getInputs() != ArrayRef<Type>(ins) || type.getResults() != ArrayRef<Type>(outs))
    return emitOpError() << "expects @" << *callee << " to have the scalar signature "
                         << FunctionType::get(getContext(), ins, outs) << ", got " << type;
  // A kernel inlines its scalar functions' calls: a cycle would loop forever (on the GPU, with
  // no way to interrupt it), so the callee's call graph must be acyclic.
  SmallVector<func::FuncOp> path;
  llvm::SetVector<Operation *> done; // every function reachable from the callee, in visit order
  std::function<func::FuncOp(func::FuncOp)> findCycle = [&](func::FuncOp f) -> func::FuncOp {
    if (llvm::is_contained(path, f))
      return f;
    if (done.contains(f))
      return nullptr;
    path.push_back(f);
    func::FuncOp found;
    f.walk([&](func::CallOp call) {
      auto next = symbolTable.lookupNearestSymbolFrom<func::FuncOp>(call, call.getCalleeAttr());
      if (next && (found = findCycle(next)))
        return WalkResult::interrupt();
      return WalkResult::advance();
    });
    if (found)
      return found;
    path.pop_back();
    done.insert(f);
    return nullptr;
  };
  if (func::FuncOp start = findCycle(fn)) {
    std::string cycle;
    for (func::FuncOp f : llvm::make_range(llvm::find(path, start), path.end()))
      cycle += "@" + f.getSymName().str() + " -> ";
    InFlightDiagnostic diag = emitOpError()
                              << "calls @" << *callee << ", whose calls are recursive (" << cycle
                              << "@" << start.getSymName()
                              << "): a kernel cannot recurse; write the loop out";
    diag.attachNote(start.getLoc()) << "@" << start.getSymName() << " is defined here";
    return diag;
  }
  // What the kernel inlines must be scalar code abp compiles, checked now rather than by the
  // emitter after every pass has run.
  for (Operation *reached : done)
    if (failed(verifyScalarFunction(cast<func::FuncOp>(reached))))
      return failure();
  return success();
}

//===----------------------------------------------------------------------===//
// ReduceRowsOp / BroadcastRowsOp
//===----------------------------------------------------------------------===//

/// Whether `op` sits in the body of a row kernel (where row ops work on per-element scalars).
static bool inRowKernel(Operation *op) {
  auto kernel = op->getParentOfType<KernelOp>();
  return kernel && kernel.isRowKernel();
}

/// `matrix` is tensor<R x C x f32> and `vector` tensor<N x f32> with N the matrix's rows R (`dim`
/// 0: one value per row) or columns C (`dim` 1: one per column); sizes may be dynamic.
static LogicalResult verifyVectorShape(Operation *op, Type matrix, Type vector, unsigned dim) {
  const char *per = dim == 0 ? "row" : "column";
  auto m = dyn_cast<RankedTensorType>(matrix);
  auto v = dyn_cast<RankedTensorType>(vector);
  if (!m || !v || m.getRank() != 2 || v.getRank() != 1)
    return op->emitOpError() << "expects a row-wide tensor<?x?xf32> and a per-" << per
                             << " tensor<?xf32>, got " << matrix << " and " << vector;
  if (!ShapedType::isDynamic(m.getDimSize(dim)) && !ShapedType::isDynamic(v.getDimSize(0)) &&
      m.getDimSize(dim) != v.getDimSize(0))
    return op->emitOpError() << "expects one value per " << per << ": " << matrix << " has "
                             << m.getDimSize(dim) << (dim == 0 ? " rows" : " columns") << " but "
                             << vector << " has " << v.getDimSize(0);
  return success();
}

static LogicalResult verifyRowShapes(Operation *op, Type matrix, Type rows) {
  return verifyVectorShape(op, matrix, rows, 0);
}

LogicalResult ReduceRowsOp::verify() {
  Type in = getInput().getType(), out = getResult().getType();
  if (in.isF32() || out.isF32()) {
    if (!in.isF32() || !out.isF32())
      return emitOpError() << "in a row kernel maps f32 to f32, got " << in << " -> " << out;
    if (!inRowKernel(*this))
      return emitOpError() << "on f32 scalars is only valid in the body of a row kernel "
                              "(abp.kernel with `rows`); reduce a tensor<?x?xf32> instead";
    return success();
  }
  return verifyRowShapes(*this, in, out);
}

LogicalResult BroadcastRowsOp::verify() {
  return verifyRowShapes(*this, getResult().getType(), getInput().getType());
}

//===----------------------------------------------------------------------===//
// BroadcastColsOp / ReduceColsOp
//===----------------------------------------------------------------------===//

LogicalResult BroadcastColsOp::verify() {
  if (failed(verifyVectorShape(*this, getResult().getType(), getInput().getType(), 1)))
    return failure();
  for (Operation *user : getInput().getUsers())
    if (isa<BroadcastRowsOp, ReduceRowsOp>(user))
      return emitOpError() << "broadcasts a value that '" << user->getName()
                           << "' uses per row; a tensor<?xf32> is either one value per row or "
                              "one per column";
  return success();
}

LogicalResult ReduceColsOp::verify() {
  if (getKind() != ReduceKind::sum)
    return emitOpError() << "supports only `sum` (the gradient of a per-column input), got `"
                         << stringifyReduceKind(getKind()) << "`";
  if (failed(verifyVectorShape(*this, getInput().getType(), getResult().getType(), 1)))
    return failure();
  auto op = (*this)->getParentOfType<OperatorOp>();
  if (!op || (*this)->getParentRegion() != &op.getBackward())
    return emitOpError() << "must be in an operator's backward region: it sums a per-column "
                            "input's gradient over the rows";
  for (Operation *user : getResult().getUsers())
    if (!isa<ReturnOp>(user))
      return emitOpError() << "result may only be returned as a gradient by backward's "
                              "abp.return (the sum runs after the direction's kernel), but it is "
                              "used by "
                           << user->getName();
  return success();
}

//===----------------------------------------------------------------------===//
// ShareSavedOp
//===----------------------------------------------------------------------===//

LogicalResult ShareSavedOp::verify() {
  auto op = cast<OperatorOp>((*this)->getParentOp());
  if ((*this)->getParentRegion() != &op.getForward())
    return emitOpError() << "must be in the forward region: it names a forward output that "
                            "backward receives as a residual";
  ReturnOp ret = op.getForwardReturn();
  if (!ret)
    return success(); // the operator's verifier reports the missing terminator
  if (!llvm::is_contained(ret.getResults(), getInput()))
    return emitOpError() << "must share an output of the operator (a value returned by the "
                            "forward abp.return), so that the saved tensor is the identical "
                            "tensor its consumer keeps";
  for (OpOperand &use : getResult().getUses()) {
    auto user = dyn_cast<ReturnOp>(use.getOwner());
    bool savedOperand = user && use.getOperandNumber() >= user.getResults().size();
    if (!savedOperand)
      return emitOpError() << "result may only be saved by the forward abp.return, but it is "
                              "used by "
                           << use.getOwner()->getName();
  }
  return success();
}

//===----------------------------------------------------------------------===//
// QuantizeOp / DequantizeOp
//===----------------------------------------------------------------------===//

static LogicalResult verifySchemeWidth(Operation *op, BucketsAttr scheme, CodesType codes) {
  size_t levels = scheme.getLevels().size();
  if (levels != (size_t{1} << codes.getBits()))
    return op->emitOpError() << "expects 2^bits = " << (size_t{1} << codes.getBits())
                             << " levels for " << codes << ", but the scheme has " << levels;
  return success();
}

LogicalResult QuantizeOp::verify() {
  return verifySchemeWidth(*this, getScheme(), getResult().getType());
}

LogicalResult DequantizeOp::verify() {
  return verifySchemeWidth(*this, getScheme(), getCodes().getType());
}

//===----------------------------------------------------------------------===//
// UniformOp / QuantizeGroupsOp / DequantizeGroupsOp
//===----------------------------------------------------------------------===//

LogicalResult UniformOp::verify() {
  if (getBits() != 24 && getBits() != 16)
    return emitOpError() << "draws 24-bit or 16-bit uniforms, got bits = " << getBits();
  if (getResult().getType().isF32() && !(*this)->getParentOfType<KernelOp>())
    return emitOpError() << "yields an f32 draw only in a kernel body, where each element has "
                            "its index; in an operator it yields a tensor";
  return success();
}

/// The shared checks of abp.sample and abp.unsample: a matrix in, a matrix of as many columns
/// out, and one i32 (and f32 weight) per result row for sample, per result row for unsample.
static LogicalResult verifyRowPlacement(Operation *op, Type source, Type result, Type index,
                                        StringRef indexName) {
  auto in = cast<RankedTensorType>(source), out = cast<RankedTensorType>(result);
  auto idx = cast<RankedTensorType>(index);
  if (in.getRank() != 2 || out.getRank() != 2)
    return op->emitOpError() << "expects matrices (rank 2) in and out, got " << source
                             << " and " << result;
  if (idx.getRank() != 1)
    return op->emitOpError() << "expects " << indexName << " to hold one i32 per result row "
                             << "(rank 1), got " << index;
  if (!ShapedType::isDynamic(in.getDimSize(1)) && !ShapedType::isDynamic(out.getDimSize(1)) &&
      in.getDimSize(1) != out.getDimSize(1))
    return op->emitOpError() << "keeps whole rows, so the result must have the input's "
                             << in.getDimSize(1) << " columns, got " << out.getDimSize(1);
  if (!ShapedType::isDynamic(idx.getDimSize(0)) && !ShapedType::isDynamic(out.getDimSize(0)) &&
      idx.getDimSize(0) != out.getDimSize(0))
    return op->emitOpError() << "expects one " << indexName << " entry per result row: "
                             << result << " has " << out.getDimSize(0) << " rows but "
                             << index << " has " << idx.getDimSize(0);
  return success();
}

LogicalResult SampleOp::verify() {
  if (failed(verifyRowPlacement(*this, getInput().getType(), getResult().getType(),
                                getIndex().getType(), "index")))
    return failure();
  auto weight = cast<RankedTensorType>(getWeight().getType());
  auto index = cast<RankedTensorType>(getIndex().getType());
  if (weight.getRank() != 1 ||
      (!weight.isDynamicDim(0) && !index.isDynamicDim(0) &&
       weight.getDimSize(0) != index.getDimSize(0)))
    return emitOpError() << "expects one weight per index (" << getIndex().getType()
                         << "), got " << getWeight().getType();
  return success();
}

LogicalResult UnsampleOp::verify() {
  return verifyRowPlacement(*this, getKept().getType(), getResult().getType(),
                            getSlot().getType(), "slot");
}

LogicalResult QuantizeGroupsOp::verify() {
  if (failed(verifyRowShapes(*this, getInput().getType(), getMins().getType())) ||
      failed(verifyRowShapes(*this, getInput().getType(), getScales().getType())))
    return failure();
  return success();
}

LogicalResult DequantizeGroupsOp::verify() {
  if (failed(verifyRowShapes(*this, getResult().getType(), getMins().getType())) ||
      failed(verifyRowShapes(*this, getResult().getType(), getScales().getType())))
    return failure();
  return success();
}

//===----------------------------------------------------------------------===//
// KernelOp / LaunchOp
//===----------------------------------------------------------------------===//

/// The scalar type the kernel body sees for an argument layout (a scalar may also be i64).
static Type bodyTypeOf(Attribute layout, MLIRContext *ctx) {
  if (isa<PackedLayoutAttr>(layout))
    return IntegerType::get(ctx, 8);
  return Float32Type::get(ctx);
}

/// Whether a kernel body argument of type `type` fits layout `layout` (scalars may be i64
/// seeds/offsets, per-row inputs i32 row indices).
static bool bodyTypeFits(Type type, Attribute layout, MLIRContext *ctx) {
  return type == bodyTypeOf(layout, ctx) || (isa<ScalarLayoutAttr>(layout) && type.isInteger(64)) ||
         (isa<RowsLayoutAttr>(layout) && type.isInteger(32));
}

LogicalResult KernelOp::verifyRegions() {
  Block &body = getBody().front();
  for (Attribute layout : getIns())
    if (!isa<DenseLayoutAttr, PackedLayoutAttr, ScalarLayoutAttr, RowsLayoutAttr,
             ColsLayoutAttr, GatheredLayoutAttr, TotalLayoutAttr>(layout))
      return emitOpError() << "expects each of 'ins' to be #abp.dense, #abp.packed<b>, "
                              "#abp.scalar, #abp.rows, #abp.cols, #abp.gathered<i> or "
                              "#abp.total, got "
                           << layout;
  if (isTotalKernel()) {
    // One reduction of the body's per-element value: its only output is the total.
    if (isRowKernel())
      return emitOpError() << "cannot be both a total kernel (`total`) and a row kernel (`rows`)";
    if (getOuts().size() != 1 || !isa<TotalLayoutAttr>(getOuts()[0]))
      return emitOpError() << "is a total kernel and expects 'outs' = [#abp.total], got "
                           << getOuts();
  } else {
    for (Attribute layout : getOuts())
      if (!isa<DenseLayoutAttr, PackedLayoutAttr, RowsLayoutAttr>(layout))
        return emitOpError() << "expects each of 'outs' to be #abp.dense, #abp.packed<b> or "
                                "#abp.rows, got "
                             << layout
                             << (isa<TotalLayoutAttr>(layout) ? " (only a total kernel, with "
                                                                "`total = <kind>`, writes one)"
                                                              : "");
  }
  for (Attribute layout : llvm::concat<const Attribute>(getIns(), getOuts())) {
    if (isa<RowsLayoutAttr>(layout) && !isRowKernel())
      return emitOpError() << "has a #abp.rows argument but is not a row kernel (`rows`)";
    if (isa<ColsLayoutAttr>(layout) && !isRowKernel())
      return emitOpError() << "has a #abp.cols argument but is not a row kernel (`rows`)";
  }
  for (auto [i, layout] : llvm::enumerate(getIns())) {
    auto gathered = dyn_cast<GatheredLayoutAttr>(layout);
    if (!gathered)
      continue;
    if (!isRowKernel())
      return emitOpError() << "has a #abp.gathered argument but is not a row kernel (`rows`)";
    unsigned by = gathered.getBy();
    if (by >= body.getNumArguments() || !isa<RowsLayoutAttr>(getIns()[by]) ||
        !body.getArgument(by).getType().isInteger(32))
      return emitOpError() << "gathers argument #" << i << " by argument #" << by
                           << ", which must be an #abp.rows input the body sees as i32 "
                              "(one row index per row)";
  }
  if (getWarpMaxCols() && !isRowKernel())
    return emitOpError() << "sets warp_max_cols but is not a row kernel (`rows`)";
  if (body.getNumArguments() != getIns().size())
    return emitOpError() << "expects " << getIns().size() << " body argument(s) (one per 'ins'), got "
                         << body.getNumArguments();
  for (auto [i, arg] : llvm::enumerate(body.getArguments()))
    if (!bodyTypeFits(arg.getType(), getIns()[i], getContext()))
      return emitOpError() << "body argument #" << i << " must be "
                           << bodyTypeOf(getIns()[i], getContext())
                           << (isa<ScalarLayoutAttr>(getIns()[i])  ? " or i64"
                               : isa<RowsLayoutAttr>(getIns()[i]) ? " or i32"
                                                                   : "")
                           << " for layout " << getIns()[i] << ", got " << arg.getType();
  auto yield = dyn_cast<YieldOp>(body.getTerminator());
  if (!yield || yield.getValues().size() != getOuts().size())
    return emitOpError() << "expects the body to yield one value per 'outs' ("
                         << getOuts().size() << ")";
  for (auto [i, v] : llvm::enumerate(yield.getValues()))
    if (v.getType() != bodyTypeOf(getOuts()[i], getContext()))
      return yield.emitOpError() << "value #" << i << " must be "
                                 << bodyTypeOf(getOuts()[i], getContext()) << " for layout "
                                 << getOuts()[i] << ", got " << v.getType();
  if (std::optional<int64_t> chunk = getChunk(); chunk && *chunk <= 0)
    return emitOpError() << "expects a positive chunk, got " << *chunk;
  if (std::optional<int64_t> block = getBlockSize(); block && (*block <= 0 || *block > 1024))
    return emitOpError() << "expects block_size in [1, 1024], got " << *block;
  return success();
}

/// Whether a launch operand or result of type `type` matches a kernel argument `layout`.
static bool matchesLayout(Type type, Attribute layout) {
  if (auto packed = dyn_cast<PackedLayoutAttr>(layout)) {
    auto codes = dyn_cast<CodesType>(type);
    return codes && codes.getBits() == packed.getBits();
  }
  if (isa<ScalarLayoutAttr>(layout))
    return type.isF32() || type.isInteger(64);
  if (isa<TotalLayoutAttr>(layout))
    return type.isF32();
  auto tensor = dyn_cast<RankedTensorType>(type);
  if (isa<RowsLayoutAttr>(layout))
    return tensor && tensor.getRank() == 1 &&
           (tensor.getElementType().isF32() || tensor.getElementType().isInteger(32));
  if (isa<ColsLayoutAttr>(layout))
    return tensor && tensor.getRank() == 1 && tensor.getElementType().isF32();
  return tensor && tensor.getElementType().isF32();
}

LogicalResult LaunchOp::verifySymbolUses(SymbolTableCollection &symbolTable) {
  auto kernel = symbolTable.lookupNearestSymbolFrom<KernelOp>(*this, getKernelAttr());
  if (!kernel)
    return emitOpError() << "references an undefined kernel @" << getKernel();
  if (getArgs().size() != kernel.getIns().size() || getResults().size() != kernel.getOuts().size())
    return emitOpError() << "passes " << getArgs().size() << " argument(s) and expects "
                         << getResults().size() << " result(s), but @" << getKernel() << " has "
                         << kernel.getIns().size() << " and " << kernel.getOuts().size();
  for (auto [i, arg] : llvm::enumerate(getArgs()))
    if (!matchesLayout(arg.getType(), kernel.getIns()[i]))
      return emitOpError() << "argument #" << i << " of type " << arg.getType()
                           << " does not match layout " << kernel.getIns()[i];
  for (auto [i, res] : llvm::enumerate(getResults()))
    if (!matchesLayout(res.getType(), kernel.getOuts()[i]))
      return emitOpError() << "result #" << i << " of type " << res.getType()
                           << " does not match layout " << kernel.getOuts()[i];
  return success();
}
