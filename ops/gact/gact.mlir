// GACT / ActNN per-group compression of saved tensors (docs/algorithms.md §6), as codecs: an operator
// with no outputs whose forward packs its input and whose backward rebuilds it. A row is a group
// (abp.compress cuts a flattened tensor into rows of group_size elements, plus a tail row):
//   forward:  m = min, M = max, s = (2^b - 1) / (M - m + 2e-6) per row (NaN unless M - m is
//             finite); q = min(floor((x - m) s + u), 2^b - 1), u ~ U[0, 1) from Philox at
//             (seed, offset + flat index); saves the b-bit codes, m and s
//   backward: x = q * (1 / s) + m (the reciprocal once per row), an unbiased estimate of the
//             forward's input
// One row kernel each way: the range reductions, the draws, the rounding and the packing fuse.

abp.operator @gact_b1 attributes {params = ["seed", "offset"]} forward {
^bb0(%x: tensor<?x?xf32>, %seed: i64, %offset: i64):
  %c, %m, %s = abp.quantize_groups %x, %seed, %offset
      : tensor<?x?xf32>, i64, i64 -> !abp.codes<1>, tensor<?xf32>, tensor<?xf32>
  abp.return saves %c, %m, %s : !abp.codes<1>, tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<1>, %m: tensor<?xf32>, %s: tensor<?xf32>):
  %x = abp.dequantize_groups %c, %m, %s
      : !abp.codes<1>, tensor<?xf32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}

abp.operator @gact_b2 attributes {params = ["seed", "offset"]} forward {
^bb0(%x: tensor<?x?xf32>, %seed: i64, %offset: i64):
  %c, %m, %s = abp.quantize_groups %x, %seed, %offset
      : tensor<?x?xf32>, i64, i64 -> !abp.codes<2>, tensor<?xf32>, tensor<?xf32>
  abp.return saves %c, %m, %s : !abp.codes<2>, tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<2>, %m: tensor<?xf32>, %s: tensor<?xf32>):
  %x = abp.dequantize_groups %c, %m, %s
      : !abp.codes<2>, tensor<?xf32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}

abp.operator @gact_b4 attributes {params = ["seed", "offset"]} forward {
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

abp.operator @gact_b8 attributes {params = ["seed", "offset"]} forward {
^bb0(%x: tensor<?x?xf32>, %seed: i64, %offset: i64):
  %c, %m, %s = abp.quantize_groups %x, %seed, %offset
      : tensor<?x?xf32>, i64, i64 -> !abp.codes<8>, tensor<?xf32>, tensor<?xf32>
  abp.return saves %c, %m, %s : !abp.codes<8>, tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<8>, %m: tensor<?xf32>, %s: tensor<?xf32>):
  %x = abp.dequantize_groups %c, %m, %s
      : !abp.codes<8>, tensor<?xf32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}
