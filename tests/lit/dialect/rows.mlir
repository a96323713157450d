// Row ops and share_saved print in a form that parses back to the same IR.
// RUN: abp-opt %s | abp-opt | FileCheck %s

// CHECK-LABEL: abp.operator @rms
// CHECK: %[[S:.*]] = abp.reduce_rows mean %{{.*}} : tensor<?x?xf32> -> tensor<?xf32>
// CHECK: %[[B:.*]] = abp.broadcast_rows %{{.*}} : tensor<?xf32> -> tensor<?x?xf32>
// CHECK: %[[Y:.*]] = abp.map
// CHECK: %[[Z:.*]] = abp.share_saved %[[Y]] : tensor<?x?xf32>
// CHECK: abp.return %[[Y]] : tensor<?x?xf32> saves %[[Z]], %{{.*}} : tensor<?x?xf32>, tensor<?xf32>
// CHECK: abp.reduce_rows sum %{{.*}} : tensor<?x?xf32> -> tensor<?xf32>
abp.operator @rms forward {
^bb0(%x: tensor<?x?xf32>):
  %sq = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  %ms = abp.reduce_rows mean %sq : tensor<?x?xf32> -> tensor<?xf32>
  %r = abp.map(%ms) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %q = math.rsqrt %v : f32
    abp.yield %q : f32
  }
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%x, %rb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %q: f32):
    %p = arith.mulf %a, %q : f32
    abp.yield %p : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  abp.return %y : tensor<?x?xf32> saves %ys, %r : tensor<?x?xf32>, tensor<?xf32>
} backward {
^bb0(%y: tensor<?x?xf32>, %r: tensor<?xf32>, %g: tensor<?x?xf32>):
  %t = abp.reduce_rows sum %g : tensor<?x?xf32> -> tensor<?xf32>
  %tb = abp.broadcast_rows %t : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%g, %y, %tb, %rb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %c: f32, %q: f32):
    %u = arith.mulf %b, %c : f32
    %v = arith.subf %a, %u : f32
    %w = arith.mulf %q, %v : f32
    abp.yield %w : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
