// LowerQuantize.cpp — bucket and per-group (GACT) quantize/dequantize → reductions, Philox draws,
// code-computing maps plus pack/unpack.
#include "passes/Passes.h"

#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/SetVector.h"

#include <limits>

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

/// code(x) = Σ_i [x > t_i] with t_i rounded to fp32 (docs/algorithms.md §2.1): branch-free, and NaN
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

/// An `abp.map` over `inputs` (all of `shape`) with one `resultElem` result; `build` fills the
/// body from its scalar arguments and returns the yielded value.
Value buildMap(OpBuilder &builder, Location loc, ValueRange inputs, Type resultElem,
               function_ref<Value(OpBuilder &, ValueRange)> build) {
  auto shape = cast<RankedTensorType>(inputs.front().getType()).getShape();
  auto resultType = RankedTensorType::get(shape, resultElem);
  auto map = builder.create<MapOp>(loc, TypeRange{resultType}, FlatSymbolRefAttr(), inputs);
  SmallVector<Type> argTypes;
  for (Value in : inputs)
    argTypes.push_back(cast<RankedTensorType>(in.getType()).getElementType());
  OpBuilder body(builder.getContext());
  Block *block = body.createBlock(&map.getBody(), {}, argTypes,
                                  SmallVector<Location>(inputs.size(), loc));
  Value result = build(body, block->getArguments());
  body.create<YieldOp>(loc, ValueRange{result});
  return map.getResult(0);
}

Value f32Constant(OpBuilder &b, Location loc, float value) {
  return b.create<arith::ConstantOp>(loc, b.getF32FloatAttr(value));
}

/// GACT (docs/algorithms.md §6.2), a row per group: m = min, M = max, s = (2^b - 1) / (M - m + 2e-6)
/// (NaN unless M - m is finite), q = min(floor((x - m) * s + u), 2^b - 1), stored as 0 if NaN.
void lowerQuantizeGroups(QuantizeGroupsOp op) {
  OpBuilder b(op);
  Location loc = op.getLoc();
  auto rowsType = cast<RankedTensorType>(op.getMins().getType());
  auto matrixType = cast<RankedTensorType>(op.getInput().getType());
  const float top = static_cast<float>((1u << op.getCodes().getType().getBits()) - 1u);
  Value x = op.getInput();
  Value mins = b.create<ReduceRowsOp>(loc, rowsType, ReduceKind::min, x);
  Value maxs = b.create<ReduceRowsOp>(loc, rowsType, ReduceKind::max, x);
  Value scales = buildMap(b, loc, {mins, maxs}, b.getF32Type(), [&](OpBuilder &m, ValueRange a) {
    Value range = m.create<arith::SubFOp>(loc, a[1], a[0]);
    Value magnitude = m.create<math::AbsFOp>(loc, range);
    Value inf = f32Constant(m, loc, std::numeric_limits<float>::infinity());
    Value finite = m.create<arith::CmpFOp>(loc, arith::CmpFPredicate::OLT, magnitude, inf);
    Value padded = m.create<arith::AddFOp>(loc, range, f32Constant(m, loc, 2e-6f));
    Value scale = m.create<arith::DivFOp>(loc, f32Constant(m, loc, top), padded);
    Value nan = f32Constant(m, loc, std::numeric_limits<float>::quiet_NaN());
    return m.create<arith::SelectOp>(loc, finite, scale, nan);
  });
  Value minsWide = b.create<BroadcastRowsOp>(loc, matrixType, mins);
  Value scalesWide = b.create<BroadcastRowsOp>(loc, matrixType, scales);
  // 16-bit draws: half the Philox work of the quantizer, for a rounding bias below 2^-16 of a
  // step (the codes' own resolution is 1 / (2^b - 1) of the range, b <= 8).
  Value draws = b.create<UniformOp>(loc, matrixType, op.getSeed(), op.getOffset(), /*bits=*/16);
  Value codes = buildMap(b, loc, {x, minsWide, scalesWide, draws}, b.getI8Type(),
                         [&](OpBuilder &m, ValueRange a) -> Value {
                           Value shifted = m.create<arith::SubFOp>(loc, a[0], a[1]);
                           Value scaled = m.create<arith::MulFOp>(loc, shifted, a[2]);
                           Value dithered = m.create<arith::AddFOp>(loc, scaled, a[3]);
                           Value q = m.create<math::FloorOp>(loc, dithered);
                           // fptoui saturates (NaN and < 0 give 0, > 255 gives 255), then an
                           // integer minimum caps the code: two instructions on a GPU, where a
                           // float minimum that keeps NaN took up to four before the conversion.
                           Value code = m.create<arith::FPToUIOp>(loc, m.getI8Type(), q);
                           Value cap = m.create<arith::ConstantOp>(
                               loc, m.getIntegerAttr(m.getI8Type(), static_cast<int64_t>(top)));
                           return m.create<arith::MinUIOp>(loc, code, cap);
                         });
  Value packed = b.create<PackOp>(loc, op.getCodes().getType(), codes);
  op.getCodes().replaceAllUsesWith(packed);
  op.getMins().replaceAllUsesWith(mins);
  op.getScales().replaceAllUsesWith(scales);
  op.erase();
}

