// RUN: abp-opt %s -abp-verify-residuals -abp-fuse-kernels | FileCheck %s

// A direction with row reductions becomes one row kernel: the reduction stays in the body as a
// per-element -> per-row f32 op, broadcasts vanish, per-row tensors become #abp.rows arguments,
// and share_saved stays in the operator as an alias of the launch's output.
// CHECK-LABEL: abp.kernel @rms_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar], outs = [#abp.rows, #abp.dense], rows
// CHECK: ^bb0(%[[X:.*]]: f32, %[[EPS:.*]]: f32):
// CHECK: %[[SQ:.*]] = arith.mulf %[[X]], %[[X]] : f32
// CHECK: %[[MS:.*]] = abp.reduce_rows mean %[[SQ]] : f32 -> f32
// CHECK: %[[V:.*]] = arith.addf %[[MS]], %[[EPS]] : f32
// CHECK: %[[R:.*]] = math.rsqrt %[[V]] : f32
// CHECK: %[[Y:.*]] = arith.mulf %[[X]], %[[R]] : f32
// CHECK: abp.yield %[[R]], %[[Y]] : f32, f32
// CHECK-LABEL: abp.kernel @rms_bwd
// CHECK-SAME: ins = [#abp.dense, #abp.dense, #abp.rows], outs = [#abp.dense], rows
// CHECK: abp.reduce_rows mean %{{.*}} : f32 -> f32
// CHECK-LABEL: abp.operator @rms
// CHECK-SAME: abp.saved_bits = 0 : i64, abp.saved_row_bits = 32 : i64
// CHECK: %[[L:.*]]:2 = abp.launch @rms_fwd(%{{.*}}, %{{.*}}) : (tensor<?x?xf32>, f32) -> (tensor<?xf32>, tensor<?x?xf32>)
// CHECK: %[[S:.*]] = abp.share_saved %[[L]]#1 : tensor<?x?xf32>
// CHECK: abp.return %[[L]]#1 : tensor<?x?xf32> saves %[[S]], %[[L]]#0 : tensor<?x?xf32>, tensor<?xf32>
// CHECK: abp.launch @rms_bwd
// CHECK-NOT: abp.broadcast_rows
abp.operator @rms forward {
^bb0(%x: tensor<?x?xf32>, %eps: f32):
  %sq = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  %ms = abp.reduce_rows mean %sq : tensor<?x?xf32> -> tensor<?xf32>
  %r = abp.map(%ms) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %ve = arith.addf %v, %eps : f32
    %q = math.rsqrt %ve : f32
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
  %gy = abp.map(%g, %y) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.mulf %a, %b : f32
    abp.yield %p : f32
  }
  %m = abp.reduce_rows mean %gy : tensor<?x?xf32> -> tensor<?xf32>
  %mb = abp.broadcast_rows %m : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%g, %y, %mb, %rb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %c: f32, %q: f32):
    %u = arith.mulf %b, %c : f32
    %v = arith.subf %a, %u : f32
    %w = arith.mulf %q, %v : f32
    abp.yield %w : f32
  }
  abp.return %dx : tensor<?x?xf32>
}

// Packed codes enter and leave row kernels, i64 parameters become #abp.scalar arguments of
// type i64, and abp.uniform becomes the element's f32 draw. The returned argument is copied
// (every output a tensor of its own): the last output.
// CHECK-LABEL: abp.kernel @coded_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar, #abp.scalar], outs = [#abp.rows, #abp.packed<8>, #abp.dense], rows
// CHECK: ^bb0(%{{.*}}: f32, %[[SEED:.*]]: i64, %[[OFF:.*]]: i64):
// CHECK: abp.uniform %[[SEED]], %[[OFF]] : i64, i64 -> f32
// CHECK-LABEL: abp.kernel @coded_bwd
// CHECK-SAME: ins = [#abp.packed<8>, #abp.rows, #abp.dense], outs = [#abp.dense], rows
abp.operator @coded forward {
^bb0(%x: tensor<?x?xf32>, %seed: i64, %offset: i64):
  %m = abp.reduce_rows max %x : tensor<?x?xf32> -> tensor<?xf32>
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?x?xf32>
  %q = abp.map(%x, %u) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xi8> {
  ^bb0(%a: f32, %r: f32):
    %s = arith.addf %a, %r : f32
    %c = arith.fptoui %s : f32 to i8
    abp.yield %c : i8
  }
  %c = abp.pack %q : tensor<?x?xi8> -> !abp.codes<8>
  abp.return %x : tensor<?x?xf32> saves %c, %m : !abp.codes<8>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<8>, %m: tensor<?xf32>, %g: tensor<?x?xf32>):
  %q = abp.unpack %c : !abp.codes<8> -> tensor<?x?xi8>
  %mb = abp.broadcast_rows %m : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%q, %mb, %g) : (tensor<?x?xi8>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%k: i8, %v: f32, %d: f32):
    %f = arith.uitofp %k : i8 to f32
    %p = arith.mulf %f, %v : f32
    %r = arith.mulf %p, %d : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
