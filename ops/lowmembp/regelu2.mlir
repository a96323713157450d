// ReGELU2 (LowMemoryBP, docs/algorithms.md §4): exact GELU forward; backward is the derivative of
// three shifted ReLUs, a 4-level step stored as 2-bit codes of x. Nothing else is saved.
#regelu2 = #abp.buckets<borders = [-3.1858810036855245, -0.001178821281161997, 3.190832613414926],
                        levels = [0.0, -0.04922261145617846, 1.0487405950855513, 1.0]>

// GELU, erf form: x/2 * (1 + erf(x/√2)).
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

abp.operator @regelu2 forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #regelu2} : tensor<?xf32> -> !abp.codes<2>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #regelu2} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
