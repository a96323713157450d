// OperatorVerifierTest.cpp — the operator verifier rejects cross-direction uses in built IR.
//
// The parser already refuses a backward that names a forward value (separate scopes), so this
// path is only reachable from IR built in C++ (or, later, from Python builders).
#include "dialect/AbpDialect.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"

#include <gtest/gtest.h>

#include <string>

using namespace mlir;

namespace {
struct Built {
  OwningOpRef<ModuleOp> module;
  abp::OperatorOp op;
};

/// forward(x) = map(x) saving nothing; backward returns dy, or (if `leak`) a map over the
/// forward's value — which it never saved.
Built buildOperator(MLIRContext &ctx, bool leak) {
  OpBuilder b(&ctx);
  Location loc = FileLineColLoc::get(&ctx, "built.mlir", 3, 5);
  Built out{ModuleOp::create(loc), {}};
  b.setInsertionPointToEnd(out.module->getBody());
  auto tensor = RankedTensorType::get({ShapedType::kDynamic}, b.getF32Type());
  auto op = b.create<abp::OperatorOp>(loc, "leaky", DictionaryAttr(), DenseI64ArrayAttr(), ArrayAttr());
  out.op = op;

  Block *fwd = b.createBlock(&op.getForward(), {}, {tensor}, {loc});
  b.setInsertionPointToStart(fwd);
  auto map = b.create<abp::MapOp>(loc, TypeRange{tensor}, FlatSymbolRefAttr(),
                                  ValueRange{fwd->getArgument(0)});
  Block *body = b.createBlock(&map.getBody(), {}, {b.getF32Type()}, {loc});
  b.setInsertionPointToStart(body);
  b.create<abp::YieldOp>(loc, ValueRange{body->getArgument(0)});
  b.setInsertionPointToEnd(fwd);
  b.create<abp::ReturnOp>(loc, ValueRange{map.getResult(0)}, ValueRange{});

  Block *bwd = b.createBlock(&op.getBackward(), {}, {tensor}, {loc});
  b.setInsertionPointToStart(bwd);
  Value grad = bwd->getArgument(0);
  if (leak) {
    auto use = b.create<abp::MapOp>(FileLineColLoc::get(&ctx, "built.mlir", 9, 7),
                                    TypeRange{tensor}, FlatSymbolRefAttr(),
                                    ValueRange{map.getResult(0), grad});
    Block *ub = b.createBlock(&use.getBody(), {}, {b.getF32Type(), b.getF32Type()}, {loc, loc});
    b.setInsertionPointToStart(ub);
    b.create<abp::YieldOp>(loc, ValueRange{ub->getArgument(0)});
    b.setInsertionPointToEnd(bwd);
    grad = use.getResult(0);
  }
  b.create<abp::ReturnOp>(loc, ValueRange{grad}, ValueRange{});
  return out;
}

std::string verifyAndCollect(Operation *op, LogicalResult &result) {
  std::string messages;
  ScopedDiagnosticHandler handler(op->getContext(), [&](Diagnostic &diag) {
    messages += diag.str() + "\n";
    for (Diagnostic &note : diag.getNotes())
      messages += "note: " + note.str() + "\n";
    return success();
  });
  result = verify(op);
  return messages;
}
} // namespace

TEST(OperatorVerifier, AcceptsClosedDirections) {
  MLIRContext ctx;
  ctx.loadDialect<abp::AbpDialect>();
  Built built = buildOperator(ctx, /*leak=*/false);
  LogicalResult result = failure();
  std::string messages = verifyAndCollect(*built.module, result);
  EXPECT_TRUE(succeeded(result)) << messages;
}

TEST(OperatorVerifier, RejectsBackwardUseOfUnsavedForwardValue) {
  MLIRContext ctx;
  ctx.loadDialect<abp::AbpDialect>();
  Built built = buildOperator(ctx, /*leak=*/true);
  LogicalResult result = success();
  std::string messages = verifyAndCollect(*built.module, result);
  EXPECT_TRUE(failed(result));
  EXPECT_NE(messages.find("uses a value in backward that is neither a residual nor a backward "
                          "argument"),
            std::string::npos)
      << messages;
  EXPECT_NE(messages.find("note: value defined here"), std::string::npos) << messages;
}
