// FuseKernels.cpp — merges each direction's ops into one abp.kernel (elementwise or row) + abp.launch,
// after one total kernel per whole-tensor reduction (abp.reduce_tensor).
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/SetVector.h"

#include <algorithm>

namespace abp {
#define GEN_PASS_DEF_ABPFUSEKERNELS
#include "passes/Passes.h.inc"
} // namespace abp

using namespace mlir;
using namespace abp;

namespace {
bool isRowOp(Operation *op) {
  return isa<ReduceRowsOp, BroadcastRowsOp, BroadcastColsOp, SampleOp, UnsampleOp>(op);
}

/// Whether `value` is read one value per column (abp.broadcast_cols's operand): #abp.cols.
bool isPerColumn(Value value) {
  return llvm::any_of(value.getUsers(), [](Operation *user) { return isa<BroadcastColsOp>(user); });
}

/// The matrix abp.sample / abp.unsample reads at gathered rows, and the row indices it reads
/// them by; null for other ops.
std::pair<Value, Value> gatherOf(Operation *op) {
  if (auto sample = dyn_cast<SampleOp>(op))
    return {sample.getInput(), sample.getIndex()};
  if (auto unsample = dyn_cast<UnsampleOp>(op))
    return {unsample.getKept(), unsample.getSlot()};
  return {};
}
/// How many operations a kernel body may grow to by inlining. Calls beyond it stay calls (codegen
/// emits their callees as device functions): a chain of functions that each call the previous
/// twice would otherwise grow exponentially.
constexpr size_t kInlineBudget = 4096;

/// Replaces every func.call in `kernel` by the body of its callee, until none is left or the
/// budget is spent (the verifier refuses recursion and bodiless callees, so this ends). A
/// kernel's code so depends on its maths only, not on how the author split them into functions:
/// a map over @f, a map whose body calls @f and a map over f's body give the same kernel, and the
/// emitted source needs no helper functions.
void inlineCalls(KernelOp kernel) {
  SmallVector<func::CallOp> calls;
  size_t size = 0;
  kernel.walk([&](Operation *op) {
    ++size;
    if (auto call = dyn_cast<func::CallOp>(op))
      calls.push_back(call);
  });
  // In program order, so that under the budget the first calls are the inlined ones.
  std::reverse(calls.begin(), calls.end());
  while (!calls.empty()) {
    func::CallOp call = calls.pop_back_val();
    auto fn = SymbolTable::lookupNearestSymbolFrom<func::FuncOp>(call, call.getCalleeAttr());
    assert(fn && fn.getBody().hasOneBlock() && "the verifier resolves every callee");
    Block &entry = fn.getBody().front();
    size_t added = entry.getOperations().size() - 1; // its ops, less the return
    if (size + added > kInlineBudget)
      continue;
    size += added;
    IRMapping local;
    for (auto [param, arg] : llvm::zip(entry.getArguments(), call.getOperands()))
      local.map(param, arg);
    OpBuilder builder(call);
    SmallVector<func::CallOp> nested;
    for (Operation &inner : entry.without_terminator())
      if (auto copy = dyn_cast<func::CallOp>(builder.clone(inner, local)))
        nested.push_back(copy);
    calls.append(nested.rbegin(), nested.rend());
    for (auto [res, val] :
         llvm::zip(call.getResults(), cast<func::ReturnOp>(entry.getTerminator()).getOperands()))
      res.replaceAllUsesWith(local.lookup(val));
    call.erase();
  }
}

bool isFusable(Operation *op) {
  return isa<MapOp, PackOp, UnpackOp, UniformOp>(op) || isRowOp(op);
}

/// Whether `value` is a whole-tensor reduction's result: a total kernel's launch result, or
/// the backward argument holding one that forward saved (forward is fused first).
bool isTotal(Value value, OperatorOp op) {
  if (!value.getType().isF32())
    return false;
  if (value.getDefiningOp<LaunchOp>())
    return true; // only total kernels produce an f32
  auto arg = dyn_cast<BlockArgument>(value);
  if (!arg || arg.getOwner() != &op.getBackward().front())
    return false;
  ReturnOp ret = op.getForwardReturn();
  return arg.getArgNumber() < ret.getSaved().size() &&
         isTotal(ret.getSaved()[arg.getArgNumber()], op);
}

/// What the fused kernel reads or writes: a dense tensor, packed codes, a captured f32 or i64
/// parameter, a whole-tensor reduction's result, or (row kernels) one value per row.
Attribute layoutOf(Value value, bool rowKernel, OperatorOp op) {
  MLIRContext *ctx = op.getContext();
  if (auto codes = dyn_cast<CodesType>(value.getType()))
    return PackedLayoutAttr::get(ctx, codes.getBits());
  if (isTotal(value, op))
    return TotalLayoutAttr::get(ctx);
  if (value.getType().isF32() || value.getType().isInteger(64))
    return ScalarLayoutAttr::get(ctx);
  if (rowKernel && cast<RankedTensorType>(value.getType()).getRank() == 1)
    // One value per column (a per-feature vector), or per row: f32, or i32 row indices.
    return isPerColumn(value) ? Attribute(ColsLayoutAttr::get(ctx)) : Attribute(RowsLayoutAttr::get(ctx));
  return DenseLayoutAttr::get(ctx);
}

/// External values a kernel made of `fused` reads, in first-use order: operands of fused ops not
/// produced by them, and parameters captured by map bodies.
llvm::SetVector<Value> externalInputs(ArrayRef<Operation *> fused) {
  llvm::SmallPtrSet<Operation *, 16> inSet(fused.begin(), fused.end());
  llvm::SetVector<Value> inputs;
  for (Operation *inner : fused) {
    for (Value operand : inner->getOperands())
      if (!inSet.contains(operand.getDefiningOp()))
        inputs.insert(operand);
    if (auto map = dyn_cast<MapOp>(inner))
      map.getBody().walk([&](Operation *bodyOp) {
        for (Value operand : bodyOp->getOperands()) {
          Operation *def = operand.getDefiningOp();
          if (!map.getBody().isAncestor(operand.getParentRegion()) &&
              !(def && def->hasTrait<OpTrait::ConstantLike>()))
            inputs.insert(operand);
        }
      });
  }
  return inputs;
}

/// The scalar type a kernel body sees for an external value.
Type bodyArgType(Value in, bool rowIndex, MLIRContext *ctx) {
  return isa<CodesType>(in.getType()) ? Type(IntegerType::get(ctx, 8))
         : in.getType().isInteger(64) ? in.getType()
         : rowIndex                   ? Type(IntegerType::get(ctx, 32))
                                      : Type(Float32Type::get(ctx));
}

/// Translates the fused ops into the kernel body at `body`'s insertion point: every tensor,
/// code or parameter value gets its per-element scalar in `scalars`.
void translateOps(ArrayRef<Operation *> fused, OpBuilder &body, IRMapping &scalars) {
  MLIRContext *ctx = body.getContext();
  for (Operation *inner : fused) {
    if (auto pack = dyn_cast<PackOp>(inner)) {
      scalars.map(pack.getResult(), scalars.lookup(pack.getInput()));
    } else if (auto unpack = dyn_cast<UnpackOp>(inner)) {
      scalars.map(unpack.getResult(), scalars.lookup(unpack.getCodes()));
    } else if (auto sample = dyn_cast<SampleOp>(inner)) {
      // The row is gathered as it is read (#abp.gathered); each element is scaled by its
      // row's weight.
      auto scaled = body.create<arith::MulFOp>(sample.getLoc(), scalars.lookup(sample.getInput()),
                                               scalars.lookup(sample.getWeight()));
      scalars.map(sample.getResult(), scaled.getResult());
    } else if (auto unsample = dyn_cast<UnsampleOp>(inner)) {
      // The gathered read already yields zeros for rows the plan did not keep.
      scalars.map(unsample.getResult(), scalars.lookup(unsample.getKept()));
    } else if (auto broadcast = dyn_cast<BroadcastRowsOp>(inner)) {
      // Every element of a row sees its row's value: nothing to compute.
      scalars.map(broadcast.getResult(), scalars.lookup(broadcast.getInput()));
    } else if (auto broadcast = dyn_cast<BroadcastColsOp>(inner)) {
      // Every element reads its column's value (#abp.cols): nothing to compute.
      scalars.map(broadcast.getResult(), scalars.lookup(broadcast.getInput()));
    } else if (auto uniform = dyn_cast<UniformOp>(inner)) {
      auto draw = body.create<UniformOp>(uniform.getLoc(), Float32Type::get(ctx),
                                         scalars.lookup(uniform.getSeed()),
                                         scalars.lookup(uniform.getOffset()), uniform.getBits());
      scalars.map(uniform.getResult(), draw.getResult());
    } else if (auto reduce = dyn_cast<ReduceRowsOp>(inner)) {
      auto f32 = Float32Type::get(ctx);
      auto rowValue = body.create<ReduceRowsOp>(reduce.getLoc(), f32, reduce.getKindAttr(),
                                                scalars.lookup(reduce.getInput()));
      scalars.map(reduce.getResult(), rowValue.getResult());
    } else {
      auto map = cast<MapOp>(inner);
      SmallVector<Value> args;
      for (Value in : map.getInputs())
        args.push_back(scalars.lookup(in));
      if (std::optional<StringRef> callee = map.getCallee()) {
        SmallVector<Type> resultTypes;
        for (Type t : map.getResultTypes())
          resultTypes.push_back(cast<RankedTensorType>(t).getElementType());
        auto call = body.create<func::CallOp>(map.getLoc(), *callee, resultTypes, args);
        for (auto [res, val] : llvm::zip(map.getResults(), call.getResults()))
          scalars.map(res, val);
        continue;
      }
      Block &mapBody = map.getBody().front();
      IRMapping local = scalars; // captured parameters resolve through the outer mapping
      for (auto [barg, val] : llvm::zip(mapBody.getArguments(), args))
        local.map(barg, val);
      for (Operation &bodyOp : mapBody.without_terminator())
        body.clone(bodyOp, local);
      auto yield = cast<YieldOp>(mapBody.getTerminator());
      for (auto [res, val] : llvm::zip(map.getResults(), yield.getValues()))
        scalars.map(res, local.lookup(val));
    }
  }
}

/// Creates kernel `name` (before `op`) over `inputs` with `ins` layouts, whose body computes
/// `fused` and yields the scalars of `yielded`. Constants of the direction's block are
/// re-materialized in it; calls are inlined.
KernelOp buildKernel(OperatorOp op, Block &block, ArrayRef<Operation *> fused,
                     const llvm::SetVector<Value> &inputs, ArrayRef<Attribute> ins,
                     ArrayRef<Attribute> outs, ArrayRef<Value> yielded, StringRef name,
                     bool rowKernel, ReduceKindAttr total) {
  MLIRContext *ctx = op.getContext();
  SmallVector<Type> argTypes;
  SmallVector<Location> argLocs;
  for (auto [in, layout] : llvm::zip(inputs, ins)) {
    bool rowIndex = isa<RowsLayoutAttr>(layout) && cast<RankedTensorType>(in.getType())
                                                       .getElementType()
                                                       .isInteger(32);
    argTypes.push_back(bodyArgType(in, rowIndex, ctx));
    argLocs.push_back(in.getLoc());
  }
  OpBuilder moduleBuilder(op);
  auto kernel = moduleBuilder.create<KernelOp>(
      op.getLoc(), name, moduleBuilder.getArrayAttr(ins), moduleBuilder.getArrayAttr(outs),
      IntegerAttr(), IntegerAttr(), /*rows=*/rowKernel, IntegerAttr(), total);
  OpBuilder body(ctx);
  Block *entry = body.createBlock(&kernel.getBody(), {}, argTypes, argLocs);
  IRMapping scalars; // tensor/codes/param value -> its per-element scalar in the kernel
  for (auto [in, arg] : llvm::zip(inputs, entry->getArguments()))
    scalars.map(in, arg);
  for (Operation &inner : block.without_terminator())
    if (inner.hasTrait<OpTrait::ConstantLike>())
      body.clone(inner, scalars);
  translateOps(fused, body, scalars);
  SmallVector<Value> values;
  for (Value out : yielded)
    values.push_back(scalars.lookup(out));
  body.create<YieldOp>(op.getLoc(), values);
  inlineCalls(kernel);
  return kernel;
}

/// Gives every abp.reduce_tensor of the direction its own total kernel (`<name>_total<i>`),
/// launched where the reduction was: the kernel recomputes the elementwise ops its operand
/// depends on and reduces that value over every element. The ops only it needed are erased;
/// the direction's kernel reads the result as #abp.total.
LogicalResult fuseTotals(OperatorOp op, Region &region, StringRef name) {
  MLIRContext *ctx = op.getContext();
  Block &block = region.front();
  SmallVector<ReduceTensorOp> reductions(block.getOps<ReduceTensorOp>());
  int64_t inputRank = 0;
  for (BlockArgument arg : op.getTensorInputs())
    inputRank = std::max(inputRank, cast<RankedTensorType>(arg.getType()).getRank());
  // The same reduction of the same value twice (min_all(x) written twice) runs once.
  llvm::DenseMap<std::pair<Value, unsigned>, Value> done;
  unsigned launched = 0;
  bool deduplicated = false;
  for (ReduceTensorOp reduce : reductions) {
    auto key = std::make_pair(reduce.getInput(), static_cast<unsigned>(reduce.getKind()));
    if (Value result = done.lookup(key)) {
      reduce.getResult().replaceAllUsesWith(result);
      reduce.erase();
      deduplicated = true;
      continue;
    }
    if (cast<RankedTensorType>(reduce.getInput().getType()).getRank() < inputRank)
      return reduce.emitOpError()
             << "reduces a per-row value (rank below the operator's inputs'); a whole-tensor "
                "reduction runs over every element of the operator's tensors";
    // The ops the reduced value depends on within the direction, in block order.
    llvm::SmallPtrSet<Operation *, 16> needed;
    SmallVector<Value> work{reduce.getInput()};
    while (!work.empty()) {
      Operation *def = work.pop_back_val().getDefiningOp();
      if (!def || def->getBlock() != &block || def->hasTrait<OpTrait::ConstantLike>() ||
          isa<LaunchOp>(def) || !needed.insert(def).second)
        continue;
      if (isRowOp(def) || !isFusable(def))
        return reduce.emitOpError()
               << "reduces a value computed by '" << def->getName()
               << "'; a whole-tensor reduction recomputes its operand element by element, from "
                  "abp.map, abp.unpack, abp.pack and abp.uniform (reduce along rows first "
                  "in another operator)";
      llvm::append_range(work, def->getOperands());
      if (auto map = dyn_cast<MapOp>(def))
        map.getBody().walk([&](Operation *bodyOp) {
          for (Value operand : bodyOp->getOperands())
            if (!map.getBody().isAncestor(operand.getParentRegion()))
              work.push_back(operand);
        });
    }
    SmallVector<Operation *> slice;
    for (Operation &inner : block.without_terminator())
      if (needed.contains(&inner))
        slice.push_back(&inner);
    llvm::SetVector<Value> inputs = externalInputs(slice);
    if (slice.empty())
      inputs.insert(reduce.getInput()); // the reduced tensor is itself an input
    SmallVector<Attribute> ins;
    for (Value in : inputs) {
      auto tensor = dyn_cast<RankedTensorType>(in.getType());
      if (tensor && !tensor.getElementType().isF32())
        return emitError(in.getLoc()) << "an i8 code tensor enters a kernel unpacked; "
                                         "store codes with abp.pack";
      ins.push_back(layoutOf(in, /*rowKernel=*/false, op));
    }
    std::string kernelName = (name + "_total" + llvm::Twine(launched++)).str();
    buildKernel(op, block, slice, inputs, ins, {TotalLayoutAttr::get(ctx)},
                {reduce.getInput()}, kernelName, /*rowKernel=*/false, reduce.getKindAttr());
    OpBuilder launchBuilder(reduce);
    auto launch = launchBuilder.create<LaunchOp>(reduce.getLoc(), TypeRange{reduce.getType()},
                                                 FlatSymbolRefAttr::get(ctx, kernelName),
                                                 inputs.getArrayRef());
    reduce.getResult().replaceAllUsesWith(launch.getResult(0));
    done[key] = launch.getResult(0);
    reduce.erase();
    for (Operation *inner : llvm::reverse(slice))
      if (inner->use_empty())
        inner->erase();
  }
  // A reduction that ran once for two may leave the second's operand unused.
  if (deduplicated)
    for (Operation &inner : llvm::make_early_inc_range(llvm::reverse(block.without_terminator())))
      if (inner.use_empty() && (isFusable(&inner) || inner.hasTrait<OpTrait::ConstantLike>()))
        inner.erase();
  return success();
}

/// Fuses the elementwise ops of one direction of `op` into kernel `name` (after its
/// whole-tensor reductions got their own kernels). Returns failure after emitting a
/// diagnostic when the direction cannot be fused.
LogicalResult fuseDirection(OperatorOp op, Region &region, StringRef name) {
  if (failed(fuseTotals(op, region, name)))
    return failure();
  Block &block = region.front();
  // Column sums run after the kernel, which writes their operands (the verifier lets only the
  // terminator use their results): they move next to it.
  SmallVector<ReduceColsOp> colSums(block.getOps<ReduceColsOp>());
  for (ReduceColsOp sum : colSums)
    sum->moveBefore(block.getTerminator());
  SmallVector<Operation *> fused;
  for (Operation &inner : block.without_terminator()) {
    // Constants hoisted out of map bodies by canonicalization are re-materialized in the kernel;
    // a shared residual stays an alias of the kernel's output; total kernels are launched;
    // column sums follow the launch.
    if (inner.hasTrait<OpTrait::ConstantLike>() || isa<ShareSavedOp, LaunchOp, ReduceColsOp>(inner))
      continue;
    if (!isFusable(&inner))
      return inner.emitOpError() << "cannot be fused into a kernel; only abp.map, abp.pack, "
                                    "abp.unpack, abp.uniform, abp.reduce_rows, "
                                    "abp.reduce_tensor, abp.broadcast_rows, "
                                    "abp.broadcast_cols, abp.reduce_cols, abp.sample and "
                                    "abp.unsample may remain after lowering";
    fused.push_back(&inner);
  }
  if (fused.empty())
    return success();
  llvm::SmallPtrSet<Operation *, 16> inSet(fused.begin(), fused.end());
  // Any reduction or broadcast along rows makes this a row kernel: one row at a time.
  const bool rowKernel = llvm::any_of(fused, isRowOp);

  llvm::SetVector<Value> inputs = externalInputs(fused);
  // Values leaving the direction: results of fused ops with a use outside them.
  llvm::SetVector<Value> outputs;
  for (Operation *inner : fused)
    for (Value result : inner->getResults())
      for (Operation *user : result.getUsers())
        if (!inSet.contains(user))
          outputs.insert(result);

  // Matrices read at gathered rows (abp.sample / abp.unsample): the kernel's rows are the
  // index's, so such a matrix is read only through its index, and must come from outside.
  llvm::DenseMap<Value, Value> gatheredBy; // matrix -> its row-index value
  for (Operation *inner : fused) {
    auto [matrix, index] = gatherOf(inner);
    if (!matrix)
      continue;
    if (!inputs.contains(matrix))
      return inner->emitOpError() << "gathers rows of a value computed in the same kernel; "
                                     "gather a kernel input (an operator argument or residual)";
    for (Operation *user : matrix.getUsers())
      if (inSet.contains(user) && gatherOf(user) != std::make_pair(matrix, index))
        return inner->emitOpError()
               << "gathers rows of a matrix that the kernel also reads otherwise; a kernel "
                  "reads each matrix either row by row or through one index";
    gatheredBy[matrix] = index;
  }

  // A per-column vector is read at each element's column: it must come from outside (an operator
  // argument or residual), and the kernel may only broadcast it (any other use would take it
  // for one value per row).
  for (Operation *inner : fused) {
    auto broadcast = dyn_cast<BroadcastColsOp>(inner);
    if (!broadcast)
      continue;
    Value vector = broadcast.getInput();
    if (!inputs.contains(vector))
      return broadcast.emitOpError()
             << "broadcasts a per-column value computed in the same kernel; broadcast an "
                "operator argument or residual, and compute on its row-wide broadcast";
    for (Operation *user : vector.getUsers())
      if (inSet.contains(user) && !isa<BroadcastColsOp>(user))
        return user->emitOpError()
               << "uses a per-column vector (an abp.broadcast_cols operand) directly; use its "
                  "row-wide broadcast";
  }

  SmallVector<Attribute> ins, outs;
  for (Value in : inputs) {
    auto tensor = dyn_cast<RankedTensorType>(in.getType());
    bool rowIndex = tensor && rowKernel && tensor.getRank() == 1 &&
                    tensor.getElementType().isInteger(32);
    if (tensor && !tensor.getElementType().isF32() && !rowIndex)
      return emitError(in.getLoc()) << "an i8 code tensor enters a kernel unpacked; "
                                       "store codes with abp.pack";
    if (Value index = gatheredBy.lookup(in))
      ins.push_back(GatheredLayoutAttr::get(
          op.getContext(),
          static_cast<unsigned>(std::distance(inputs.begin(), llvm::find(inputs, index)))));
    else
      ins.push_back(layoutOf(in, rowKernel, op));
  }
  for (Value out : outputs) {
    auto tensor = dyn_cast<RankedTensorType>(out.getType());
    if (tensor && !tensor.getElementType().isF32())
      return out.getDefiningOp()->emitOpError()
             << "produces an i8 code tensor that leaves the kernel unpacked; store codes with "
                "abp.pack";
    outs.push_back(layoutOf(out, rowKernel, op));
  }

  buildKernel(op, block, fused, inputs, ins, outs, outputs.getArrayRef(), name, rowKernel,
              ReduceKindAttr());

  // One launch replaces the fused ops, right after the last of them (a shared residual that
  // aliases an output follows it); every remaining user is the terminator or a share_saved.
  OpBuilder launchBuilder(op.getContext());
  launchBuilder.setInsertionPointAfter(fused.back());
  SmallVector<Type> resultTypes;
  for (Value out : outputs)
    resultTypes.push_back(out.getType());
  auto launch = launchBuilder.create<LaunchOp>(fused.back()->getLoc(), resultTypes,
                                               FlatSymbolRefAttr::get(op.getContext(), name),
                                               inputs.getArrayRef());
  for (auto [out, res] : llvm::zip(outputs, launch.getResults()))
    Value(out).replaceAllUsesWith(res);
  for (Operation *inner : llvm::reverse(fused))
    inner->erase();
  for (Operation &inner : llvm::make_early_inc_range(block.without_terminator()))
    if (inner.hasTrait<OpTrait::ConstantLike>() && inner.use_empty())
      inner.erase();
  return success();
}

/// Every output of an operator is a tensor of its own, as a torch op's are: a forward that
/// returns one of its arguments, or one value twice, returned the argument itself or two tensors
/// sharing one buffer (writing one in place changed the other, and autograd then gave wrong
/// gradients). Such a result is copied by an identity abp.map, which the forward's kernel fuses
/// (a forward with nothing else to do gets a copy kernel); a share_saved of a copied argument
/// shares the copy. Results that are not f32 tensors cannot be copied so and are refused.
LogicalResult freshOutputs(OperatorOp op) {
  ReturnOp ret = op.getForwardReturn();
  llvm::SmallPtrSet<Value, 4> returned;
  llvm::DenseMap<Value, Value> firstCopy; // a returned argument -> its first copy
  for (OpOperand &operand : ret->getOpOperands()) {
    if (operand.getOperandNumber() >= ret.getResults().size())
      break; // the residuals follow the results
    Value v = operand.get();
    bool argument = isa<BlockArgument>(v);
    if (returned.insert(v).second && !argument)
      continue;
    auto tensor = dyn_cast<RankedTensorType>(v.getType());
    if (!tensor || !tensor.getElementType().isF32())
      return ret.emitOpError() << "returns " << (argument ? "a forward argument" : "a value twice")
                               << " as output #" << operand.getOperandNumber()
                               << "; every output is a tensor of its own, and a " << v.getType()
                               << " cannot be copied: return it once, computed";
    OpBuilder b(ret);
    auto copy = b.create<MapOp>(ret.getLoc(), TypeRange{tensor}, FlatSymbolRefAttr(), ValueRange{v});
    OpBuilder body(op.getContext());
    Block *block = body.createBlock(&copy.getBody(), {}, {tensor.getElementType()}, {ret.getLoc()});
    body.create<YieldOp>(ret.getLoc(), ValueRange{block->getArgument(0)});
    operand.set(copy.getResult(0));
    if (argument && !firstCopy.count(v))
      firstCopy[v] = copy.getResult(0);
  }
  for (auto share : llvm::make_early_inc_range(op.getForward().front().getOps<ShareSavedOp>()))
    if (Value copy = firstCopy.lookup(share.getInput())) {
      share.getInputMutable().assign(copy);
      share->moveBefore(ret); // after the copy it now shares
    }
  return success();
}

struct FuseKernels : abp::impl::AbpFuseKernelsBase<FuseKernels> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SmallVector<OperatorOp> operators(module.getOps<OperatorOp>());
    for (OperatorOp op : operators) {
      std::string base = op.getSymName().str();
      if (failed(freshOutputs(op)) || failed(fuseDirection(op, op.getForward(), base + "_fwd")) ||
          failed(fuseDirection(op, op.getBackward(), base + "_bwd")))
        return signalPassFailure();
    }
  }
};
} // namespace
