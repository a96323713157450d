// RUN: abp-opt %s -split-input-file -abp-instantiate-variants | FileCheck %s

// The template keeps its own scheme; each variant gets its scheme and the matching code width.
// CHECK-DAG: #[[B1:.+]] = #abp.buckets<borders = [0.000000e+00], levels = [0.000000e+00, 1.000000e+00]>
// CHECK-DAG: #[[B2:.+]] = #abp.buckets<borders = [-1.000000e+00, 0.000000e+00, 1.000000e+00], levels = [0.000000e+00, 2.500000e-01, 7.500000e-01, 1.000000e+00]>
// CHECK-LABEL: abp.operator @act forward
// CHECK-NOT: variants
// CHECK: abp.quantize %{{.*}} {scheme = #[[B2]]} : tensor<?xf32> -> !abp.codes<2>
// CHECK: ^bb0(%{{.*}}: !abp.codes<2>, %{{.*}}: tensor<?xf32>):
// CHECK: abp.dequantize %{{.*}} {scheme = #[[B2]]} : !abp.codes<2> -> tensor<?xf32>
// CHECK-LABEL: abp.operator @act_b1 forward
// CHECK: abp.quantize %{{.*}} {scheme = #[[B1]]} : tensor<?xf32> -> !abp.codes<1>
// CHECK: abp.return %{{.*}} : tensor<?xf32> saves %{{.*}} : !abp.codes<1>
// CHECK: ^bb0(%{{.*}}: !abp.codes<1>, %{{.*}}: tensor<?xf32>):
// CHECK: abp.dequantize %{{.*}} {scheme = #[[B1]]} : !abp.codes<1> -> tensor<?xf32>
#b2 = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>
abp.operator @act variants {act_b1 = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} forward {
^bb0(%x: tensor<?xf32>):
  %c = abp.quantize %x {scheme = #b2} : tensor<?xf32> -> !abp.codes<2>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #b2} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %b : f32
    abp.yield %m : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// Operators without variants are left untouched.
// CHECK-LABEL: abp.operator @plain forward
// CHECK-NOT: abp.operator
abp.operator @plain forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
