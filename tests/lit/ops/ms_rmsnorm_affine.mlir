// ops/lowmembp/ms_rmsnorm_affine.mlir lowers, with a gain (and a bias) read per column, to one row
// kernel per direction; the gain's and the bias's gradients are column sums after the backward
// launch, the per-column inputs are saved as they are (no bytes per row beyond 1/σ), and the
// kernels compile under NVRTC.
// RUN: abp-compile %abp_src/ops/lowmembp/ms_rmsnorm_affine.mlir --emit=kernel | FileCheck %s
// RUN: abp-compile %abp_src/ops/lowmembp/ms_rmsnorm_affine.mlir --emit=ptx --arch=sm_90 | FileCheck %s --check-prefix=PTX
// CHECK: abp.kernel @ms_rmsnorm_affine_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar, #abp.cols, #abp.cols, #abp.scalar], outs = [#abp.rows, #abp.dense], rows
// CHECK: abp.kernel @ms_rmsnorm_affine_bwd
// CHECK-SAME: ins = [#abp.cols, #abp.cols, #abp.dense, #abp.scalar, #abp.dense, #abp.rows], outs = [#abp.dense, #abp.dense], rows
// CHECK: abp.operator @ms_rmsnorm_affine attributes {abp.saved_bits = 0 : i64, abp.saved_row_bits = 32 : i64, params = ["eps", "offset"]}
// CHECK: abp.launch @ms_rmsnorm_affine_fwd
// CHECK-NOT: abp.launch
// CHECK: abp.return %{{.*}}#1 : tensor<?x?xf32> saves %{{.*}}, %{{.*}}#0, %arg1, %arg2, %arg4
// CHECK: %[[L:.*]]:2 = abp.launch @ms_rmsnorm_affine_bwd
// CHECK-NEXT: %[[DW:.*]] = abp.reduce_cols sum %[[L]]#1
// CHECK-NEXT: %[[DB:.*]] = abp.reduce_cols sum %arg5
// CHECK-NEXT: abp.return %[[L]]#0, %[[DW]], %[[DB]]
// CHECK: abp.kernel @ms_rmsnorm_gain_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar, #abp.cols, #abp.scalar], outs = [#abp.rows, #abp.dense], rows
// CHECK: abp.kernel @ms_rmsnorm_gain_bwd
// CHECK-SAME: outs = [#abp.dense, #abp.dense], rows
// CHECK: abp.operator @ms_rmsnorm_gain attributes {abp.saved_bits = 0 : i64, abp.saved_row_bits = 32 : i64
// CHECK: %[[G:.*]]:2 = abp.launch @ms_rmsnorm_gain_bwd
// CHECK-NEXT: %[[DG:.*]] = abp.reduce_cols sum %[[G]]#1
// CHECK-NEXT: abp.return %[[G]]#0, %[[DG]]
// PTX: shfl.sync.bfly
// PTX: ld.global.nc.v4
