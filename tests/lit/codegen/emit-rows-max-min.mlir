// Row maxima and minima: the sweep combines with abp::reduceCombine, whose NaN-propagating
// maximum is one instruction per element from sm_80 on (max.NaN / min.NaN) and the IEEE
// compare-and-select below it; the stage then fixes the result's NaN and zero once per row
// (abp::reduceResult), so every device stores the same bits. Sums are taken as they are.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=ptx --arch=sm_80 -o %t80.ptx && FileCheck %s --check-prefix=SM80 --input-file %t80.ptx
// RUN: abp-compile %s --emit=ptx --arch=sm_75 -o %t75.ptx && FileCheck %s --check-prefix=SM75 --input-file %t75.ptx --implicit-check-not=max.NaN --implicit-check-not=min.NaN
// RUN: abp-compile %s --emit=host -o %t.so

// CHECK: ABP_FN void range_fwd_stage1(range_fwd_uniforms<C> &u, const C *sums, abp::i64 cols) {
// CHECK-DAG: = abp::reduceResult<C>(abp::kReduceMax, sums[{{[0-9]}}]);
// CHECK-DAG: = abp::reduceResult<C>(abp::kReduceMin, sums[{{[0-9]}}]);
// CHECK-DAG: = sums[{{[0-9]}}];
// CHECK: acc[{{[0-9]}}] = abp::reduceCombine(abp::kReduceMax,

// SM80-LABEL: .entry abp_range_fwd_f32_
// SM80-DAG: max.NaN.f32
// SM80-DAG: min.NaN.f32
// SM80-LABEL: .entry abp_range_fwd_f64_
// SM80-NOT: max.NaN
// SM80: ret;

// SM75: .entry abp_range_fwd_f32_
// SM75: .entry abp_range_fwd_f64_

abp.operator @range forward {
^bb0(%x: tensor<?x?xf32>):
  %hi = abp.reduce_rows max %x : tensor<?x?xf32> -> tensor<?xf32>
  %lo = abp.reduce_rows min %x : tensor<?x?xf32> -> tensor<?xf32>
  %total = abp.reduce_rows sum %x : tensor<?x?xf32> -> tensor<?xf32>
  %width = abp.map(%hi, %lo, %total) : (tensor<?xf32>, tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%h: f32, %l: f32, %t: f32):
    %d = arith.subf %h, %l : f32
    %w = arith.addf %d, %t : f32
    abp.yield %w : f32
  }
  abp.return %width : tensor<?xf32>
} backward {
^bb0(%dw: tensor<?xf32>):
  %dx = abp.broadcast_rows %dw : tensor<?xf32> -> tensor<?x?xf32>
  abp.return %dx : tensor<?x?xf32>
}
