// ReSiLU2 (LowMemoryBP, docs/algorithms.md §4): exact SiLU forward; backward is the derivative of
// three shifted ReLUs, a 4-level step stored as 2-bit codes of x. Nothing else is saved.
#resilu2 = #abp.buckets<borders = [-6.3050461001646445, -0.0008684942046214787, 6.325815242089708],
                        levels = [0.0, -0.04060357190528599, 1.0403218566243821, 1.0]>

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

abp.operator @resilu2 forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #resilu2} : tensor<?xf32> -> !abp.codes<2>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #resilu2} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
