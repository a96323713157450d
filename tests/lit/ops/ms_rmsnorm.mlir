// ops/lowmembp/ms_rmsnorm.mlir: one reduction stage forward and backward, shared output saved.
// RUN: abp-compile %abp_src/ops/lowmembp/ms_rmsnorm.mlir --emit=kernel | FileCheck %s
// RUN: abp-compile %abp_src/ops/lowmembp/ms_rmsnorm.mlir --emit=cuda | FileCheck %s --check-prefix=CUDA
// CHECK: abp.kernel @ms_rmsnorm_fwd
// CHECK-SAME: outs = [#abp.rows, #abp.dense], rows
// CHECK: abp.kernel @ms_rmsnorm_bwd
// CHECK: abp.operator @ms_rmsnorm attributes {abp.saved_bits = 0 : i64, abp.saved_row_bits = 32 : i64
// CUDA: row kernel ms_rmsnorm_fwd: 1 reduction stage(s)
// CUDA: row kernel ms_rmsnorm_bwd: 1 reduction stage(s)
