// LeakyReLU with its exact 1-bit derivative: mask [x > 0]; dx = mask ? dy : dy * slope.
// The slope is a parameter (passed by value, saved as a 4-byte scalar, not per element).
func.func private @mask(%x: f32) -> i8 {
  %zero = arith.constant 0.0 : f32
  %b = arith.cmpf ogt, %x, %zero : f32
  %m = arith.extui %b : i1 to i8
  return %m : i8
}

abp.operator @leaky_relu attributes {params = ["negative_slope"]} forward {
^bb0(%x: tensor<?xf32>, %slope: f32):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %zero = arith.constant 0.0 : f32
    %pos = arith.cmpf ogt, %v, %zero : f32
    %s = arith.mulf %v, %slope : f32
    %r = arith.select %pos, %v, %s : f32
    abp.yield %r : f32
  }
  %m = abp.map @mask(%x) : (tensor<?xf32>) -> tensor<?xi8>
  %c = abp.pack %m : tensor<?xi8> -> !abp.codes<1>
  abp.return %y : tensor<?xf32> saves %c, %slope : !abp.codes<1>, f32
} backward {
^bb0(%c: !abp.codes<1>, %slope: f32, %dy: tensor<?xf32>):
  %m = abp.unpack %c : !abp.codes<1> -> tensor<?xi8>
  %dx = abp.map(%m, %dy) : (tensor<?xi8>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%b: i8, %g: f32):
    %zero = arith.constant 0 : i8
    %on = arith.cmpi ne, %b, %zero : i8
    %s = arith.mulf %g, %slope : f32
    %r = arith.select %on, %g, %s : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?xf32>
}
