// RUN: abp-opt %s -split-input-file -abp-verify-residuals | FileCheck %s

// Saved bits per element: 2-bit codes; the f32 parameter costs no per-element bits.
// CHECK-LABEL: abp.operator @mixed
// CHECK-SAME: abp.saved_bits = 2 : i64
abp.operator @mixed forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  abp.return %x : tensor<?xf32> saves %c, %s : !abp.codes<2>, f32
} backward {
^bb0(%c: !abp.codes<2>, %s: f32, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %b : f32
    %r = arith.mulf %m, %s : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// An operator that saves nothing keeps 0 bits per element.
// CHECK-LABEL: abp.operator @identity
// CHECK-SAME: abp.saved_bits = 0 : i64
abp.operator @identity forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// A saved f32 tensor counts 32 bits.
// CHECK-LABEL: abp.operator @exact
// CHECK-SAME: abp.saved_bits = 32 : i64
abp.operator @exact forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32> saves %x : tensor<?xf32>
} backward {
^bb0(%x: tensor<?xf32>, %dy: tensor<?xf32>):
  %dx = abp.map(%x, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %b : f32
    abp.yield %m : f32
  }
  abp.return %dx : tensor<?xf32>
}
