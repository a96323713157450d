// Row kernels whose values cannot be placed are reported at their location.
// RUN: not abp-compile %s --emit=cuda 2>&1 | FileCheck %s

// CHECK: invalid-codegen-rows.mlir:[[# @LINE + 5]]:3: error: 'abp.yield' op yields a per-element value to #abp.rows output #0
abp.kernel @per_element_to_rows attributes {ins = [#abp.dense], outs = [#abp.rows], rows} {
^bb0(%x: f32):
  %one = arith.constant 1.0 : f32
  %y = arith.addf %x, %one : f32
  abp.yield %y : f32
}
