// Passes.td — every abp pass, declared once; options, docs and registration are generated.
#ifndef ABP_PASSES_TD
#define ABP_PASSES_TD

include "mlir/Pass/PassBase.td"

def AbpVerifyModule : Pass<"abp-verify-module", "::mlir::ModuleOp"> {
  let summary = "Checks that the module holds only operators, kernels and their callees";
  let description = [{
    Every top-level op must be an `abp.operator`, an `abp.kernel` or a `func.func`; anything else
    gets a located error before any pass rewrites the module. Besides not being an operator, a
    stray op can hang the pipeline: a module's body is a graph region, where
    `%x = arith.maximumf %x, %x` is valid IR that the canonicalizer folds into itself forever.
  }];
}

def AbpVerifyResiduals : Pass<"abp-verify-residuals", "::mlir::ModuleOp"> {
  let summary = "Checks the residual flow of every operator and records its saved bits";
  let description = [{
    For each `abp.operator`: every saved residual must be used by backward (a residual nothing
    reads is memory kept for nothing), and the saved bits per element of the operator — the sum
    over per-element residuals (`!abp.codes<b>` counts b, an f32 tensor 32) — is attached as
    `abp.saved_bits`, so memory is visible statically. f32 parameters cost no per-element bits.
    A residual of lower rank than the operator's inputs (a per-row statistic) counts in
    `abp.saved_row_bits` instead, and a shared output (`abp.share_saved`) counts nothing: the
    consumer keeps that tensor anyway.
  }];
}

def AbpInstantiateVariants : Pass<"abp-instantiate-variants", "::mlir::ModuleOp"> {
  let summary = "Clones each operator once per entry of its `variants` dictionary";
  let description = [{
    An operator `@f variants {f_b1 = #s1, f_b2 = #s2}` whose quantize/dequantize ops use scheme
    `#s` becomes three operators `@f`, `@f_b1`, `@f_b2`; in each clone every occurrence of `#s`
    is replaced by the variant's scheme and every `!abp.codes<bits(#s)>` by the variant's width.
    An operator using more than one distinct scheme cannot be instantiated (error).
  }];
}

def AbpLowerQuantize : Pass<"abp-lower-quantize", "::mlir::ModuleOp"> {
  let summary = "Lowers bucket and per-group quantize/dequantize to code maps and pack/unpack";
  let description = [{
    `abp.quantize %x {scheme}` becomes an `abp.map` computing `Σ_i [x > t_i]` as i8 (borders
    rounded to fp32; NaN compares false, so it gets code 0) followed by `abp.pack`;
    `abp.dequantize %c {scheme}` becomes `abp.unpack` and an `abp.map` selecting `levels[code]`
    as fp32 constants. `abp.quantize_groups` becomes per-row min/max reductions, the scale map,
    `abp.uniform`, the stochastic-rounding code map and `abp.pack`; `abp.dequantize_groups`
    becomes `abp.unpack` and the `q / s + m` map (docs/algorithms.md §6.2).
  }];
  let dependentDialects = ["::mlir::arith::ArithDialect", "::mlir::math::MathDialect"];
}

def AbpFuseKernels : Pass<"abp-fuse-kernels", "::mlir::ModuleOp"> {
  let summary = "Fuses each direction's elementwise ops into one abp.kernel";
  let description = [{
    In the forward and backward region of every operator, all `abp.map`, `abp.pack` and
    `abp.unpack` ops (they share one iteration space) are merged into a single `abp.kernel`
    symbol named `<operator>_fwd` / `<operator>_bwd` and replaced by one `abp.launch`: the
    kernel reads each external tensor once (codes unpacked in registers), computes every map
    body per element, and writes only the values that leave the direction, packing codes on the
    fly. Captured f32 parameters become `#abp.scalar` arguments. Values used only inside the
    direction never reach memory.

    A direction with `abp.reduce_rows` or `abp.broadcast_rows` becomes a row kernel (`rows`):
    its reductions stay in the body as per-element → per-row `f32` ops, broadcasts vanish (a
    row's value is visible to all its elements), per-row tensors become `#abp.rows`
    arguments, and the whole direction — statistics, elementwise math and stores — is one
    kernel. `abp.share_saved` stays in the operator as an alias of the launch's output.

    Every output is a tensor of its own: a forward result that is an argument of the forward,
    or a value returned a second time, is first copied by an identity `abp.map`, which the
    kernel fuses (results that are not f32 tensors cannot be copied so and are refused).
  }];
}

def AbpMapThreads : Pass<"abp-map-threads", "::mlir::ModuleOp"> {
  let summary = "Chooses the thread mapping of every elementwise kernel";
  let description = [{
    Sets `chunk`, the consecutive elements one thread handles per grid-stride iteration, to the
    least common multiple of (a) 8 for every dense argument — one 128-bit vector at 16-bit
    dtypes, two at fp32 — and (b) 8 / gcd(bits, 8) for every packed argument, so a thread's codes
    fill whole bytes and no two threads write the same byte; and `block_size` (option). Indices
    are 64-bit and the last, partial chunk takes a bounds-checked scalar path (codegen).
    Row kernels use the same chunk along each row and record `warp_max_cols` (option).
  }];
  let options = [
    Option<"blockSize", "block-size", "int64_t", /*default=*/"256",
           "threads per block of every kernel">,
    Option<"warpMaxCols", "warp-max-cols", "int64_t", /*default=*/"1024",
           "row kernels: rows of at most this many elements are handled by one warp each "
           "(block-size / 32 rows per block), longer rows by one whole block">
  ];
}

#endif // ABP_PASSES_TD
