// Hardtanh with its exact 1-bit derivative: y = clamp(x, min_val, max_val) (NaN stays NaN);
// mask !(x <= min_val || x >= max_val); dx = mask ? dy : 0.
func.func private @pass_through(%m: i8, %g: f32) -> f32 {
  %zero = arith.constant 0 : i8
  %fzero = arith.constant 0.0 : f32
  %on = arith.cmpi ne, %m, %zero : i8
  %dx = arith.select %on, %g, %fzero : f32
  return %dx : f32
}

abp.operator @hardtanh attributes {params = ["min_val", "max_val"]} forward {
^bb0(%x: tensor<?xf32>, %lo: f32, %hi: f32):
  %y, %m = abp.map(%x) : (tensor<?xf32>) -> (tensor<?xf32>, tensor<?xi8>) {
  ^bb0(%v: f32):
    %a = arith.maximumf %v, %lo : f32
    %r = arith.minimumf %a, %hi : f32
    %above = arith.cmpf ugt, %v, %lo : f32
    %below = arith.cmpf ult, %v, %hi : f32
    %inside = arith.andi %above, %below : i1
    %b = arith.extui %inside : i1 to i8
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
