// AbpOps.td — the ops of the abp dialect: operators, elementwise maps, residual codecs, kernels.
#ifndef ABP_OPS_TD
#define ABP_OPS_TD

include "dialect/AbpDialect.td"
include "dialect/AbpTypes.td"
include "dialect/AbpAttrs.td"
include "mlir/IR/SymbolInterfaces.td"
include "mlir/IR/RegionKindInterface.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/ControlFlowInterfaces.td"
include "mlir/Interfaces/InferTypeOpInterface.td"

//===----------------------------------------------------------------------===//
// Operators
//===----------------------------------------------------------------------===//

// Not IsolatedFromAbove: the region verifier checks closure itself, with a diagnostic that says
// what to do (save the value as a residual) instead of the trait's generic one.
def Abp_OperatorOp : Abp_Op<"operator", [Symbol]> {
  let summary = "an operator with a forward region, a backward region and explicit residuals";
  let description = [{
    The forward region's block arguments are the operator's inputs: tensors (differentiable) and
    `f32` scalars (parameters such as a slope, passed by value and given no gradient). It ends in
    `abp.return %outputs saves %residuals`. The backward region's block arguments are exactly
    the residuals, in order, followed by one incoming gradient per forward output; it returns one
    gradient per tensor input. Nothing else crosses from forward to backward: a backward that uses
    a forward value it did not save is rejected.

    `no_grad = array<i64: ...>` lists forward arguments (by position) that get no gradient:
    row indices and sampling weights, which select and scale rows rather than feed the maths.
    Backward then returns one gradient per tensor input not listed.

    An optional `variants` dictionary instantiates the operator once per entry
    (`abp-instantiate-variants`): each entry maps a new operator name to a bucket scheme that
    replaces the operator's own scheme (and the width of its codes). This is how one FewBit
    activation file yields its 1..4-bit operators.

    Example:
    ```mlir
    abp.operator @relu forward {
    ^bb0(%x: tensor<?xf32>):
      %y = abp.map @relu_f32(%x) : (tensor<?xf32>) -> tensor<?xf32>
      %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>}
          : tensor<?xf32> -> !abp.codes<1>
      abp.return %y : tensor<?xf32> saves %c : !abp.codes<1>
    } backward {
    ^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
      %d = abp.dequantize %c {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>}
          : !abp.codes<1> -> tensor<?xf32>
      %dx = abp.map(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
      ^bb0(%s: f32, %g: f32):
        %p = arith.mulf %s, %g : f32
        abp.yield %p : f32
      }
      abp.return %dx : tensor<?xf32>
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name,
                       OptionalAttr<DictionaryAttr>:$variants,
                       OptionalAttr<DenseI64ArrayAttr>:$no_grad,
                       OptionalAttr<StrArrayAttr>:$params);
  let regions = (region SizedRegion<1>:$forward, SizedRegion<1>:$backward);
  let assemblyFormat = [{
    $sym_name (`variants` $variants^)? attr-dict-with-keyword custom<Directions>($forward, $backward)
  }];
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// The forward and backward terminators.
    ReturnOp getForwardReturn();
    ReturnOp getBackwardReturn();
    /// Forward block arguments of tensor type (the inputs, differentiable or not).
    llvm::SmallVector<mlir::BlockArgument> getTensorInputs();
    /// The tensor inputs that get a gradient: those not listed in `no_grad`.
    llvm::SmallVector<mlir::BlockArgument> getDifferentiableInputs();
  }];
}

def Abp_ReturnOp : Abp_Op<"return", [Terminator, HasParent<"OperatorOp">,
                                     AttrSizedOperandSegments, Pure]> {
  let summary = "ends a forward or backward region; in forward, also names the residuals";
  let description = [{
    In forward: `abp.return %y : tensor<?xf32> saves %c : !abp.codes<2>` returns the outputs and
    saves the residuals. In backward: `abp.return %dx : tensor<?xf32>` returns the input gradients.
  }];
  let arguments = (ins Variadic<AnyType>:$results, Variadic<AnyType>:$saved);
  let assemblyFormat = [{
    ($results^ `:` type($results))? (`saves` $saved^ `:` type($saved))? attr-dict
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Elementwise computation
//===----------------------------------------------------------------------===//

def Abp_MapOp : Abp_Op<"map", [Pure,
                               DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "applies a scalar function to every element of equally shaped tensors";
  let description = [{
    The scalar function is either the op's body region (block arguments: one scalar per input,
    terminated by `abp.yield`) or a `func.func` named by `callee` with that signature. Bodies use
    the scalar operations of docs/dialect.md (arith, math, func.call). Float tensors are seen as
    `f32` (the compute type; storage dtypes are chosen per kernel launch); integer tensors carry
    codes. An operator parameter (`f32`, or `i64`) is either an input, which every element sees
    as it is, or captured by a body from the enclosing region; at least one input is a tensor.

    Example:
    ```mlir
    %y = abp.map @gelu(%x) : (tensor<?xf32>) -> tensor<?xf32>
    %p = abp.map(%a, %b) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
    ^bb0(%u: f32, %v: f32):
      %m = arith.mulf %u, %v : f32
      abp.yield %m : f32
    }
    %s = abp.map @scale(%x, %slope) : (tensor<?xf32>, f32) -> tensor<?xf32>
    ```
  }];
  let arguments = (ins OptionalAttr<FlatSymbolRefAttr>:$callee,
                       Variadic<AnyTypeOf<[AnyRankedTensor, F32, I64]>>:$inputs);
  let results = (outs Variadic<AnyRankedTensor>:$results);
  let regions = (region MaxSizedRegion<1>:$body);
  let assemblyFormat = [{
    ($callee^)? `(` $inputs `)` attr-dict `:` functional-type($inputs, $results) ($body^)?
  }];
  let hasVerifier = 1;
  let hasRegionVerifier = 1;
}

def Abp_YieldOp : Abp_Op<"yield", [Pure, Terminator, ReturnLike,
                                  ParentOneOf<["MapOp", "KernelOp"]>]> {
  let summary = "returns the scalar results of an elementwise body";
  let description = [{
    Example: `abp.yield %r : f32`
  }];
  let arguments = (ins Variadic<AnyType>:$values);
  let assemblyFormat = "attr-dict ($values^ `:` type($values))?";
}

//===----------------------------------------------------------------------===//
// Row reductions (along the last dimension)
//===----------------------------------------------------------------------===//

def Abp_ReduceRowsOp : Abp_Op<"reduce_rows", [Pure]> {
  let summary = "sums, averages or takes the maximum or minimum of every row (the last dimension)";
  let description = [{
    In an operator: `tensor<?x?xf32> -> tensor<?xf32>`, one value per row. `sum` adds the row's
    elements, `mean` divides that sum by the row length; both accumulate in the compute type
    (fp32, or fp64 for fp64 launches). `max` and `min` propagate NaN (a NaN anywhere in the row
    makes the result the one quiet NaN with every mantissa bit set), and a zero result is +0,
    so that every device gives the same bits; an empty row gives 0, -inf and +inf
    respectively. Inside a row kernel (after `abp-fuse-kernels`) the op
    takes the per-element `f32` and yields the row's `f32` to every element of the row.

    A row kernel reads its inputs once per reduction stage: a statistic that depends on
    another (LayerNorm's variance on its mean) is computed in a second sweep over the row, so
    a variance written as `mean((x - mean(x))^2)` is the two-pass algorithm.

    Example:
    ```mlir
    %m = abp.reduce_rows mean %x : tensor<?x?xf32> -> tensor<?xf32>
    ```
  }];
  let arguments = (ins Abp_ReduceKind:$kind, AnyTypeOf<[RankedTensorOf<[F32]>, F32]>:$input);
  let results = (outs AnyTypeOf<[RankedTensorOf<[F32]>, F32]>:$result);
  let assemblyFormat = "$kind $input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Abp_ReduceTensorOp : Abp_Op<"reduce_tensor", [Pure]> {
  let summary = "sums, averages or takes the maximum or minimum of a whole tensor";
  let description = [{
    Reduces every element of a tensor of any rank to one `f32` value, which an `abp.map` then
    reads like a parameter (every element sees it) or the operator saves (a per-tensor scale
    costs one value, not bits per element). `sum` and `mean` accumulate in the compute type
    (fp32, or fp64 for fp64 launches); `max` and `min` propagate NaN (as the one quiet NaN with every
    mantissa bit set) and give +0 for a zero result. An empty tensor gives 0,
    NaN (0 / 0), -inf and +inf respectively.

    `abp-fuse-kernels` gives each reduction its own *total kernel*, launched before the
    direction's kernel: it recomputes what the reduced value depends on (elementwise maths,
    codes, draws; not row reductions) and reduces it in a fixed order, so the result does not
    depend on the device and the CPU path combines in the same order. No host synchronisation.

    Example:
    ```mlir
    %amax = abp.reduce_tensor max %ax : tensor<?x?xf32> -> f32
    %q = abp.map(%x, %amax) : (tensor<?x?xf32>, f32) -> tensor<?x?xf32> { ... }
    ```
  }];
  let arguments = (ins Abp_ReduceKind:$kind, RankedTensorOf<[F32]>:$input);
  let results = (outs F32:$result);
  let assemblyFormat = "$kind $input attr-dict `:` type($input) `->` type($result)";
}

def Abp_BroadcastRowsOp : Abp_Op<"broadcast_rows", [Pure]> {
  let summary = "repeats one value per row along the row (the last dimension)";
  let description = [{
    Turns a per-row `tensor<?xf32>` into a row-wide `tensor<?x?xf32>` so that an `abp.map`
    can combine it with row-wide tensors. Free in a fused row kernel: the value is already in
    every thread of the row.

    Example:
    ```mlir
    %mb = abp.broadcast_rows %m : tensor<?xf32> -> tensor<?x?xf32>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$input);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Abp_BroadcastColsOp : Abp_Op<"broadcast_cols", [Pure]> {
  let summary = "repeats one value per column down every row (a per-feature vector)";
  let description = [{
    Turns a per-column `tensor<?xf32>` (as many values as the rows have elements: a norm's gain
    or bias) into a row-wide `tensor<?x?xf32>` whose every row is that vector, so that an
    `abp.map` can combine it with row-wide tensors. It makes the kernel a row kernel, which
    reads the vector at each element's column (`#abp.cols`). A value broadcast so is per
    column, and cannot also be used per row.

    Example:
    ```mlir
    %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$input);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

def Abp_ReduceColsOp : Abp_Op<"reduce_cols", [Pure]> {
  let summary = "sums every column over the rows: the gradient of a per-column input";
  let description = [{
    `tensor<?x?xf32> -> tensor<?xf32>`, one value per column: the sum over the rows, as
    autograd reduces a broadcast operand's gradient. Only `sum`, and only as a gradient that
    backward's `abp.return` returns: it is not fused into the direction's kernel, which writes
    the row-wide operand as an output; the framework sums it over the rows after the launch
    (the manifest's `col_sums`). No cross-row reduction is generated, so results stay
    deterministic on every device.

    Example (the gradient of a gain `%w` applied as `n · w`):
    ```mlir
    %gn = abp.map(%g, %n) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> { ... }
    %dw = abp.reduce_cols sum %gn : tensor<?x?xf32> -> tensor<?xf32>
    abp.return %dx, %dw : tensor<?x?xf32>, tensor<?xf32>
    ```
  }];
  let arguments = (ins Abp_ReduceKind:$kind, RankedTensorOf<[F32]>:$input);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = "$kind $input attr-dict `:` type($input) `->` type($result)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Residual approximations: share-saved
//===----------------------------------------------------------------------===//

def Abp_ShareSavedOp : Abp_Op<"share_saved", [Pure, HasParent<"OperatorOp">,
                                              SameOperandsAndResultType]> {
  let summary = "saves a forward output that its consumer keeps anyway, at no extra memory";
  let description = [{
    The residual aliases the identical tensor (same value, same dtype, same storage) that an
    output of this operator hands to its consumer, e.g. the Linear after a norm, which saves
    its input for its own weight gradient. The residual then costs no memory of its own.

    The operand must be an output of the forward `abp.return` and the result may only be
    saved by it. An operator that shares a saved tensor may save nothing else but per-row
    statistics (`tensor<?xf32>` when inputs are `tensor<?x?xf32>`): its backward provably
    needs only the shared output and those statistics, never the input.

    Example (MS-RMSNorm):
    ```mlir
    %ys = abp.share_saved %y : tensor<?x?xf32>
    abp.return %y : tensor<?x?xf32> saves %ys, %r : tensor<?x?xf32>, tensor<?xf32>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$input);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = "$input attr-dict `:` type($input)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Residual approximations: quantize
//===----------------------------------------------------------------------===//

def Abp_QuantizeOp : Abp_Op<"quantize", [Pure]> {
  let summary = "maps every element to its bucket code and packs the codes";
  let description = [{
    `code(x) = #{i : borders[i] < x}` with the borders rounded to fp32, stored with
    `log2(#levels)` bits per element. Lowered by `abp-lower-quantize` to an `abp.map` computing
    the code and an `abp.pack`.

    Example:
    ```mlir
    %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>}
        : tensor<?xf32> -> !abp.codes<1>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$input, Abp_BucketsAttr:$scheme);
  let results = (outs Abp_CodesType:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` qualified(type($result))";
  let hasVerifier = 1;
}

def Abp_DequantizeOp : Abp_Op<"dequantize", [Pure]> {
  let summary = "unpacks bucket codes and replaces each by its level";
  let description = [{
    `dequantize(code) = levels[code]` as fp32. Lowered by `abp-lower-quantize` to an
    `abp.unpack` and an `abp.map` selecting the level.

    Example:
    ```mlir
    %d = abp.dequantize %c {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>}
        : !abp.codes<1> -> tensor<?xf32>
    ```
  }];
  let arguments = (ins Abp_CodesType:$codes, Abp_BucketsAttr:$scheme);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = "$codes attr-dict `:` qualified(type($codes)) `->` type($result)";
  let hasVerifier = 1;
}

def Abp_PackOp : Abp_Op<"pack", [Pure]> {
  let summary = "stores integer codes with the bit width of the result type";
  let description = [{
    Keeps the low `bits` bits of each `i8` code (docs/algorithms.md §2.6 layout). Authors use it
    directly for codes that are not bucket indices, e.g. a 1-bit `min < x < max` mask.

    Example: `%c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>`
  }];
  let arguments = (ins RankedTensorOf<[I8]>:$input);
  let results = (outs Abp_CodesType:$result);
  let assemblyFormat = "$input attr-dict `:` type($input) `->` qualified(type($result))";
}

def Abp_UnpackOp : Abp_Op<"unpack", [Pure]> {
  let summary = "reads packed codes back as one i8 per element";
  let description = [{
    Example: `%m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>`
  }];
  let arguments = (ins Abp_CodesType:$codes);
  let results = (outs RankedTensorOf<[I8]>:$result);
  let assemblyFormat = "$codes attr-dict `:` qualified(type($codes)) `->` type($result)";
}

//===----------------------------------------------------------------------===//
// Residual approximations: per-group affine quantize (GACT / ActNN)
//===----------------------------------------------------------------------===//

def Abp_UniformOp : Abp_Op<"uniform", [Pure]> {
  let summary = "one U[0, 1) draw per element from the shared Philox stream";
  let description = [{
    Element e of the result (its flat index in the launch) is
    `(w >> 8) * 2^-24` where `w` is word `c mod 4` of Philox-4x32-10 applied to the counter
    `(c / 4)` (128-bit, low words first) under the 64-bit key `seed`, with `c = offset + e`.
    With `bits = 16` it is `h * 2^-16` where `h` is half-word `c mod 8` of Philox at counter
    `(c / 8)`: the low half of word `(c mod 8) / 2` for even `c`, the high half for odd `c`.
    That is half the Philox calls, for draws on a grid of 2^-16 (stochastic rounding with them
    is biased by less than 2^-16 of a step). `bits` is 24 (the default) or 16.
    The draw is a pure function of (seed, offset + e): the same on the GPU and the CPU path, and
    a caller splitting a tensor over several launches keeps each element's draw by passing the
    launch's first flat index as `offset`. In an operator the result is a tensor of the
    shape the kernel works on; in a kernel body it is the element's `f32` draw.

    Example:
    ```mlir
    %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?x?xf32>
    %h = abp.uniform %seed, %offset {bits = 16 : i32} : i64, i64 -> tensor<?x?xf32>
    ```
  }];
  let arguments = (ins I64:$seed, I64:$offset, DefaultValuedAttr<I32Attr, "24">:$bits);
  let results = (outs AnyTypeOf<[RankedTensorOf<[F32]>, F32]>:$result);
  let assemblyFormat = "$seed `,` $offset attr-dict `:` type($seed) `,` type($offset) `->` type($result)";
  let hasVerifier = 1;
}

def Abp_QuantizeGroupsOp : Abp_Op<"quantize_groups", [Pure]> {
  let summary = "per-row affine codes with stochastic rounding (a row is a group)";
  let description = [{
    With b the width of the result's codes, for each row (group) with minimum m and maximum M:
    `s = (2^b - 1) / (M - m + 2e-6)` (NaN
    when M - m is not finite, so a group holding NaN or ±inf decodes to all NaN) and, per
    element, `q = min(floor((x - m) * s + u), 2^b - 1)` with `u` from `abp.uniform` (seed,
    offset); a NaN `q` is stored as 0. Computed in the compute type (fp32) without
    contraction, so the GPU and the CPU path store the same codes. The clamp only matters
    where the sum rounds up to 2^b in fp32. Lowered by `abp-lower-quantize` to reductions,
    `abp.uniform`, an `abp.map` and `abp.pack`; one row kernel after fusion.

    Example:
    ```mlir
    %c, %m, %s = abp.quantize_groups %x, %seed, %offset
        : tensor<?x?xf32>, i64, i64 -> !abp.codes<2>, tensor<?xf32>, tensor<?xf32>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$input, I64:$seed, I64:$offset);
  let results = (outs Abp_CodesType:$codes, RankedTensorOf<[F32]>:$mins,
                      RankedTensorOf<[F32]>:$scales);
  let assemblyFormat = [{
    $input `,` $seed `,` $offset attr-dict `:` type($input) `,` type($seed) `,` type($offset)
    `->` qualified(type($codes)) `,` type($mins) `,` type($scales)
  }];
  let hasVerifier = 1;
}

def Abp_DequantizeGroupsOp : Abp_Op<"dequantize_groups", [Pure]> {
  let summary = "decodes per-row affine codes: q / s + m";
  let description = [{
    The inverse of `abp.quantize_groups`: element (r, j) is `(q * (0.5 / s_r) + 0.5 * m_r) * 2`
    in the compute type: `q / s_r + m_r` with the reciprocal rounded once per row (one rounding
    from the quotient, and no per-element division), computed in halves so that a row whose range
    is near the largest float (a finite mask value beside scores) decodes to finite values; the
    halving and doubling are exact elsewhere. A row whose maximum is the largest float itself may
    decode its top code to inf. Unbiased: E[q / s + m] = x. Lowered by
    `abp-lower-quantize` to `abp.unpack`, per-row maps, broadcasts and an `abp.map`.

    Example:
    ```mlir
    %x = abp.dequantize_groups %c, %m, %s
        : !abp.codes<2>, tensor<?xf32>, tensor<?xf32> -> tensor<?x?xf32>
    ```
  }];
  let arguments = (ins Abp_CodesType:$codes, RankedTensorOf<[F32]>:$mins,
                       RankedTensorOf<[F32]>:$scales);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = [{
    $codes `,` $mins `,` $scales attr-dict `:` qualified(type($codes)) `,` type($mins) `,`
    type($scales) `->` type($result)
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Row sampling (WTA-CRS, CRS, VCAS)
//===----------------------------------------------------------------------===//

def Abp_SampleOp : Abp_Op<"sample", [Pure]> {
  let summary = "keeps the rows named by an index, each times its Horvitz-Thompson weight";
  let description = [{
    Row r of the result is `weight[r] * input[index[r]]`, computed in the compute type, or a
    row of zeros where `index[r]` is negative (a row the plan dropped). The index and the
    weights come from a sampling plan (which rows, and 1/p for each, so that
    sum_r weight[r] * f(input[index[r]]) is an unbiased estimate of sum_i f(input[i]) for any
    f linear in the row); every non-negative index must lie in [0, rows of input). The result
    has one row per index. One row kernel after fusion: the rows are gathered as they are read, never
    copied first.

    Example:
    ```mlir
    %kept = abp.sample %x, %index, %weight
        : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$input, RankedTensorOf<[I32]>:$index,
                       RankedTensorOf<[F32]>:$weight);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = [{
    $input `,` $index `,` $weight attr-dict `:` type($input) `,` type($index) `,` type($weight)
    `->` type($result)
  }];
  let hasVerifier = 1;
}

def Abp_UnsampleOp : Abp_Op<"unsample", [Pure]> {
  let summary = "puts kept rows back in their places, with zero rows elsewhere";
  let description = [{
    The inverse placement of `abp.sample`: row i of the result is `kept[slot[i]]`, or a row
    of zeros where `slot[i]` is negative (a row the plan did not keep). With the kept rows of
    a plan and slot = the position of each row in the plan's index (or -1), the result is the
    plan's unbiased estimate of the sampled matrix, full size. Every non-negative slot must
    lie in [0, rows of kept).

    Example:
    ```mlir
    %x = abp.unsample %kept, %slot : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
    ```
  }];
  let arguments = (ins RankedTensorOf<[F32]>:$kept, RankedTensorOf<[I32]>:$slot);
  let results = (outs RankedTensorOf<[F32]>:$result);
  let assemblyFormat = [{
    $kept `,` $slot attr-dict `:` type($kept) `,` type($slot) `->` type($result)
  }];
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Kernel form (after abp-fuse-kernels)
//===----------------------------------------------------------------------===//

def Abp_KernelOp : Abp_Op<"kernel", [Symbol, IsolatedFromAbove]> {
  let summary = "one fused kernel (elementwise or row-wise): argument layouts plus a scalar body";
  let description = [{
    The body runs once per element. Its block arguments follow `ins`: `#abp.dense` → `f32`,
    `#abp.packed<b>` → `i8` code, `#abp.scalar` → `f32` parameter; its yields follow `outs`
    (`#abp.dense` ← `f32`, `#abp.packed<b>` ← `i8`). `abp-map-threads` adds the thread
    mapping: `block_size` threads per block and `chunk` consecutive elements per thread and
    grid-stride iteration (a whole number of 128-bit vectors and of packed bytes).

    With `rows`, the kernel works on a matrix one row at a time: dense arguments are rows of
    the same length, `#abp.rows` arguments hold one value per row (a per-row input is the same
    `f32` for every element of the row; a per-row output must be yielded a row-uniform
    value), and `abp.reduce_rows` combines a per-element value over the row. Rows of at most
    `warp_max_cols` elements are handled by one warp each, longer rows by a whole block.

    With `total = <kind>` (a *total kernel*, made by `abp-fuse-kernels` for each
    `abp.reduce_tensor`), the body yields one `f32` per element and the kernel writes their
    reduction over the whole launch to its one output, `#abp.total`.

    Example:
    ```mlir
    abp.kernel @relu_bwd {ins = [#abp.packed<1>, #abp.dense], outs = [#abp.dense]} {
    ^bb0(%c: i8, %dy: f32):
      ...
      abp.yield %dx : f32
    }
    ```
  }];
  let arguments = (ins SymbolNameAttr:$sym_name, ArrayAttr:$ins, ArrayAttr:$outs,
                       OptionalAttr<I64Attr>:$block_size, OptionalAttr<I64Attr>:$chunk,
                       UnitAttr:$rows, OptionalAttr<I64Attr>:$warp_max_cols,
                       OptionalAttr<Abp_ReduceKind>:$total);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// Whether the kernel works row by row (`rows`) rather than element by element.
    bool isRowKernel() { return getRows(); }
    /// Whether the kernel reduces its body's value over the whole launch (`total`).
    bool isTotalKernel() { return getTotal().has_value(); }
  }];
}

def Abp_LaunchOp : Abp_Op<"launch", [DeclareOpInterfaceMethods<SymbolUserOpInterface>]> {
  let summary = "runs an abp.kernel over its arguments' elements";
  let description = [{
    Operands follow the kernel's `ins` (tensors for `#abp.dense`, codes for `#abp.packed`,
    `f32` for `#abp.scalar`); results follow its `outs`.

    Example:
    ```mlir
    %y, %c = abp.launch @regelu2_fwd(%x) : (tensor<?xf32>) -> (tensor<?xf32>, !abp.codes<2>)
    ```
  }];
  let arguments = (ins FlatSymbolRefAttr:$kernel, Variadic<AnyType>:$args);
  let results = (outs Variadic<AnyType>:$results);
  let assemblyFormat = "$kernel `(` $args `)` attr-dict `:` functional-type($args, $results)";
}

#endif // ABP_OPS_TD
