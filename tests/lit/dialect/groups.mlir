// Per-group affine quantization (GACT): i64 seed/offset parameters, abp.uniform, the group codec
// ops, and their kernel forms (i64 scalars and packed codes in a row kernel) round-trip.
// RUN: abp-opt %s | abp-opt | FileCheck %s

// CHECK-LABEL: abp.operator @codec
// CHECK: ^bb0(%{{.*}}: tensor<?x?xf32>, %[[SEED:.*]]: i64, %[[OFF:.*]]: i64):
// CHECK: abp.quantize_groups %{{.*}}, %[[SEED]], %[[OFF]] : tensor<?x?xf32>, i64, i64 -> !abp.codes<4>, tensor<?xf32>, tensor<?xf32>
// CHECK: abp.dequantize_groups %{{.*}}, %{{.*}}, %{{.*}} : !abp.codes<4>, tensor<?xf32>, tensor<?xf32> -> tensor<?x?xf32>
abp.operator @codec forward {
^bb0(%x: tensor<?x?xf32>, %seed: i64, %offset: i64):
  %c, %m, %s = abp.quantize_groups %x, %seed, %offset
      : tensor<?x?xf32>, i64, i64 -> !abp.codes<4>, tensor<?xf32>, tensor<?xf32>
  abp.return saves %c, %m, %s : !abp.codes<4>, tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<4>, %m: tensor<?xf32>, %s: tensor<?xf32>):
  %x = abp.dequantize_groups %c, %m, %s
      : !abp.codes<4>, tensor<?xf32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}

// CHECK-LABEL: abp.operator @noise
// CHECK: abp.uniform %{{.*}}, %{{.*}} : i64, i64 -> tensor<?x?xf32>
abp.operator @noise forward {
^bb0(%x: tensor<?x?xf32>, %seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?x?xf32>
  %y = abp.map(%x, %u) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.addf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %y : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// CHECK-LABEL: abp.kernel @draw_codes
// CHECK: ^bb0(%{{.*}}: f32, %[[S:.*]]: i64, %[[O:.*]]: i64):
// CHECK: abp.uniform %[[S]], %[[O]] : i64, i64 -> f32
// The 16-bit draws print their width; the default (24) prints nothing.
// CHECK: abp.uniform %[[S]], %[[O]] {bits = 16 : i32} : i64, i64 -> f32
abp.kernel @draw_codes attributes {ins = [#abp.dense, #abp.scalar, #abp.scalar], outs = [#abp.packed<2>], rows} {
^bb0(%x: f32, %seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> f32
  %h = abp.uniform %seed, %offset {bits = 16 : i32} : i64, i64 -> f32
  %w = arith.addf %u, %h : f32
  %s = arith.addf %x, %w : f32
  %c = arith.fptoui %s : f32 to i8
  abp.yield %c : i8
}
