// FuseKernels.cpp — merges each direction's elementwise ops into one abp.kernel + abp.launch.
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/SetVector.h"

namespace abp {
#define GEN_PASS_DEF_ABPFUSEKERNELS
#include "passes/Passes.h.inc"
} // namespace abp

using namespace mlir;
using namespace abp;

namespace {
bool isElementwise(Operation *op) { return isa<MapOp, PackOp, UnpackOp>(op); }

/// What the fused kernel reads: a dense tensor, packed codes, or a captured f32 parameter.
Attribute layoutOfInput(Value value, MLIRContext *ctx) {
  if (auto codes = dyn_cast<CodesType>(value.getType()))
    return PackedLayoutAttr::get(ctx, codes.getBits());
  if (value.getType().isF32())
    return ScalarLayoutAttr::get(ctx);
  return DenseLayoutAttr::get(ctx);
}

/// Fuses the elementwise ops of one direction of `op` into kernel `name`. Returns failure
/// after emitting a diagnostic when the direction cannot be fused.
LogicalResult fuseDirection(OperatorOp op, Region &region, StringRef name) {
  MLIRContext *ctx = op.getContext();
  Block &block = region.front();
  SmallVector<Operation *> fused;
  for (Operation &inner : block.without_terminator()) {
    // Constants hoisted out of map bodies by canonicalization are re-materialized in the kernel.
    if (inner.hasTrait<OpTrait::ConstantLike>())
      continue;
    if (!isElementwise(&inner))
      return inner.emitOpError() << "cannot be fused into an elementwise kernel; only abp.map, "
                                    "abp.pack and abp.unpack may remain after lowering";
    fused.push_back(&inner);
  }
  if (fused.empty())
    return success();
  llvm::SmallPtrSet<Operation *, 16> inSet(fused.begin(), fused.end());

  // External values the kernel reads, in first-use order: operands of fused ops not produced by
  // them, and f32 parameters captured by map bodies.
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
  // Values leaving the direction: results of fused ops with a use outside them.
  llvm::SetVector<Value> outputs;
  for (Operation *inner : fused)
    for (Value result : inner->getResults())
      for (Operation *user : result.getUsers())
        if (!inSet.contains(user))
          outputs.insert(result);

  SmallVector<Attribute> ins, outs;
  SmallVector<Type> argTypes;
  SmallVector<Location> argLocs;
  for (Value in : inputs) {
    auto tensor = dyn_cast<RankedTensorType>(in.getType());
    if (tensor && !tensor.getElementType().isF32())
      return emitError(in.getLoc()) << "an i8 code tensor enters a kernel unpacked; "
                                       "store codes with abp.pack";
    ins.push_back(layoutOfInput(in, ctx));
    argTypes.push_back(isa<CodesType>(in.getType()) ? Type(IntegerType::get(ctx, 8))
                                                    : Type(Float32Type::get(ctx)));
    argLocs.push_back(in.getLoc());
  }
  for (Value out : outputs) {
    if (auto codes = dyn_cast<CodesType>(out.getType())) {
      outs.push_back(PackedLayoutAttr::get(ctx, codes.getBits()));
      continue;
    }
    auto tensor = cast<RankedTensorType>(out.getType());
    if (!tensor.getElementType().isF32())
      return out.getDefiningOp()->emitOpError()
             << "produces an i8 code tensor that leaves the kernel unpacked; store codes with "
                "abp.pack";
    outs.push_back(DenseLayoutAttr::get(ctx));
  }

  // The kernel symbol, placed before the operator.
  OpBuilder moduleBuilder(op);
  auto kernel = moduleBuilder.create<KernelOp>(op.getLoc(), name, moduleBuilder.getArrayAttr(ins),
                                               moduleBuilder.getArrayAttr(outs), IntegerAttr(),
                                               IntegerAttr());
  OpBuilder body(ctx);
  Block *entry = body.createBlock(&kernel.getBody(), {}, argTypes, argLocs);
  IRMapping scalars; // tensor/codes/param value -> its per-element scalar in the kernel
  for (auto [in, arg] : llvm::zip(inputs, entry->getArguments()))
    scalars.map(in, arg);
  for (Operation &inner : block.without_terminator())
    if (inner.hasTrait<OpTrait::ConstantLike>())
      body.clone(inner, scalars);

  for (Operation *inner : fused) {
    if (auto pack = dyn_cast<PackOp>(inner)) {
      scalars.map(pack.getResult(), scalars.lookup(pack.getInput()));
    } else if (auto unpack = dyn_cast<UnpackOp>(inner)) {
      scalars.map(unpack.getResult(), scalars.lookup(unpack.getCodes()));
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
  SmallVector<Value> yielded;
  for (Value out : outputs)
    yielded.push_back(scalars.lookup(out));
  body.create<YieldOp>(op.getLoc(), yielded);

  // One launch replaces the fused ops; every remaining user is the terminator.
  OpBuilder launchBuilder(block.getTerminator());
  SmallVector<Type> resultTypes;
  for (Value out : outputs)
    resultTypes.push_back(out.getType());
  auto launch = launchBuilder.create<LaunchOp>(fused.back()->getLoc(), resultTypes,
                                               FlatSymbolRefAttr::get(ctx, name),
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

struct FuseKernels : abp::impl::AbpFuseKernelsBase<FuseKernels> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SmallVector<OperatorOp> operators(module.getOps<OperatorOp>());
    for (OperatorOp op : operators) {
      std::string base = op.getSymName().str();
      if (failed(fuseDirection(op, op.getForward(), base + "_fwd")) ||
          failed(fuseDirection(op, op.getBackward(), base + "_bwd")))
        return signalPassFailure();
    }
  }
};
} // namespace
