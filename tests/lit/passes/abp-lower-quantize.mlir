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

// quantize_groups: per-row min and max, the scale s = (2^b - 1) / (M - m + 2e-6) (NaN unless
// M - m is finite), Philox draws, q = min(floor((x - m) * s + u), 2^b - 1) as i8, then pack.
// dequantize_groups: unpack, broadcast m / 2 and 0.5 / s, (q * (0.5 / s) + m / 2) * 2
// (in halves: a range near the largest float would overflow q / s).
// CHECK-LABEL: abp.operator @g
// CHECK: %[[MIN:.*]] = abp.reduce_rows min %[[X:.*]] : tensor<?x?xf32> -> tensor<?xf32>
// CHECK: %[[MAX:.*]] = abp.reduce_rows max %[[X]] : tensor<?x?xf32> -> tensor<?xf32>
// CHECK: %[[S:.*]] = abp.map(%[[MIN]], %[[MAX]])
// CHECK: arith.cmpf olt
// CHECK: arith.constant 2.000000e-06 : f32
// CHECK: arith.constant 1.500000e+01 : f32
// CHECK: arith.divf
// CHECK: arith.constant 0x7FC00000 : f32
// CHECK: arith.select
// CHECK: %[[MB:.*]] = abp.broadcast_rows %[[MIN]]
// CHECK: %[[SB:.*]] = abp.broadcast_rows %[[S]]
// The quantizer draws 16-bit uniforms (half the Philox calls of the default 24 bits).
// CHECK: %[[U:.*]] = abp.uniform %{{[^ ]*}}, %{{[^ ]*}} {bits = 16 : i32} : i64, i64 -> tensor<?x?xf32>
// CHECK: abp.map(%[[X]], %[[MB]], %[[SB]], %[[U]]) {{.*}} -> tensor<?x?xi8>
// CHECK: arith.subf
// CHECK-NEXT: arith.mulf
// CHECK-NEXT: arith.addf
// CHECK-NEXT: math.floor
// The code saturates (NaN and below 0 give 0), then an integer minimum caps it at 2^b - 1.
// CHECK-NEXT: %[[Q:.*]] = arith.fptoui %{{.*}} : f32 to i8
// CHECK-NEXT: %[[TOP:.*]] = arith.constant 15 : i8
// CHECK-NEXT: arith.minui %[[Q]], %[[TOP]] : i8
// CHECK: abp.pack %{{.*}} : tensor<?x?xi8> -> !abp.codes<4>
// CHECK: } backward {
// CHECK: abp.unpack %{{.*}} : !abp.codes<4> -> tensor<?x?xi8>
// The division happens once per row: 0.5 / s, and m / 2; then (q * (0.5 / s) + m / 2) * 2 per element.
// CHECK: abp.map(%{{.*}}) : (tensor<?xf32>) -> tensor<?xf32>
// CHECK: arith.constant 5.000000e-01 : f32
// CHECK-NEXT: arith.divf
// CHECK: abp.map(%{{.*}}) : (tensor<?xf32>) -> tensor<?xf32>
// CHECK: arith.mulf
// CHECK: arith.uitofp
// CHECK-NEXT: arith.mulf
// CHECK-NEXT: arith.addf
// CHECK-NEXT: arith.constant 2.000000e+00 : f32
// CHECK-NEXT: arith.mulf
abp.operator @g forward {
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
