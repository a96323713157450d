// ops/lowmembp/ms_layernorm.mlir lowers to one row kernel per direction, saves only its shared
// output and one value per row, and its kernels compile under NVRTC (shuffles, barriers, 128-bit
// loads).
// RUN: abp-compile %abp_src/ops/lowmembp/ms_layernorm.mlir --emit=kernel | FileCheck %s
// RUN: abp-compile %abp_src/ops/lowmembp/ms_layernorm.mlir --emit=ptx --arch=sm_90 | FileCheck %s --check-prefix=PTX
// CHECK: abp.kernel @ms_layernorm_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar], outs = [#abp.rows, #abp.dense], rows
// CHECK-COUNT-2: abp.reduce_rows mean
// CHECK: abp.kernel @ms_layernorm_bwd
// CHECK-SAME: ins = [#abp.dense, #abp.dense, #abp.rows], outs = [#abp.dense], rows
// CHECK: abp.operator @ms_layernorm attributes {abp.saved_bits = 0 : i64, abp.saved_row_bits = 32 : i64
// CHECK: abp.share_saved
// PTX: shfl.sync.bfly
// PTX: bar.sync
// PTX: ld.global.nc.v4
