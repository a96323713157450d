// Map bodies and the functions maps call hold only the scalar operations abp compiles
// (dialect/ScalarOps.cpp): anything else is refused when the IR is verified, at the op.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    // expected-error @+1 {{'math.atan' op is not a scalar operation abp compiles into kernels; supported (docs/dialect.md#scalar-operations): arith.constant, arith.addf}}
    %s = math.atan %v : f32
    abp.yield %s : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// Reached through a call of a call: the nested function is checked too.
func.func private @inner(%v: f32) -> f32 {
  // expected-error @+1 {{'math.atan2' op is not a scalar operation abp compiles}}
  %s = math.atan2 %v, %v : f32
  return %s : f32
}
func.func private @outer(%v: f32) -> f32 {
  %s = func.call @inner(%v) : (f32) -> f32
  return %s : f32
}
abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @outer(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{returns 2 values; a kernel's scalar function returns exactly one}}
func.func private @two(%v: f32) -> (f32, f32) {
  return %v, %v : f32, f32
}
func.func private @caller(%v: f32) -> f32 {
  %a, %b = func.call @two(%v) : (f32) -> (f32, f32)
  return %a : f32
}
abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @caller(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    // expected-error @+1 {{produces 'i128'; kernel scalars are f32, i1, i8, i16, i32 or i64}}
    %wide = arith.constant 1 : i128
    abp.yield %v : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    // expected-error @+1 {{produces 'tensor<2xf32>'; kernel scalars are f32, i1, i8, i16, i32 or i64}}
    %c = arith.constant dense<1.0> : tensor<2xf32>
    abp.yield %v : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{has 2 blocks; a kernel's scalar function is one block (use arith.select for branches)}}
func.func private @branchy(%v: f32) -> f32 {
  return %v : f32
^unreachable:
  return %v : f32
}
abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @branchy(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{is declared without a body; abp compiles only defined functions}}
func.func private @external(%v: f32) -> f32
abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @external(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
