// Ops without a CUDA translation are reported at their location, naming what is supported.
// RUN: not abp-compile %s --emit=cuda 2>&1 | FileCheck %s

// CHECK: invalid-codegen.mlir:[[# @LINE + 5]]:10: error: 'math.sin' op has no translation in abp codegen (supported:
abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %s = math.sin %v : f32
    abp.yield %s : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
