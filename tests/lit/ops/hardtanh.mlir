// ops/fewbit/hardtanh.mlir verifies and lowers to one forward and one backward kernel with a 1-bit mask.
// RUN: abp-compile %abp_src/ops/fewbit/hardtanh.mlir --emit=kernel | FileCheck %s
// CHECK: abp.kernel @hardtanh_fwd
// CHECK-SAME: outs = [#abp.dense, #abp.packed<1>]
// CHECK: abp.kernel @hardtanh_bwd
// CHECK-SAME: ins = [#abp.packed<1>, #abp.dense{{.*}}], outs = [#abp.dense]
// CHECK: abp.operator @hardtanh attributes {{.*}}abp.saved_bits = 1 : i64
