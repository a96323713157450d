// ReLU6 = hardtanh(x, 0, 6) with its exact 1-bit derivative: mask !(x <= 0 || x >= 6);
// dx = mask ? dy : 0. (FewBit's original wrote 1 instead of 6 above x >= 6; this is the clamp.)
func.func private @activation(%x: f32) -> f32 {
  %zero = arith.constant 0.0 : f32
  %six = arith.constant 6.0 : f32
  %a = arith.maximumf %x, %zero : f32
  %y = arith.minimumf %a, %six : f32
  return %y : f32
}

func.func private @mask(%x: f32) -> i8 {
  %zero = arith.constant 0.0 : f32
  %six = arith.constant 6.0 : f32
  %above = arith.cmpf ugt, %x, %zero : f32
  %below = arith.cmpf ult, %x, %six : f32
  %inside = arith.andi %above, %below : i1
  %m = arith.extui %inside : i1 to i8
  return %m : i8
}

func.func private @pass_through(%m: i8, %g: f32) -> f32 {
  %zero = arith.constant 0 : i8
  %fzero = arith.constant 0.0 : f32
  %on = arith.cmpi ne, %m, %zero : i8
  %dx = arith.select %on, %g, %fzero : f32
  return %dx : f32
}

abp.operator @relu6 forward {
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
