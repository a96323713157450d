// ops/fewbit/gelu_tanh.mlir verifies, instantiates its 1..4-bit operators for both weightings, and
// lowers each to one forward kernel (dense + packed codes) and one backward kernel; the forward is
// the tanh form.
// RUN: abp-compile %abp_src/ops/fewbit/gelu_tanh.mlir --emit=kernel | FileCheck %s
// CHECK-LABEL: func.func private @activation
// CHECK: math.tanh
// CHECK-NOT: math.erf
// CHECK-DAG: abp.kernel @gelu_tanh_b1_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<1>]
// CHECK-DAG: abp.kernel @gelu_tanh_b2_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<2>]
// CHECK-DAG: abp.kernel @gelu_tanh_b3_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<3>]
// CHECK-DAG: abp.kernel @gelu_tanh_b4_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<4>]
// CHECK-DAG: abp.kernel @gelu_tanh_b1_uniform_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<1>]
// CHECK-DAG: abp.kernel @gelu_tanh_b4_uniform_bwd attributes {{.*}}ins = [#abp.packed<4>, #abp.dense], outs = [#abp.dense]
// CHECK-DAG: abp.operator @gelu_tanh_b1 attributes {abp.saved_bits = 1 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b2 attributes {abp.saved_bits = 2 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b3 attributes {abp.saved_bits = 3 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b4 attributes {abp.saved_bits = 4 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b1_uniform attributes {abp.saved_bits = 1 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b2_uniform attributes {abp.saved_bits = 2 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b3_uniform attributes {abp.saved_bits = 3 : i64
// CHECK-DAG: abp.operator @gelu_tanh_b4_uniform attributes {abp.saved_bits = 4 : i64
