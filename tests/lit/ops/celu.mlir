// ops/fewbit/celu.mlir verifies, instantiates its 1..4-bit operators for both weightings, and
// lowers each to one forward kernel (dense + packed codes) and one backward kernel.
// RUN: abp-compile %abp_src/ops/fewbit/celu.mlir --emit=kernel | FileCheck %s
// CHECK-DAG: abp.kernel @celu_b1_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<1>]
// CHECK-DAG: abp.kernel @celu_b2_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<2>]
// CHECK-DAG: abp.kernel @celu_b3_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<3>]
// CHECK-DAG: abp.kernel @celu_b4_fwd attributes {{.*}}outs = [#abp.dense, #abp.packed<4>]
// CHECK-DAG: abp.kernel @celu_b4_uniform_bwd attributes {{.*}}ins = [#abp.packed<4>, #abp.dense], outs = [#abp.dense]
// CHECK-DAG: abp.operator @celu_b1 attributes {abp.saved_bits = 1 : i64
// CHECK-DAG: abp.operator @celu_b3 attributes {abp.saved_bits = 3 : i64
// CHECK-DAG: abp.operator @celu_b1_uniform attributes {abp.saved_bits = 1 : i64
// CHECK-DAG: abp.operator @celu_b4_uniform attributes {abp.saved_bits = 4 : i64
