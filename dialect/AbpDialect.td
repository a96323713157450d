// AbpDialect.td — the abp dialect and the base class every abp op derives from.
#ifndef ABP_DIALECT_TD
#define ABP_DIALECT_TD

include "mlir/IR/OpBase.td"

def Abp_Dialect : Dialect {
  let name = "abp";
  let cppNamespace = "::abp";
  let summary = "Operators with explicit forward, backward and residuals, and approximations on residuals";
  let description = [{
    An `abp.operator` bundles a forward region, a backward region and the residuals that connect
    them: the forward terminator names what is saved, and the backward region receives exactly
    those values as its leading block arguments. Residuals are therefore the only values crossing
    from forward to backward, so the memory an operator keeps is visible in the IR. Approximations
    are ops on residuals (`abp.quantize`, `abp.pack`, ...). Elementwise bodies use upstream `arith`
    and `math`. See docs/dialect.md.
  }];
  let dependentDialects = [
    "::mlir::arith::ArithDialect",
    "::mlir::math::MathDialect",
    "::mlir::func::FuncDialect"
  ];
  let useDefaultTypePrinterParser = 1;
  let useDefaultAttributePrinterParser = 1;
  let extraClassDeclaration = [{
    void registerTypes();
    void registerAttributes();
  }];
}

/// Every abp op derives from this, so dialect-wide traits can be added in one place.
class Abp_Op<string mnemonic, list<Trait> traits = []> :
    Op<Abp_Dialect, mnemonic, traits>;

#endif // ABP_DIALECT_TD
