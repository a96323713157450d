// SiLU with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @silu_b1..b4 (N(0,1) weight, the default) and @silu_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// SiLU: x / (1 + exp(-x)).
func.func private @activation(%x: f32) -> f32 {
  %one = arith.constant 1.0 : f32
  %n = arith.negf %x : f32
  %e = math.exp %n : f32
  %d = arith.addf %e, %one : f32
  %y = arith.divf %x, %d : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @silu_b3 variants {silu_b1 = #silu_n1, silu_b2 = #silu_n2, silu_b4 = #silu_n4, silu_b1_uniform = #silu_u1, silu_b2_uniform = #silu_u2, silu_b3_uniform = #silu_u3, silu_b4_uniform = #silu_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #silu_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #silu_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
