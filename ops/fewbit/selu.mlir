// SELU with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @selu_b1..b4 (N(0,1) weight, the default) and @selu_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// SELU: x <= 0 ? (exp(x) - 1) * alpha * scale : x * scale, torch's constants in fp32.
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %negcoef = arith.constant 1.7580993175506592 : f32
  %scale = arith.constant 1.0507010221481323 : f32
  %e = math.exp %x : f32
  %m = arith.subf %e, %one : f32
  %n = arith.mulf %m, %negcoef : f32
  %p = arith.mulf %x, %scale : f32
  %neg = arith.cmpf ole, %x, %zero : f32
  %y = arith.select %neg, %n, %p : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @selu_b3 variants {selu_b1 = #selu_n1, selu_b2 = #selu_n2, selu_b4 = #selu_n4, selu_b1_uniform = #selu_u1, selu_b2_uniform = #selu_u2, selu_b3_uniform = #selu_u3, selu_b4_uniform = #selu_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #selu_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #selu_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
