// Hardsigmoid with its exact 1-bit derivative: y = min(max(x + 3, 0), 6) / 6;
// mask [-3 < x < 3]; dx = mask ? dy * (1/6) : 0, in torch's order of operations.
func.func private @activation(%x: f32) -> f32 {
  %three = arith.constant 3.0 : f32
  %zero = arith.constant 0.0 : f32
  %six = arith.constant 6.0 : f32
  %s = arith.addf %x, %three : f32
  %a = arith.maximumf %s, %zero : f32
  %b = arith.minimumf %a, %six : f32
  %y = arith.divf %b, %six : f32
  return %y : f32
}

func.func private @mask(%x: f32) -> i8 {
  %three = arith.constant 3.0 : f32
  %mthree = arith.constant -3.0 : f32
  %above = arith.cmpf ogt, %x, %mthree : f32
  %below = arith.cmpf olt, %x, %three : f32
  %inside = arith.andi %above, %below : i1
  %m = arith.extui %inside : i1 to i8
  return %m : i8
}

func.func private @grad(%m: i8, %g: f32) -> f32 {
  %zero = arith.constant 0 : i8
  %fzero = arith.constant 0.0 : f32
  %sixth = arith.constant 0.166666672 : f32
  %on = arith.cmpi ne, %m, %zero : i8
  %s = arith.mulf %g, %sixth : f32
  %dx = arith.select %on, %s, %fzero : f32
  return %dx : f32
}

abp.operator @hardsigmoid forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @activation(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %m = abp.map @mask(%x) : (tensor<?xf32>) -> tensor<?xi8>
  %c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>
  %dx = abp.map @grad(%m, %dy) : (tensor<?xi8>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
