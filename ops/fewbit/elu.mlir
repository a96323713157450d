// ELU (alpha = 1) with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @elu_b1..b4 (N(0,1) weight, the default) and @elu_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// ELU (alpha = 1): x <= 0 ? exp(x) - 1 : x, torch's formula.
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %e = math.exp %x : f32
  %m = arith.subf %e, %one : f32
  %neg = arith.cmpf ole, %x, %zero : f32
  %y = arith.select %neg, %m, %x : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @elu_b3 variants {elu_b1 = #elu_n1, elu_b2 = #elu_n2, elu_b4 = #elu_n4, elu_b1_uniform = #elu_u1, elu_b2_uniform = #elu_u2, elu_b3_uniform = #elu_u3, elu_b4_uniform = #elu_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #elu_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #elu_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
