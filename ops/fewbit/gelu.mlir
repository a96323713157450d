// GELU, erf form with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @gelu_b1..b4 (N(0,1) weight, the default) and @gelu_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// GELU, erf form: x/2 * (1 + erf(x/sqrt(2))).
func.func private @activation(%x: f32) -> f32 {
  %half = arith.constant 0.5 : f32
  %one = arith.constant 1.0 : f32
  %rsqrt2 = arith.constant 0.707106781186547524 : f32
  %s = arith.mulf %x, %rsqrt2 : f32
  %e = math.erf %s : f32
  %p = arith.addf %e, %one : f32
  %h = arith.mulf %x, %half : f32
  %y = arith.mulf %h, %p : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @gelu_b3 variants {gelu_b1 = #gelu_n1, gelu_b2 = #gelu_n2, gelu_b4 = #gelu_n4, gelu_b1_uniform = #gelu_u1, gelu_b2_uniform = #gelu_u2, gelu_b3_uniform = #gelu_u3, gelu_b4_uniform = #gelu_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #gelu_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #gelu_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
