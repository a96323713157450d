// Mish with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @mish_b1..b4 (N(0,1) weight, the default) and @mish_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// Mish: x * tanh(log1p(exp(x))).
func.func private @activation(%x: f32) -> f32 {
  %e = math.exp %x : f32
  %sp = math.log1p %e : f32
  %t = math.tanh %sp : f32
  %y = arith.mulf %x, %t : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @mish_b3 variants {mish_b1 = #mish_n1, mish_b2 = #mish_n2, mish_b4 = #mish_n4, mish_b1_uniform = #mish_u1, mish_b2_uniform = #mish_u2, mish_b3_uniform = #mish_u3, mish_b4_uniform = #mish_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #mish_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #mish_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
