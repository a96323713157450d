// RUN: abp-opt %s -split-input-file -abp-fuse-kernels | FileCheck %s

// A per-tensor absmax scale: the reduction gets its own total kernel, which recomputes |x| (the
// map only it used is gone from the direction); the direction's kernel reads the result as
// #abp.total, and so does backward, which receives it as a saved f32.

// CHECK-LABEL: abp.kernel @absmax_fwd_total0
// CHECK-SAME: ins = [#abp.dense], outs = [#abp.total], total = 2 : i32
// CHECK: math.absf
// CHECK: abp.kernel @absmax_fwd attributes {ins = [#abp.dense, #abp.total], outs = [#abp.packed<8>, #abp.dense]}
// CHECK-NOT: math.absf
// CHECK: abp.kernel @absmax_bwd attributes {ins = [#abp.packed<8>, #abp.total, #abp.dense], outs = [#abp.dense]}
// CHECK: forward
// CHECK: %[[T:.*]] = abp.launch @absmax_fwd_total0(%{{.*}}) : (tensor<?xf32>) -> f32
// CHECK: abp.launch @absmax_fwd(%{{.*}}, %[[T]])
// CHECK: abp.return {{.*}} saves {{.*}}, %[[T]] : !abp.codes<8>, f32
abp.operator @absmax forward {
^bb0(%x: tensor<?xf32>):
  %ax = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %a = math.absf %v : f32
    abp.yield %a : f32
  }
  %m = abp.reduce_tensor max %ax : tensor<?xf32> -> f32
  %c = abp.map(%x, %m) : (tensor<?xf32>, f32) -> tensor<?xi8> {
  ^bb0(%v: f32, %s: f32):
    %q = arith.divf %v, %s : f32
    %i = arith.fptosi %q : f32 to i8
    abp.yield %i : i8
  }
  %p = abp.pack %c : tensor<?xi8> -> !abp.codes<8>
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    abp.yield %v : f32
  }
  abp.return %y : tensor<?xf32> saves %p, %m : !abp.codes<8>, f32
} backward {
^bb0(%p: !abp.codes<8>, %m: f32, %g: tensor<?xf32>):
  %c = abp.unpack %p : !abp.codes<8> -> tensor<?xi8>
  %dx = abp.map(%c, %m, %g) : (tensor<?xi8>, f32, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%i: i8, %s: f32, %d: f32):
    %f = arith.sitofp %i : i8 to f32
    %r = arith.mulf %f, %s : f32
    %o = arith.mulf %r, %d : f32
    abp.yield %o : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// Reductions in sequence: the variance about the mean needs the mean first, so its total kernel
// reads the first one's result; both run before the direction's kernel, in order.

// CHECK-LABEL: abp.kernel @centred_fwd_total0
// CHECK-SAME: ins = [#abp.dense], outs = [#abp.total], total = 1 : i32
// CHECK-LABEL: abp.kernel @centred_fwd_total1
// CHECK-SAME: ins = [#abp.dense, #abp.total], outs = [#abp.total], total = 1 : i32
// CHECK: abp.kernel @centred_fwd attributes {ins = [#abp.dense, #abp.total, #abp.total], outs = [#abp.dense]}
// CHECK: %[[M:.*]] = abp.launch @centred_fwd_total0(%arg0)
// CHECK: %[[V:.*]] = abp.launch @centred_fwd_total1(%arg0, %[[M]])
// CHECK: abp.launch @centred_fwd(%arg0, %[[M]], %[[V]])
abp.operator @centred forward {
^bb0(%x: tensor<?x?xf32>):
  %m = abp.reduce_tensor mean %x : tensor<?x?xf32> -> f32
  %d2 = abp.map(%x, %m) : (tensor<?x?xf32>, f32) -> tensor<?x?xf32> {
  ^bb0(%v: f32, %mu: f32):
    %d = arith.subf %v, %mu : f32
    %s = arith.mulf %d, %d : f32
    abp.yield %s : f32
  }
  %var = abp.reduce_tensor mean %d2 : tensor<?x?xf32> -> f32
  %y = abp.map(%x, %m, %var) : (tensor<?x?xf32>, f32, f32) -> tensor<?x?xf32> {
  ^bb0(%v: f32, %mu: f32, %s: f32):
    %d = arith.subf %v, %mu : f32
    %r = math.rsqrt %s : f32
    %o = arith.mulf %d, %r : f32
    abp.yield %o : f32
  }
  abp.return %y : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

// The same reduction of the same value twice runs once.

// CHECK-LABEL: abp.kernel @twice_fwd_total0
// CHECK-NOT: abp.kernel @twice_fwd_total1
// CHECK: abp.kernel @twice_fwd attributes {ins = [#abp.dense, #abp.total], outs = [#abp.dense]}
// CHECK: %[[M:.*]] = abp.launch @twice_fwd_total0(%arg0)
// CHECK-NEXT: abp.launch @twice_fwd(%arg0, %[[M]])
abp.operator @twice forward {
^bb0(%x: tensor<?xf32>):
  %a = abp.reduce_tensor min %x : tensor<?xf32> -> f32
  %b = abp.reduce_tensor min %x : tensor<?xf32> -> f32
  %y = abp.map(%x, %a, %b) : (tensor<?xf32>, f32, f32) -> tensor<?xf32> {
  ^bb0(%v: f32, %p: f32, %q: f32):
    %d = arith.subf %v, %p : f32
    %e = arith.subf %d, %q : f32
    abp.yield %e : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}
