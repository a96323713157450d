// Softplus (beta = 1, threshold = 20) with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @softplus_b1..b4 (N(0,1) weight, the default) and @softplus_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// Softplus (beta = 1, threshold = 20): x > 20 ? x : log1p(exp(x)).
func.func private @activation(%x: f32) -> f32 {
  %threshold = arith.constant 20.0 : f32
  %e = math.exp %x : f32
  %l = math.log1p %e : f32
  %big = arith.cmpf ogt, %x, %threshold : f32
  %y = arith.select %big, %x, %l : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @softplus_b3 variants {softplus_b1 = #softplus_n1, softplus_b2 = #softplus_n2, softplus_b4 = #softplus_n4, softplus_b1_uniform = #softplus_u1, softplus_b2_uniform = #softplus_u2, softplus_b3_uniform = #softplus_u3, softplus_b4_uniform = #softplus_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #softplus_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #softplus_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
