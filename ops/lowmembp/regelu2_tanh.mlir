// ReGELU2 for the tanh form of GELU (torch's approximate="tanh", GPT-2's gelu_new): exact forward;
// backward is the derivative of three shifted ReLUs, a 4-level step stored as 2-bit codes of x.
// The surrogate's borders and slopes are fitted to this activation by ReGELU2's own criterion
// (least squared error of the surrogate forward, docs/python.md#gelu-tanh-form) by
// tools/regelu2_fit.py; levels = (0, a1, a1 + a2, 1). Nothing else is saved.
// BEGIN GENERATED TABLE
// regenerate: /usr/bin/python3 tools/regelu2_fit.py --write-ops
// a = [-0.04978613305780821, 1.0995722661156162, -0.04978613305780799], E = 0.009552151554236792 on [-T, T], T = 5.433037831752891
#regelu2_tanh = #abp.buckets<borders = [-3.162880066605913, -2.3759552157309906e-16, 3.162880066605918], levels = [0.0, -0.04978613305780821, 1.049786133057808, 1.0]>
// END GENERATED TABLE

// GELU, tanh form: x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), in torch's order of
// operations.
func.func private @activation(%x: f32) -> f32 {
  %half = arith.constant 0.5 : f32
  %one = arith.constant 1.0 : f32
  %beta = arith.constant 0.7978845608028654 : f32
  %kappa = arith.constant 0.044715 : f32
  %x2 = arith.mulf %x, %x : f32
  %x3 = arith.mulf %x2, %x : f32
  %k = arith.mulf %kappa, %x3 : f32
  %s = arith.addf %x, %k : f32
  %u = arith.mulf %beta, %s : f32
  %t = math.tanh %u : f32
  %p = arith.addf %t, %one : f32
  %h = arith.mulf %x, %half : f32
  %y = arith.mulf %h, %p : f32
  return %y : f32
}

func.func private @mul(%a: f32, %b: f32) -> f32 {
  %p = arith.mulf %a, %b : f32
  return %p : f32
}

abp.operator @regelu2_tanh forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #regelu2_tanh} : tensor<?xf32> -> !abp.codes<2>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<2>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #regelu2_tanh} : !abp.codes<2> -> tensor<?xf32>
  %dx = abp.map @mul(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
