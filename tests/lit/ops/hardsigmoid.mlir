// ops/fewbit/hardsigmoid.mlir verifies and lowers to one forward and one backward kernel with a 1-bit mask.
// RUN: abp-compile %abp_src/ops/fewbit/hardsigmoid.mlir --emit=kernel | FileCheck %s
// CHECK: abp.kernel @hardsigmoid_fwd
// CHECK-SAME: outs = [#abp.dense, #abp.packed<1>]
// CHECK: abp.kernel @hardsigmoid_bwd
// CHECK-SAME: ins = [#abp.packed<1>, #abp.dense{{.*}}], outs = [#abp.dense]
// CHECK: abp.operator @hardsigmoid attributes {{.*}}abp.saved_bits = 1 : i64
