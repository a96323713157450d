// Elementwise maps, kernels and launches reject inconsistent signatures.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

func.func private @f(%x: tensor<?xf32>, %y: tensor<4xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{expects all tensor inputs and results to have the same shape}}
  %r = abp.map(%x, %y) : (tensor<?xf32>, tensor<4xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    abp.yield %a : f32
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @g(%x: f32) -> f32
func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{expects exactly one of a body region or a callee}}
  %r = abp.map @g(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @g(%x: f32, %y: f32) -> f32
func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{expects @g to have the scalar signature '(f32) -> f32', got '(f32, f32) -> f32'}}
  %r = abp.map @g(%x) : (tensor<?xf32>) -> tensor<?xf32>
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{references an undefined function @nope}}
  %r = abp.map @nope(%x) : (tensor<?xf32>) -> tensor<?xf32>
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{body argument #0 must be 'f32', got 'i8'}}
  %r = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: i8):
    %z = arith.constant 0.0 : f32
    abp.yield %z : f32
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  %r = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
    %i = arith.constant 1 : i8
    // expected-error @+1 {{value #0 must be 'f32', got 'i8'}}
    abp.yield %i : i8
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf64>) -> tensor<?xf64> {
  // expected-error @+1 {{expects f32 tensors (values) or i8 tensors (codes), got 'tensor<?xf64>'}}
  %r = abp.map(%x) : (tensor<?xf64>) -> tensor<?xf64> {
  ^bb0(%a: f64):
    abp.yield %a : f64
  }
  return %r : tensor<?xf64>
}

// -----

// expected-error @+1 {{body argument #0 must be 'i8' for layout #abp.packed<2>, got 'f32'}}
abp.kernel @k attributes {ins = [#abp.packed<2>], outs = [#abp.dense]} {
^bb0(%c: f32):
  abp.yield %c : f32
}

// -----

// expected-error @+1 {{expects each of 'outs' to be #abp.dense, #abp.packed<b> or #abp.rows, got #abp.scalar}}
abp.kernel @k attributes {ins = [#abp.dense], outs = [#abp.scalar]} {
^bb0(%c: f32):
  abp.yield %c : f32
}

// -----

// expected-error @+1 {{expects block_size in [1, 1024], got 4096}}
abp.kernel @k attributes {ins = [#abp.dense], outs = [#abp.dense], block_size = 4096 : i64} {
^bb0(%c: f32):
  abp.yield %c : f32
}

// -----

abp.kernel @k attributes {ins = [#abp.dense], outs = [#abp.packed<2>]} {
^bb0(%x: f32):
  %c = arith.constant 1 : i8
  abp.yield %c : i8
}
abp.operator @o forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{result #0 of type '!abp.codes<1>' does not match layout #abp.packed<2>}}
  %c = abp.launch @k(%x) : (tensor<?xf32>) -> !abp.codes<1>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @o forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{references an undefined kernel @missing}}
  %y = abp.launch @missing(%x) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// A kernel inlines its scalar functions: recursion would loop forever on the device.
// expected-note @+1 {{@g is defined here}}
func.func private @g(%x: f32) -> f32 {
  %y = func.call @h(%x) : (f32) -> f32
  return %y : f32
}
func.func private @h(%x: f32) -> f32 {
  %y = func.call @g(%x) : (f32) -> f32
  return %y : f32
}
func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{calls @g, whose calls are recursive (@g -> @h -> @g): a kernel cannot recurse; write the loop out}}
  %r = abp.map @g(%x) : (tensor<?xf32>) -> tensor<?xf32>
  return %r : tensor<?xf32>
}

// -----

// expected-note @+1 {{@self is defined here}}
func.func private @self(%x: f32) -> f32 {
  %y = func.call @self(%x) : (f32) -> f32
  return %y : f32
}
func.func private @outer(%x: f32) -> f32 {
  %y = func.call @self(%x) : (f32) -> f32
  return %y : f32
}
func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{calls @outer, whose calls are recursive (@self -> @self)}}
  %r = abp.map @outer(%x) : (tensor<?xf32>) -> tensor<?xf32>
  return %r : tensor<?xf32>
}

// -----

func.func private @"not a name"(%x: f32) -> f32 {
  return %x : f32
}
func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{calls @"not a name", whose name is not an identifier: it becomes a C++ function name}}
  %r = abp.map @"not a name"(%x) : (tensor<?xf32>) -> tensor<?xf32>
  return %r : tensor<?xf32>
}

// -----

// Found by the fuzzer (tests/fuzz): a body without a terminator read past the block's end in the
// map's verifier. The body is now checked after the block is.
func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{empty block: expect at least a terminator}}
  %r = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> tensor<?xf32> {
  // expected-error @+1 {{region #0 ('body') failed to verify constraint: region with at most 1 blocks}}
  %r = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  ^bb1(%b: f32):
    abp.yield %b : f32
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%s: f32) -> tensor<?xf32> {
  // expected-error @+1 {{expects at least one tensor input (scalar parameters are seen by every element of the tensors)}}
  %r = abp.map(%s) : (f32) -> tensor<?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf32>, %s: f32) -> tensor<?xf32> {
  // expected-error @+1 {{body argument #1 must be 'f32', got 'i64'}}
  %r = abp.map(%x, %s) : (tensor<?xf32>, f32) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: i64):
    abp.yield %a : f32
  }
  return %r : tensor<?xf32>
}

// -----

func.func private @g(%a: f32, %b: f32) -> f32 {
  return %a : f32
}
func.func private @f(%x: tensor<?xf32>, %n: i64) -> tensor<?xf32> {
  // expected-error @+1 {{expects @g to have the scalar signature '(f32, i64) -> f32', got '(f32, f32) -> f32'}}
  %r = abp.map @g(%x, %n) : (tensor<?xf32>, i64) -> tensor<?xf32>
  return %r : tensor<?xf32>
}

// -----

func.func private @f(%x: tensor<?xf32>, %h: f16) -> tensor<?xf32> {
  // expected-error @+1 {{operand #1 must be variadic of ranked tensor of any type values or 32-bit float or 64-bit signless integer, but got 'f16'}}
  %r = abp.map(%x, %h) : (tensor<?xf32>, f16) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f16):
    abp.yield %a : f32
  }
  return %r : tensor<?xf32>
}
