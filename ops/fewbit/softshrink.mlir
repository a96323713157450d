// Softshrink with its exact 1-bit derivative: y = x > lambd ? x - lambd : x < -lambd ? x + lambd
// : x * 0 (NaN stays NaN); mask !(-lambd <= x <= lambd); dx = mask ? dy : 0.
func.func private @pass_through(%m: i8, %g: f32) -> f32 {
  %zero = arith.constant 0 : i8
  %fzero = arith.constant 0.0 : f32
  %on = arith.cmpi ne, %m, %zero : i8
  %dx = arith.select %on, %g, %fzero : f32
  return %dx : f32
}

abp.operator @softshrink attributes {params = ["lambd"]} forward {
^bb0(%x: tensor<?xf32>, %lambd: f32):
  %y, %m = abp.map(%x) : (tensor<?xf32>) -> (tensor<?xf32>, tensor<?xi8>) {
  ^bb0(%v: f32):
    %zero = arith.constant 0.0 : f32
    %nl = arith.negf %lambd : f32
    %hi = arith.cmpf ogt, %v, %lambd : f32
    %lo = arith.cmpf olt, %v, %nl : f32
    %sub = arith.subf %v, %lambd : f32
    %add = arith.addf %v, %lambd : f32
    %mid = arith.mulf %v, %zero : f32
    %low = arith.select %lo, %add, %mid : f32
    %r = arith.select %hi, %sub, %low : f32
    %ge = arith.cmpf oge, %v, %nl : f32
    %le = arith.cmpf ole, %v, %lambd : f32
    %inside = arith.andi %ge, %le : i1
    %true = arith.constant true
    %outside = arith.xori %inside, %true : i1
    %b = arith.extui %outside : i1 to i8
    abp.yield %r, %b : f32, i8
  }
  %c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>
  %dx = abp.map @pass_through(%m, %dy) : (tensor<?xi8>, tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
