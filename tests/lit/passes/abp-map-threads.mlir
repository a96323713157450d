// RUN: abp-opt %s -split-input-file -abp-map-threads | FileCheck %s
// RUN: abp-opt %s -split-input-file -abp-map-threads=block-size=128 | FileCheck %s --check-prefix=B128

// Dense arguments need 8 elements per thread (one 128-bit vector at 16-bit dtypes); 3-bit codes
// fill whole bytes every 8 elements; 4-bit codes alone every 2.
// CHECK-LABEL: abp.kernel @dense_and_3bit
// CHECK-SAME: block_size = 256 : i64, chunk = 8 : i64
// B128-LABEL: abp.kernel @dense_and_3bit
// B128-SAME: block_size = 128 : i64
abp.kernel @dense_and_3bit attributes {ins = [#abp.dense], outs = [#abp.packed<3>]} {
^bb0(%x: f32):
  %c = arith.constant 1 : i8
  abp.yield %c : i8
}

// -----

// CHECK-LABEL: abp.kernel @only_4bit
// CHECK-SAME: chunk = 2 : i64
abp.kernel @only_4bit attributes {ins = [#abp.packed<4>], outs = [#abp.packed<4>]} {
^bb0(%c: i8):
  abp.yield %c : i8
}

// -----

// CHECK-LABEL: abp.kernel @only_1bit
// CHECK-SAME: chunk = 8 : i64
abp.kernel @only_1bit attributes {ins = [#abp.packed<1>], outs = [#abp.packed<1>]} {
^bb0(%c: i8):
  abp.yield %c : i8
}

// -----

// CHECK-LABEL: abp.kernel @only_8bit
// CHECK-SAME: chunk = 1 : i64
abp.kernel @only_8bit attributes {ins = [#abp.packed<8>], outs = [#abp.packed<8>]} {
^bb0(%c: i8):
  abp.yield %c : i8
}

// -----

// Row kernels also get warp_max_cols (rows up to it run one per warp).
// CHECK-LABEL: abp.kernel @r
// CHECK-SAME: block_size = 256 : i64, chunk = 8 : i64
// CHECK-SAME: rows, warp_max_cols = 1024 : i64
abp.kernel @r attributes {ins = [#abp.dense], outs = [#abp.rows], rows} {
^bb0(%x: f32):
  %s = abp.reduce_rows sum %x : f32 -> f32
  abp.yield %s : f32
}
