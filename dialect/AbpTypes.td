// AbpTypes.td — types of the abp dialect: packed residual codes.
#ifndef ABP_TYPES_TD
#define ABP_TYPES_TD

include "dialect/AbpDialect.td"
include "mlir/IR/AttrTypeBase.td"

def Abp_CodesType : TypeDef<Abp_Dialect, "Codes"> {
  let mnemonic = "codes";
  let summary = "bit-packed integer codes, `bits` bits per element";
  let description = [{
    A residual stored as one `bits`-bit code per element of the tensor it was computed from, in
    the little-endian, LSB-first packing of docs/algorithms.md §2.6: ⌈bits·N/8⌉ bytes for N elements,
    with no wasted bit. Because the width is part of the type, the saved bytes of an operator are
    known statically.

    Example: `!abp.codes<2>` (ReGELU2's residual: 4 elements per byte).
  }];
  let parameters = (ins "unsigned":$bits);
  let assemblyFormat = "`<` $bits `>`";
  let genVerifyDecl = 1;
}

#endif // ABP_TYPES_TD
