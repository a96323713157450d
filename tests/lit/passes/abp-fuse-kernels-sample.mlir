// RUN: abp-opt %s -split-input-file -abp-fuse-kernels | FileCheck %s

// abp.sample becomes a row kernel that reads its matrix through the index (#abp.gathered<by>,
// by = the index's position among the kernel's inputs), takes the index as an i32 #abp.rows
// input and scales each element by its row's weight; a fused map follows on the kept rows.
// CHECK-LABEL: abp.kernel @keep_fwd
// CHECK-SAME: ins = [#abp.gathered<1>, #abp.rows, #abp.rows], outs = [#abp.dense], rows
// CHECK: ^bb0(%[[X:.*]]: f32, %{{.*}}: i32, %[[W:.*]]: f32):
// CHECK: %[[S:.*]] = arith.mulf %[[X]], %[[W]] : f32
// CHECK: %[[Q:.*]] = arith.mulf %[[S]], %[[S]] : f32
// CHECK: abp.yield %[[Q]] : f32
// abp.unsample reads its kept rows through the slot; the zero rows come from the gathered read.
// CHECK-LABEL: abp.kernel @keep_bwd
// CHECK-SAME: ins = [#abp.gathered<1>, #abp.rows], outs = [#abp.dense], rows
// CHECK: ^bb0(%[[K:.*]]: f32, %{{.*}}: i32):
// CHECK-NEXT: abp.yield %[[K]] : f32
// CHECK-LABEL: abp.operator @keep
// CHECK: abp.launch @keep_fwd(%{{.*}}, %{{.*}}, %{{.*}}) : (tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32>) -> tensor<?x?xf32>
// CHECK: abp.launch @keep_bwd(%{{.*}}, %{{.*}}) : (tensor<?x?xf32>, tensor<?xi32>) -> tensor<?x?xf32>
abp.operator @keep attributes {no_grad = array<i64: 1, 2, 3>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>, %slot: tensor<?xi32>):
  %kept = abp.sample %x, %index, %weight
      : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
  %sq = abp.map(%kept) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  abp.return saves %sq, %slot : tensor<?x?xf32>, tensor<?xi32>
} backward {
^bb0(%kept: tensor<?x?xf32>, %slot: tensor<?xi32>):
  %x = abp.unsample %kept, %slot : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}
