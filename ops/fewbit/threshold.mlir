// Threshold with its exact 1-bit derivative: y = x <= threshold ? value : x (NaN passes);
// mask !(x <= threshold); dx = mask ? dy : 0. Threshold and value are parameters.
func.func private @pass_through(%m: i8, %g: f32) -> f32 {
  %zero = arith.constant 0 : i8
  %fzero = arith.constant 0.0 : f32
  %on = arith.cmpi ne, %m, %zero : i8
  %dx = arith.select %on, %g, %fzero : f32
  return %dx : f32
}

abp.operator @threshold attributes {params = ["threshold", "value"]} forward {
^bb0(%x: tensor<?xf32>, %t: f32, %value: f32):
  %y, %m = abp.map(%x) : (tensor<?xf32>) -> (tensor<?xf32>, tensor<?xi8>) {
  ^bb0(%v: f32):
    %above = arith.cmpf ugt, %v, %t : f32
    %r = arith.select %above, %v, %value : f32
    %b = arith.extui %above : i1 to i8
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
