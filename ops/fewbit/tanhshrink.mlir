// Tanhshrink with FewBit k-bit derivatives (ALGORITHMS.md §2): the forward is exact,
// the backward is levels[code(x)] * dy with code(x) = #{borders < x} stored in k bits per element.
// The template below is the 3-bit standard-normal-weighted table; `abp-instantiate-variants` makes
// @tanhshrink_b1..b4 (N(0,1) weight, the default) and @tanhshrink_b1_uniform..b4_uniform (uniform weight on
// [-100, 100], FewBit's published weighting) from it.
// BEGIN GENERATED TABLES
// END GENERATED TABLES

// Tanhshrink: x - tanh(x).
func.func private @activation(%x: f32) -> f32 {
  %t = math.tanh %x : f32
  %y = arith.subf %x, %t : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @tanhshrink_b3 variants {tanhshrink_b1 = #tanhshrink_n1, tanhshrink_b2 = #tanhshrink_n2, tanhshrink_b4 = #tanhshrink_n4, tanhshrink_b1_uniform = #tanhshrink_u1, tanhshrink_b2_uniform = #tanhshrink_u2, tanhshrink_b3_uniform = #tanhshrink_u3, tanhshrink_b4_uniform = #tanhshrink_u4} forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #tanhshrink_n3} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<3>
} backward {
^bb0(%c: !abp.codes<3>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #tanhshrink_n3} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
