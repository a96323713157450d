// LowerQuantize.cpp — bucket quantize/dequantize → code-computing maps plus pack/unpack.
#include "passes/Passes.h"

#include "mlir/IR/Builders.h"
#include "llvm/ADT/SetVector.h"

namespace abp {
#define GEN_PASS_DEF_ABPLOWERQUANTIZE
#include "passes/Passes.h.inc"
} // namespace abp

using namespace mlir;
using namespace abp;

namespace {
/// Creates an empty single-result `abp.map` over `input` and returns its body builder.
MapOp createMap(OpBuilder &builder, Location loc, Value input, Type resultElem,
                OpBuilder &bodyBuilder) {
  auto inType = cast<RankedTensorType>(input.getType());
  auto resultType = RankedTensorType::get(inType.getShape(), resultElem);
  auto map = builder.create<MapOp>(loc, TypeRange{resultType}, FlatSymbolRefAttr(),
                                   ValueRange{input});
  Block *body = bodyBuilder.createBlock(&map.getBody(), {}, {inType.getElementType()}, {loc});
  bodyBuilder.setInsertionPointToStart(body);
  return map;
}

/// code(x) = Σ_i [x > t_i] with t_i rounded to fp32 (ALGORITHMS.md §2.1): branch-free, and NaN
/// compares false everywhere, so it gets code 0.
void lowerQuantize(QuantizeOp op) {
  OpBuilder builder(op);
  OpBuilder body(op.getContext());
  Location loc = op.getLoc();
  MapOp map = createMap(builder, loc, op.getInput(), builder.getI8Type(), body);
  Value x = map.getBody().front().getArgument(0);
  Value code = body.create<arith::ConstantIntOp>(loc, 0, 8);
  for (double border : op.getScheme().getBorders().asArrayRef()) {
    Value t = body.create<arith::ConstantOp>(loc, body.getF32FloatAttr(static_cast<float>(border)));
    Value above = body.create<arith::CmpFOp>(loc, arith::CmpFPredicate::OGT, x, t);
    Value bit = body.create<arith::ExtUIOp>(loc, body.getI8Type(), above);
    code = body.create<arith::AddIOp>(loc, code, bit);
  }
  body.create<YieldOp>(loc, ValueRange{code});
  auto pack = builder.create<PackOp>(loc, op.getType(), map.getResult(0));
  op.replaceAllUsesWith(pack.getResult());
  op.erase();
}

/// levels[code] as a chain of selects over fp32 constants (K ≤ 256; for the common K ≤ 16 this
/// is a handful of predicated moves, cheaper than a memory lookup).
void lowerDequantize(DequantizeOp op) {
  OpBuilder builder(op);
  OpBuilder body(op.getContext());
  Location loc = op.getLoc();
  auto resultType = cast<RankedTensorType>(op.getType());
  auto codesTensor = RankedTensorType::get(resultType.getShape(), builder.getI8Type());
  auto unpack = builder.create<UnpackOp>(loc, codesTensor, op.getCodes());
  MapOp map = createMap(builder, loc, unpack.getResult(), builder.getF32Type(), body);
  Value code = map.getBody().front().getArgument(0);
  ArrayRef<double> levels = op.getScheme().getLevels().asArrayRef();
  Value level = body.create<arith::ConstantOp>(loc, body.getF32FloatAttr(static_cast<float>(levels[0])));
  for (size_t i = 1; i < levels.size(); ++i) {
    Value index = body.create<arith::ConstantIntOp>(loc, static_cast<int64_t>(i), 8);
    Value hit = body.create<arith::CmpIOp>(loc, arith::CmpIPredicate::eq, code, index);
    Value value = body.create<arith::ConstantOp>(loc, body.getF32FloatAttr(static_cast<float>(levels[i])));
    level = body.create<arith::SelectOp>(loc, hit, value, level);
  }
  body.create<YieldOp>(loc, ValueRange{level});
  op.replaceAllUsesWith(map.getResult(0));
  op.erase();
}

struct LowerQuantize : abp::impl::AbpLowerQuantizeBase<LowerQuantize> {
  /// Keeps each operator's bucket schemes as `abp.schemes` once the ops carrying them are gone:
  /// the manifest exports them (Python's `.borders` / `.levels`).
  void recordSchemes() {
    getOperation().walk([&](OperatorOp op) {
      llvm::SetVector<Attribute> schemes;
      op.walk([&](QuantizeOp q) { schemes.insert(q.getScheme()); });
      op.walk([&](DequantizeOp d) { schemes.insert(d.getScheme()); });
      if (!schemes.empty())
        op->setAttr("abp.schemes", ArrayAttr::get(&getContext(), schemes.getArrayRef()));
    });
  }

  void runOnOperation() override {
    recordSchemes();
    SmallVector<QuantizeOp> quantizes;
    SmallVector<DequantizeOp> dequantizes;
    getOperation().walk([&](QuantizeOp op) { quantizes.push_back(op); });
    getOperation().walk([&](DequantizeOp op) { dequantizes.push_back(op); });
    for (QuantizeOp op : quantizes)
      lowerQuantize(op);
    for (DequantizeOp op : dequantizes)
      lowerDequantize(op);
  }
};
} // namespace
