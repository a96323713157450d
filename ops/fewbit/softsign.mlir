// Softsign with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @softsign_b1..b4 (N(0,1) weight, the default) and @softsign_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// Softsign: x / (|x| + 1).
func.func private @activation(%x: f32) -> f32 {
  %one = arith.constant 1.0 : f32
  %a = math.absf %x : f32
  %d = arith.addf %a, %one : f32
  %y = arith.divf %x, %d : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @softsign_b3 variants {softsign_b1 = #softsign_n1, softsign_b2 = #softsign_n2, softsign_b4 = #softsign_n4, softsign_b1_uniform = #softsign_u1, softsign_b2_uniform = #softsign_u2, softsign_b3_uniform = #softsign_u3, softsign_b4_uniform = #softsign_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #softsign_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #softsign_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
