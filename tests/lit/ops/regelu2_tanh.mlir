// ops/lowmembp/regelu2_tanh.mlir verifies and lowers to one forward kernel (the tanh-form GELU and
// the 2-bit code against the fitted borders, as fp32 constants) and one backward kernel (the level
// select times dy).
// RUN: abp-compile %abp_src/ops/lowmembp/regelu2_tanh.mlir --emit=kernel | FileCheck %s
// CHECK-LABEL: func.func private @activation
// CHECK: math.tanh
// CHECK-NOT: math.erf
// CHECK: abp.kernel @regelu2_tanh_fwd
// CHECK-SAME: outs = [#abp.dense, #abp.packed<2>]
// CHECK-DAG: arith.constant -3.16288018 : f32
// CHECK-DAG: arith.constant 3.16288018 : f32
// CHECK: arith.cmpf ogt
// CHECK: abp.kernel @regelu2_tanh_bwd
// CHECK-SAME: ins = [#abp.packed<2>, #abp.dense], outs = [#abp.dense]
// CHECK-DAG: arith.constant 1.04978609 : f32
// CHECK-DAG: arith.constant -0.0497861318 : f32
// CHECK: abp.operator @regelu2_tanh attributes {abp.saved_bits = 2 : i64, abp.schemes = [#{{.+}}]}
