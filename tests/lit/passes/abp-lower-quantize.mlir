// RUN: abp-opt %s -abp-lower-quantize | FileCheck %s

// quantize: code = Σ [x > t_i] (borders rounded to fp32), then pack.
// dequantize: unpack, then select levels[code] (fp32 constants).
// CHECK-LABEL: abp.operator @q
// CHECK-SAME: abp.schemes = [#{{.+}}]
// CHECK: %[[M:.*]] = abp.map(%{{.*}}) : (tensor<?xf32>) -> tensor<?xi8> {
// CHECK: ^bb0(%[[X:.*]]: f32):
// CHECK-DAG: %[[ZERO:.*]] = arith.constant 0 : i8
// CHECK-DAG: %[[T0:.*]] = arith.constant -1.000000e+00 : f32
// CHECK: %[[C0:.*]] = arith.cmpf ogt, %[[X]], %[[T0]] : f32
// CHECK: %[[E0:.*]] = arith.extui %[[C0]] : i1 to i8
// CHECK: %[[S0:.*]] = arith.addi %[[ZERO]], %[[E0]] : i8
// CHECK: arith.constant 0.333333343 : f32
// CHECK: arith.cmpf ogt
// CHECK: arith.constant 1.000000e+00 : f32
// CHECK: arith.cmpf ogt
// CHECK: %[[CODE:.*]] = arith.addi
// CHECK: abp.yield %[[CODE]] : i8
// CHECK: abp.pack %[[M]] : tensor<?xi8> -> !abp.codes<2>
// CHECK: backward
// CHECK: %[[U:.*]] = abp.unpack %{{.*}} : !abp.codes<2> -> tensor<?xi8>
// CHECK: abp.map(%[[U]]) : (tensor<?xi8>) -> tensor<?xf32> {
// CHECK: ^bb0(%[[C:.*]]: i8):
// CHECK: %[[L0:.*]] = arith.constant 0.000000e+00 : f32
// CHECK: %[[I1:.*]] = arith.constant 1 : i8
// CHECK: %[[H1:.*]] = arith.cmpi eq, %[[C]], %[[I1]] : i8
// CHECK: %[[L1:.*]] = arith.constant 2.500000e-01 : f32
// CHECK: %[[R1:.*]] = arith.select %[[H1]], %[[L1]], %[[L0]] : f32
// CHECK: arith.cmpi eq
// CHECK: arith.select
// CHECK: arith.cmpi eq
// CHECK: %[[R3:.*]] = arith.select
// CHECK: abp.yield %[[R3]] : f32
// CHECK-NOT: abp.quantize
// CHECK-NOT: abp.dequantize
#s = #abp.buckets<borders = [-1.0, 0.3333333333333333, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>
abp.operator @q forward {
^bb0(%x: tensor<?xf32>):
  %c = abp.quantize %x {scheme = #s} : tensor<?xf32> -> !abp.codes<2>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #s} : !abp.codes<2> -> tensor<?xf32>
  abp.return %d : tensor<?xf32>
}
