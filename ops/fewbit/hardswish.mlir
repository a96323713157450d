// Hardswish with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @hardswish_b1..b4 (N(0,1) weight, the default) and @hardswish_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// Hardswish: x * min(max(x + 3, 0), 6) / 6.
func.func private @activation(%x: f32) -> f32 {
  %three = arith.constant 3.0 : f32
  %zero = arith.constant 0.0 : f32
  %six = arith.constant 6.0 : f32
  %s = arith.addf %x, %three : f32
  %a = arith.maximumf %s, %zero : f32
  %b = arith.minimumf %a, %six : f32
  %p = arith.mulf %x, %b : f32
  %y = arith.divf %p, %six : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @hardswish_b3 variants {hardswish_b1 = #hardswish_n1, hardswish_b2 = #hardswish_n2, hardswish_b4 = #hardswish_n4, hardswish_b1_uniform = #hardswish_u1, hardswish_b2_uniform = #hardswish_u2, hardswish_b3_uniform = #hardswish_u3, hardswish_b4_uniform = #hardswish_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #hardswish_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #hardswish_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
