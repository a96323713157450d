// Row sampling: abp.sample / abp.unsample, an operator's no_grad inputs (row indices and weights),
// and the kernel form (#abp.gathered reads, i32 #abp.rows inputs) round-trip.
// RUN: abp-opt %s | abp-opt | FileCheck %s

// CHECK-LABEL: abp.operator @keep_rows
// CHECK-SAME: no_grad = array<i64: 1, 2, 3>
// CHECK: abp.sample %{{.*}}, %{{.*}}, %{{.*}} : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
// CHECK: abp.unsample %{{.*}}, %{{.*}} : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
abp.operator @keep_rows attributes {no_grad = array<i64: 1, 2, 3>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>, %slot: tensor<?xi32>):
  %kept = abp.sample %x, %index, %weight
      : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return saves %kept, %slot : tensor<?x?xf32>, tensor<?xi32>
} backward {
^bb0(%kept: tensor<?x?xf32>, %slot: tensor<?xi32>):
  %x = abp.unsample %kept, %slot : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}

// Static shapes that agree are accepted.
// CHECK-LABEL: abp.operator @static
abp.operator @static attributes {no_grad = array<i64: 1, 2, 3>} forward {
^bb0(%x: tensor<8x4xf32>, %index: tensor<3xi32>, %weight: tensor<3xf32>, %slot: tensor<8xi32>):
  %kept = abp.sample %x, %index, %weight : tensor<8x4xf32>, tensor<3xi32>, tensor<3xf32> -> tensor<3x4xf32>
  abp.return saves %kept, %slot : tensor<3x4xf32>, tensor<8xi32>
} backward {
^bb0(%kept: tensor<3x4xf32>, %slot: tensor<8xi32>):
  %x = abp.unsample %kept, %slot : tensor<3x4xf32>, tensor<8xi32> -> tensor<8x4xf32>
  abp.return %x : tensor<8x4xf32>
}

// CHECK-LABEL: abp.kernel @gather
// CHECK-SAME: ins = [#abp.gathered<1>, #abp.rows, #abp.rows]
// CHECK: ^bb0(%{{.*}}: f32, %{{.*}}: i32, %{{.*}}: f32):
abp.kernel @gather attributes {ins = [#abp.gathered<1>, #abp.rows, #abp.rows], outs = [#abp.dense], rows} {
^bb0(%x: f32, %i: i32, %w: f32):
  %y = arith.mulf %x, %w : f32
  abp.yield %y : f32
}
