// ReLU with its exact 1-bit derivative (FewBit): the mask [y > 0 or y is NaN], as torch's
// threshold_backward reads it, packed 8 elements per byte; dx = mask ? dy : 0.
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %y = arith.maximumf %x, %zero : f32 // NaN stays NaN
  return %y : f32
}

// 1 where torch passes the gradient through: !(x <= 0), so NaN passes like in torch.
func.func private @mask(%x: f32) -> i8 {
  %zero = arith.constant 0.0 : f32
  %b = arith.cmpf ugt, %x, %zero : f32
  %m = arith.extui %b : i1 to i8
  return %m : i8
}

func.func private @pass_through(%m: i8, %g: f32) -> f32 {
  %zero = arith.constant 0 : i8
  %fzero = arith.constant 0.0 : f32
  %on = arith.cmpi ne, %m, %zero : i8
  %dx = arith.select %on, %g, %fzero : f32
  return %dx : f32
}

abp.operator @relu forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %m = abp.map @mask(%x) : (tensor<?xf32>) -> tensor<?xi8>
  %c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>
  %dx = abp.map @pass_through(%m, %dy) : (tensor<?xi8>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
