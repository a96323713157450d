// A reduction of a value that is already row-uniform is reported at its location.
// RUN: not abp-compile %s --emit=cuda 2>&1 | FileCheck %s

// CHECK: invalid-codegen-rows-reduce.mlir:[[# @LINE + 3]]:8: error: 'abp.reduce_rows' op reduces a value that is already the same for the whole row
abp.kernel @reduce_uniform attributes {ins = [#abp.dense, #abp.rows], outs = [#abp.dense], rows} {
^bb0(%x: f32, %r: f32):
  %s = abp.reduce_rows sum %r : f32 -> f32
  %y = arith.mulf %x, %s : f32
  abp.yield %y : f32
}
