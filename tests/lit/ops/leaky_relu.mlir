// ops/fewbit/leaky_relu.mlir verifies and lowers to one forward and one backward kernel with a 1-bit mask.
// RUN: abp-compile %abp_src/ops/fewbit/leaky_relu.mlir --emit=kernel | FileCheck %s
// CHECK: abp.kernel @leaky_relu_fwd
// CHECK-SAME: outs = [#abp.dense, #abp.packed<1>]
// CHECK: abp.kernel @leaky_relu_bwd
// CHECK-SAME: ins = [#abp.packed<1>, #abp.dense{{.*}}], outs = [#abp.dense]
// CHECK: abp.operator @leaky_relu attributes {{.*}}abp.saved_bits = 1 : i64
