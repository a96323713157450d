// Every abp op, type and attribute prints in a form that parses back to the same IR.
// RUN: abp-opt %s -split-input-file | abp-opt -split-input-file | FileCheck %s

// CHECK: #[[B1:.+]] = #abp.buckets<borders = [0.000000e+00], levels = [2.500000e-01, 7.500000e-01]>
// CHECK: #[[B2:.+]] = #abp.buckets<borders = [-1.000000e+00, 0.000000e+00, 1.000000e+00], levels = [0.000000e+00, 2.500000e-01, 7.500000e-01, 1.000000e+00]>
// CHECK-LABEL: abp.operator @quantized
// CHECK-SAME: variants {quantized_b1 = #[[B1]]}
// CHECK: ^bb0(%[[X:.*]]: tensor<?xf32>, %[[P:.*]]: f32):
// CHECK: abp.map @scale(%[[X]]) : (tensor<?xf32>) -> tensor<?xf32>
// CHECK: abp.quantize %[[X]] {scheme = #[[B2]]} : tensor<?xf32> -> !abp.codes<2>
// CHECK: abp.return %{{.*}} : tensor<?xf32> saves %{{.*}}, %[[P]] : !abp.codes<2>, f32
// CHECK: backward
// CHECK: ^bb0(%[[C:.*]]: !abp.codes<2>, %[[Q:.*]]: f32, %[[DY:.*]]: tensor<?xf32>):
// CHECK: abp.dequantize %[[C]] {scheme = #[[B2]]} : !abp.codes<2> -> tensor<?xf32>
// CHECK: abp.map(%{{.*}}, %[[DY]]) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
// CHECK: arith.mulf
// CHECK: abp.yield %{{.*}} : f32
func.func private @scale(%x: f32) -> f32 {
  %c = arith.constant 2.0 : f32
  %y = arith.mulf %x, %c : f32
  return %y : f32
}
abp.operator @quantized variants {quantized_b1 = #abp.buckets<borders = [0.0], levels = [0.25, 0.75]>} forward {
^bb0(%x: tensor<?xf32>, %p: f32):
  %y = abp.map @scale(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  abp.return %y : tensor<?xf32> saves %c, %p : !abp.codes<2>, f32
} backward {
^bb0(%c: !abp.codes<2>, %p: f32, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%s: f32, %g: f32):
    %m = arith.mulf %s, %g : f32
    %r = arith.mulf %m, %p : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// CHECK-LABEL: abp.operator @mask
// CHECK: abp.pack %{{.*}} : tensor<?xi8> -> !abp.codes<1>
// CHECK: abp.unpack %{{.*}} : !abp.codes<1> -> tensor<?xi8>
abp.operator @mask forward {
^bb0(%x: tensor<?xf32>):
  %m = abp.map(%x) : (tensor<?xf32>) -> tensor<?xi8> {
  ^bb0(%v: f32):
    %z = arith.constant 0.0 : f32
    %b = arith.cmpf ogt, %v, %z : f32
    %e = arith.extui %b : i1 to i8
    abp.yield %e : i8
  }
  %c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>
  %dx = abp.map(%m, %dy) : (tensor<?xi8>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%b: i8, %g: f32):
    %f = arith.uitofp %b : i8 to f32
    %r = arith.mulf %f, %g : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// CHECK-LABEL: abp.kernel @k
// CHECK-SAME: block_size = 256 : i64, chunk = 8 : i64, ins = [#abp.packed<2>, #abp.dense, #abp.scalar], outs = [#abp.dense]
// CHECK: abp.launch @k(%{{.*}}, %{{.*}}, %{{.*}}) : (!abp.codes<2>, tensor<?xf32>, f32) -> tensor<?xf32>
abp.kernel @k attributes {block_size = 256 : i64, chunk = 8 : i64, ins = [#abp.packed<2>, #abp.dense, #abp.scalar], outs = [#abp.dense]} {
^bb0(%c: i8, %g: f32, %s: f32):
  %r = arith.mulf %g, %s : f32
  abp.yield %r : f32
}
abp.operator @launcher forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32> saves %s : f32
} backward {
^bb0(%s: f32, %dy: tensor<?xf32>):
  %c = abp.quantize %dy {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  %dx = abp.launch @k(%c, %dy, %s) : (!abp.codes<2>, tensor<?xf32>, f32) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
