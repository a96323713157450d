// ops/lowmembp/regelu2.mlir verifies and lowers to one forward and one backward kernel with 2-bit codes.
// RUN: abp-compile %abp_src/ops/lowmembp/regelu2.mlir --emit=kernel | FileCheck %s
// CHECK: abp.kernel @regelu2_fwd
// CHECK-SAME: outs = [#abp.dense, #abp.packed<2>]
// CHECK: abp.kernel @regelu2_bwd
// CHECK-SAME: ins = [#abp.packed<2>, #abp.dense], outs = [#abp.dense]
// CHECK: abp.operator @regelu2 attributes {abp.saved_bits = 2 : i64, abp.schemes = [#{{.+}}]}
