// RUN: abp-opt %s -split-input-file -abp-fuse-kernels | FileCheck %s

// Forward: a map, a code map and a pack become one kernel reading x once and writing y and the
// packed codes; the intermediate i8 tensor never leaves registers. Backward: unpack + map fuse
// the same way. A captured f32 parameter becomes a #abp.scalar argument.
// CHECK-LABEL: abp.kernel @f_fwd
// CHECK-SAME: ins = [#abp.dense], outs = [#abp.dense, #abp.packed<1>]
// CHECK: ^bb0(%[[X:.*]]: f32):
// CHECK: %[[Y:.*]] = arith.mulf %[[X]], %[[X]] : f32
// CHECK: %[[Z:.*]] = arith.constant 0.000000e+00 : f32
// CHECK: %[[B:.*]] = arith.cmpf ogt, %[[X]], %[[Z]] : f32
// CHECK: %[[C:.*]] = arith.extui %[[B]] : i1 to i8
// CHECK: abp.yield %[[Y]], %[[C]] : f32, i8
// CHECK-LABEL: abp.kernel @f_bwd
// CHECK-SAME: ins = [#abp.packed<1>, #abp.dense, #abp.scalar], outs = [#abp.dense]
// CHECK: ^bb0(%[[CODE:.*]]: i8, %[[G:.*]]: f32, %[[S:.*]]: f32):
// CHECK: %[[F:.*]] = arith.uitofp %[[CODE]] : i8 to f32
// CHECK: %[[M:.*]] = arith.mulf %[[F]], %[[G]] : f32
// CHECK: %[[R:.*]] = arith.mulf %[[M]], %[[S]] : f32
// CHECK: abp.yield %[[R]] : f32
// CHECK-LABEL: abp.operator @f
// CHECK: %[[L:.*]]:2 = abp.launch @f_fwd(%{{.*}}) : (tensor<?xf32>) -> (tensor<?xf32>, !abp.codes<1>)
// CHECK: abp.return %[[L]]#0 : tensor<?xf32> saves %[[L]]#1, %{{.*}} : !abp.codes<1>, f32
// CHECK: %[[D:.*]] = abp.launch @f_bwd(%{{.*}}, %{{.*}}, %{{.*}}) : (!abp.codes<1>, tensor<?xf32>, f32) -> tensor<?xf32>
// CHECK: abp.return %[[D]] : tensor<?xf32>
// CHECK-NOT: abp.map
func.func private @sq(%x: f32) -> f32 {
  %y = arith.mulf %x, %x : f32
  return %y : f32
}
abp.operator @f forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  %y = abp.map @sq(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %m = abp.map(%x) : (tensor<?xf32>) -> tensor<?xi8> {
  ^bb0(%v: f32):
    %z = arith.constant 0.0 : f32
    %b = arith.cmpf ogt, %v, %z : f32
    %e = arith.extui %b : i1 to i8
    abp.yield %e : i8
  }
  %c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>
  abp.return %y : tensor<?xf32> saves %c, %s : !abp.codes<1>, f32
} backward {
^bb0(%c: !abp.codes<1>, %s: f32, %dy: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>
  %dx = abp.map(%m, %dy) : (tensor<?xi8>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%b: i8, %g: f32):
    %f = arith.uitofp %b : i8 to f32
    %r = arith.mulf %f, %g : f32
    %t = arith.mulf %r, %s : f32
    abp.yield %t : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// A direction with no elementwise work (identity backward) gets no kernel.
// CHECK-LABEL: abp.kernel @id_fwd
// CHECK-NOT: abp.kernel @id_bwd
// CHECK: abp.operator @id
abp.operator @id forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    abp.yield %v : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// A parameter given to a map as an input (not captured) is a #abp.scalar argument as well; the
// callee's body, inlined, reads it as its scalar argument.
// CHECK-LABEL: abp.kernel @scaled_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar], outs = [#abp.dense]
// CHECK: ^bb0(%[[X:.*]]: f32, %[[S:.*]]: f32):
// CHECK: %[[Y:.*]] = arith.mulf %[[X]], %[[S]] : f32
// CHECK: abp.yield %[[Y]] : f32
// CHECK-LABEL: abp.kernel @scaled_bwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar], outs = [#abp.dense]
// CHECK: ^bb0(%[[G:.*]]: f32, %[[T:.*]]: f32):
// CHECK: %[[D:.*]] = arith.mulf %[[G]], %[[T]] : f32
// CHECK: abp.yield %[[D]] : f32
func.func private @scale(%x: f32, %s: f32) -> f32 {
  %y = arith.mulf %x, %s : f32
  return %y : f32
}
abp.operator @scaled attributes {params = ["slope"]} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  %y = abp.map @scale(%x, %s) : (tensor<?xf32>, f32) -> tensor<?xf32>
  abp.return %y : tensor<?xf32> saves %s : f32
} backward {
^bb0(%s: f32, %dy: tensor<?xf32>):
  %dx = abp.map(%dy, %s) : (tensor<?xf32>, f32) -> tensor<?xf32> {
  ^bb0(%g: f32, %t: f32):
    %d = arith.mulf %g, %t : f32
    abp.yield %d : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// Callees are inlined into the kernel, through every level of calls and from region bodies too,
// so a kernel's code does not depend on how its maths were split into functions.
// CHECK-LABEL: abp.kernel @nested_fwd
// CHECK: ^bb0(%[[X:.*]]: f32):
// CHECK-NOT: func.call
// CHECK: %[[SQ:.*]] = arith.mulf %[[X]], %[[X]] : f32
// CHECK: %[[P:.*]] = arith.addf %[[SQ]], %[[X]] : f32
// CHECK: %[[N:.*]] = arith.negf %[[P]] : f32
// CHECK: %[[SQ2:.*]] = arith.mulf %[[N]], %[[N]] : f32
// CHECK: %[[E:.*]] = math.exp %[[SQ2]] : f32
// CHECK: abp.yield %[[N]], %[[E]] : f32, f32
// CHECK-LABEL: abp.operator @nested
func.func private @square(%x: f32) -> f32 {
  %y = arith.mulf %x, %x : f32
  return %y : f32
}
func.func private @square_plus(%x: f32) -> f32 {
  %s = func.call @square(%x) : (f32) -> f32
  %y = arith.addf %s, %x : f32
  return %y : f32
}
func.func private @negated(%x: f32) -> f32 {
  %p = func.call @square_plus(%x) : (f32) -> f32
  %n = arith.negf %p : f32
  return %n : f32
}
abp.operator @nested forward {
^bb0(%x: tensor<?xf32>):
  %n = abp.map @negated(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %e = abp.map(%n) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %s = func.call @square(%v) : (f32) -> f32
    %r = math.exp %s : f32
    abp.yield %r : f32
  }
  abp.return %n, %e : tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%dn: tensor<?xf32>, %de: tensor<?xf32>):
  abp.return %dn : tensor<?xf32>
}

// -----

// A chain of functions that each call the previous twice would inline into 2^13 operations:
// inlining stops at its budget, and the calls beyond it stay calls (codegen emits those callees).
// CHECK-LABEL: abp.kernel @doubling_fwd
// CHECK: arith.mulf
// CHECK: func.call @f
// CHECK-LABEL: abp.operator @doubling
func.func private @f0(%x: f32) -> f32 {
  %y = arith.mulf %x, %x : f32
  return %y : f32
}
func.func private @f1(%x: f32) -> f32 {
  %a = func.call @f0(%x) : (f32) -> f32
  %b = func.call @f0(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f2(%x: f32) -> f32 {
  %a = func.call @f1(%x) : (f32) -> f32
  %b = func.call @f1(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f3(%x: f32) -> f32 {
  %a = func.call @f2(%x) : (f32) -> f32
  %b = func.call @f2(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f4(%x: f32) -> f32 {
  %a = func.call @f3(%x) : (f32) -> f32
  %b = func.call @f3(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f5(%x: f32) -> f32 {
  %a = func.call @f4(%x) : (f32) -> f32
  %b = func.call @f4(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f6(%x: f32) -> f32 {
  %a = func.call @f5(%x) : (f32) -> f32
  %b = func.call @f5(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f7(%x: f32) -> f32 {
  %a = func.call @f6(%x) : (f32) -> f32
  %b = func.call @f6(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f8(%x: f32) -> f32 {
  %a = func.call @f7(%x) : (f32) -> f32
  %b = func.call @f7(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f9(%x: f32) -> f32 {
  %a = func.call @f8(%x) : (f32) -> f32
  %b = func.call @f8(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f10(%x: f32) -> f32 {
  %a = func.call @f9(%x) : (f32) -> f32
  %b = func.call @f9(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f11(%x: f32) -> f32 {
  %a = func.call @f10(%x) : (f32) -> f32
  %b = func.call @f10(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f12(%x: f32) -> f32 {
  %a = func.call @f11(%x) : (f32) -> f32
  %b = func.call @f11(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
func.func private @f13(%x: f32) -> f32 {
  %a = func.call @f12(%x) : (f32) -> f32
  %b = func.call @f12(%a) : (f32) -> f32
  %y = arith.addf %a, %b : f32
  return %y : f32
}
abp.operator @doubling forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @f13(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// Every output is a tensor of its own: a forward returning one value twice, or an argument, gets
// a copy for each repeat (an identity map, fused), so the kernel writes three outputs; a
// share_saved of the returned argument shares its copy.
// CHECK-LABEL: abp.kernel @twice_fwd
// CHECK-SAME: ins = [#abp.dense], outs = [#abp.dense, #abp.dense, #abp.dense]
// CHECK: ^bb0(%[[X:.*]]: f32):
// CHECK: %[[Y:.*]] = arith.mulf %[[X]], %{{.*}} : f32
// CHECK: abp.yield %[[Y]], %[[Y]], %[[X]] : f32, f32, f32
// CHECK-LABEL: abp.operator @twice
// CHECK: %[[L:.*]]:3 = abp.launch @twice_fwd
// CHECK: %[[S:.*]] = abp.share_saved %[[L]]#2
// CHECK: abp.return %[[L]]#0, %[[L]]#1, %[[L]]#2 : tensor<?xf32>, tensor<?xf32>, tensor<?xf32> saves %[[S]]
abp.operator @twice forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
    %c = arith.constant 2.0 : f32
    %p = arith.mulf %a, %c : f32
    abp.yield %p : f32
  }
  %s = abp.share_saved %x : tensor<?xf32>
  abp.return %y, %y, %x : tensor<?xf32>, tensor<?xf32>, tensor<?xf32> saves %s : tensor<?xf32>
} backward {
^bb0(%s: tensor<?xf32>, %g1: tensor<?xf32>, %g2: tensor<?xf32>, %g3: tensor<?xf32>):
  %d = abp.map(%g1, %g2, %g3) : (tensor<?xf32>, tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32, %e: f32):
    %c = arith.constant 2.0 : f32
    %t = arith.addf %a, %b : f32
    %p = arith.mulf %t, %c : f32
    %q = arith.addf %p, %e : f32
    abp.yield %q : f32
  }
  abp.return %d : tensor<?xf32>
}

// -----

// A forward that only returns its argument gets a copy kernel.
// CHECK-LABEL: abp.kernel @ident_fwd
// CHECK-SAME: ins = [#abp.dense], outs = [#abp.dense]
// CHECK: ^bb0(%[[X:.*]]: f32):
// CHECK-NEXT: abp.yield %[[X]] : f32
abp.operator @ident forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}
