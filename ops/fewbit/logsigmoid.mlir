// LogSigmoid with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @logsigmoid_b1..b4 (N(0,1) weight, the default) and @logsigmoid_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// LogSigmoid: min(x, 0) - log1p(exp(-|x|)), the stable form torch uses.
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %m = arith.minimumf %x, %zero : f32
  %a = math.absf %x : f32
  %n = arith.negf %a : f32
  %e = math.exp %n : f32
  %l = math.log1p %e : f32
  %y = arith.subf %m, %l : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @logsigmoid_b3 variants {logsigmoid_b1 = #logsigmoid_n1, logsigmoid_b2 = #logsigmoid_n2, logsigmoid_b4 = #logsigmoid_n4, logsigmoid_b1_uniform = #logsigmoid_u1, logsigmoid_b2_uniform = #logsigmoid_u2, logsigmoid_b3_uniform = #logsigmoid_u3, logsigmoid_b4_uniform = #logsigmoid_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #logsigmoid_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #logsigmoid_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
