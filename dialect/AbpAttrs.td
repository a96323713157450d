// AbpAttrs.td — attributes of the abp dialect: quantization schemes and kernel argument layouts.
#ifndef ABP_ATTRS_TD
#define ABP_ATTRS_TD

include "dialect/AbpDialect.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def Abp_BucketsAttr : AttrDef<Abp_Dialect, "Buckets"> {
  let mnemonic = "buckets";
  let summary = "bucket quantization: inner borders and one level per bucket";
  let description = [{
    The bucket scheme of FewBit and ReGELU2 (docs/algorithms.md §2.1): with K = 2^bits levels and
    K − 1 strictly increasing inner borders t_i, `code(x) = #{i : t_i < x}` (a value on a border
    goes to the lower bucket; NaN → 0, +inf → K − 1) and `dequantize(code) = levels[code]`.
    Borders are compared in fp32, levels are fp32 constants; both are written as f64 literals.

    Example: `#abp.buckets<borders = [-3.18588, -0.00117882, 3.19083], levels = [0.0, -0.0492226, 1.04874, 1.0]>`
  }];
  // Dense f64 arrays rather than ArrayRefParameter<"double">: LLVM has no hash_value(double).
  let parameters = (ins "::mlir::DenseF64ArrayAttr":$borders,
                        "::mlir::DenseF64ArrayAttr":$levels);
  let hasCustomAssemblyFormat = 1;
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// log2 of the number of levels (the verifier guarantees it is a power of two).
    unsigned getBits() const;
  }];
}

def Abp_DenseLayoutAttr : AttrDef<Abp_Dialect, "DenseLayout"> {
  let mnemonic = "dense";
  let summary = "a kernel argument holding one element of the launch dtype per element";
  let description = [{
    Example: `ins = [#abp.dense]` — the kernel reads fp32/fp16/bf16 elements (chosen per launch)
    and its body sees each one as an `f32`.
  }];
}

def Abp_PackedLayoutAttr : AttrDef<Abp_Dialect, "PackedLayout"> {
  let mnemonic = "packed";
  let summary = "a kernel argument holding `bits`-bit codes in the abp packing layout";
  let description = [{
    Example: `outs = [#abp.packed<2>]` — the body yields an `i8` code per element, stored with
    2 bits per element (docs/algorithms.md §2.6).
  }];
  let parameters = (ins "unsigned":$bits);
  let assemblyFormat = "`<` $bits `>`";
  let genVerifyDecl = 1;
}

def Abp_ScalarLayoutAttr : AttrDef<Abp_Dialect, "ScalarLayout"> {
  let mnemonic = "scalar";
  let summary = "a kernel argument passed by value (an f32 operator parameter)";
  let description = [{
    Example: `ins = [#abp.dense, #abp.scalar]` — the body's second argument is the same `f32`
    for every element (e.g. LeakyReLU's slope).
  }];
}

def Abp_RowsLayoutAttr : AttrDef<Abp_Dialect, "RowsLayout"> {
  let mnemonic = "rows";
  let summary = "a row-kernel argument holding one value per row";
  let description = [{
    Example: `outs = [#abp.dense, #abp.rows]` — a row kernel writes one element per element of
    its row-wide output and one value per row of the second (e.g. LayerNorm's 1/σ). Per-row
    values are stored in the compute type: fp32, or fp64 for fp64 launches; a row-kernel
    input the body sees as `i32` holds one 32-bit integer per row (row indices for
    `#abp.gathered`).
  }];
}

def Abp_ColsLayoutAttr : AttrDef<Abp_Dialect, "ColsLayout"> {
  let mnemonic = "cols";
  let summary = "a row-kernel input holding one value per column, the same for every row";
  let description = [{
    Example: `ins = [#abp.dense, #abp.cols]` — every row of a row kernel reads the second
    argument's element at its column: `cols` elements of the launch dtype (a per-feature
    parameter, such as a norm's gain). This is how `abp.broadcast_cols` reads its input.
  }];
}

def Abp_GatheredLayoutAttr : AttrDef<Abp_Dialect, "GatheredLayout"> {
  let mnemonic = "gathered";
  let summary = "a row-kernel input whose row r is row index[r] of a larger matrix";
  let description = [{
    Example: `ins = [#abp.gathered<1>, #abp.rows]` — row r of the first argument is row
    `i` of its matrix, where `i` is the `i32` value of row r of argument #1 (an `#abp.rows`
    argument holding row indices); a negative `i` reads a row of zeros. The matrix has as many
    columns as the kernel's rows and may have any number of rows: the caller guarantees every
    index is below it. The body sees each element as an `f32`, like `#abp.dense`. This is how
    `abp.sample` and `abp.unsample` read the rows they keep or put back.
  }];
  let parameters = (ins "unsigned":$by);
  let assemblyFormat = "`<` $by `>`";
}

def Abp_TotalLayoutAttr : AttrDef<Abp_Dialect, "TotalLayout"> {
  let mnemonic = "total";
  let summary = "a kernel argument holding one value for the whole launch, in memory";
  let description = [{
    Example: `outs = [#abp.total]` — a total kernel (`abp.kernel` with `total = <kind>`) writes
    the reduction of its body's value over every element; `ins = [#abp.dense, #abp.total]` —
    another kernel reads that one value, and its body sees it as the same `f32` for every
    element (like `#abp.scalar`, but computed on the device: no host sync). Stored in the
    compute type: fp32, or fp64 for fp64 launches.
  }];
}

def Abp_ReduceKind : I32EnumAttr<"ReduceKind", "how abp.reduce_rows and abp.reduce_tensor combine values", [
    I32EnumAttrCase<"sum", 0>,
    I32EnumAttrCase<"mean", 1>,
    I32EnumAttrCase<"max", 2>,
    I32EnumAttrCase<"min", 3>
  ]> {
  let cppNamespace = "::abp";
}

#endif // ABP_ATTRS_TD