/// x = (q * (0.5 / s) + 0.5 * m) * 2 per element: docs/algorithms.md §6.2's q / s + m, with the
/// division done once per row (a per-element IEEE division costs a reciprocal, a refinement and a
/// slow path that q = 0 takes; the product differs from the quotient by at most one rounding), and
/// in halves: a row whose range is near the largest float (a finite mask, -3.4e38, beside scores)
/// has q / s near it, which overflowed to inf (and 1 / s too, s being subnormal) although m + q / s
/// is finite. Halving and doubling are exact, so every other row decodes to the bits of
/// q * (1 / s) + m, except where |m| < 2^-125, whose half rounds (a last-bit difference; a
/// constant row of such values then decodes to a neighbour of its value). A row whose maximum is itself the
/// largest float may still decode its top code one rounding above it, to inf: bounding that needs
/// the compute type's largest value, which a constant of the IR cannot name for every type.
void lowerDequantizeGroups(DequantizeGroupsOp op) {
  OpBuilder b(op);
  Location loc = op.getLoc();
  auto matrixType = cast<RankedTensorType>(op.getType());
  auto codesType = RankedTensorType::get(matrixType.getShape(), b.getI8Type());
  Value codes = b.create<UnpackOp>(loc, codesType, op.getCodes());
  Value halfSteps = buildMap(b, loc, {op.getScales()}, b.getF32Type(), [&](OpBuilder &m, ValueRange a) -> Value {
    return m.create<arith::DivFOp>(loc, f32Constant(m, loc, 0.5f), a[0]);
  });
  Value halfMins = buildMap(b, loc, {op.getMins()}, b.getF32Type(), [&](OpBuilder &m, ValueRange a) -> Value {
    return m.create<arith::MulFOp>(loc, a[0], f32Constant(m, loc, 0.5f));
  });
  Value halfMinsWide = b.create<BroadcastRowsOp>(loc, matrixType, halfMins);
  Value halfStepsWide = b.create<BroadcastRowsOp>(loc, matrixType, halfSteps);
  Value x = buildMap(b, loc, {codes, halfMinsWide, halfStepsWide}, b.getF32Type(),
                     [&](OpBuilder &m, ValueRange a) -> Value {
                       Value q = m.create<arith::UIToFPOp>(loc, m.getF32Type(), a[0]);
                       Value unscaled = m.create<arith::MulFOp>(loc, q, a[2]);
                       Value half = m.create<arith::AddFOp>(loc, unscaled, a[1]);
                       return m.create<arith::MulFOp>(loc, half, f32Constant(m, loc, 2.0f));
                     });
  op.replaceAllUsesWith(x);
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

  /// Collects every op of type OpT first (lowering erases them), then lowers each.
  template <typename OpT> void lowerAll(void (*lower)(OpT)) {
    SmallVector<OpT> ops;
    getOperation().walk([&](OpT op) { ops.push_back(op); });
    for (OpT op : ops)
      lower(op);
  }

  void runOnOperation() override {
    recordSchemes();
    lowerAll<QuantizeOp>(lowerQuantize);
    lowerAll<DequantizeOp>(lowerDequantize);
    lowerAll<QuantizeGroupsOp>(lowerQuantizeGroups);
    lowerAll<DequantizeGroupsOp>(lowerDequantizeGroups);
  }
};
} // namespace
