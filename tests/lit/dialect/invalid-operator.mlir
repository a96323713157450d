// Malformed operators are rejected with located diagnostics.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

// The two directions are separate scopes: backward can only reach forward values through
// residuals, so a direct use does not even parse. The error names the value and says to save it
// (MLIR's own is a bare "use of undeclared SSA value name"), with a note at the forward value.
abp.operator @uses_forward_value forward {
^bb0(%x: tensor<?xf32>):
  // expected-note @+1 {{'%y' in the forward region}}
  %y = abp.map(%x) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    abp.yield %v : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  // expected-error @+1 {{'%y' is a value of the forward region, which backward cannot see: only residuals cross. Save it (`abp.return ... saves %y : <type>`) and take it as a backward block argument, before the output gradients}}
  %dx = abp.map(%y, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %b : f32
    abp.yield %m : f32
  }
  abp.return %dx : tensor<?xf32>
}

// -----

// expected-error @+1 {{expects backward to take 1 residual(s) and 1 output gradient(s) (2 block arguments), got 1}}
abp.operator @missing_residual_arg forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32> saves %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{backward argument #0 receives residual #0 of type '!abp.codes<2>' but is declared as '!abp.codes<1>'}}
abp.operator @residual_type forward {
^bb0(%x: tensor<?xf32>):
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<2>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @gradient_count forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  // expected-error @+1 {{expects one gradient per tensor input not in no_grad (1), got 2}}
  abp.return %dy, %dy : tensor<?xf32>, tensor<?xf32>
}

// -----

abp.operator @saves_in_backward forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  // expected-error @+1 {{in backward cannot save residuals}}
  abp.return %dy : tensor<?xf32> saves %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{forward argument #1 must be a ranked tensor, an f32 parameter or an i64 parameter (a seed or offset), got 'i32'}}
abp.operator @bad_param forward {
^bb0(%x: tensor<?xf32>, %p: i32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{variant 'v' must be a #abp.buckets scheme, got 1 : i64}}
abp.operator @bad_variant variants {v = 1} forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// params must be strings (codegen and the manifest read them as names).
// expected-error @+1 {{'abp.operator' op attribute 'params' failed to satisfy constraint: string array attribute}}
abp.operator @params_not_strings attributes {params = [1]} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{'abp.operator' op attribute 'params' failed to satisfy constraint: string array attribute}}
abp.operator @params_nested attributes {params = [["a"]]} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{'abp.operator' op attribute 'params' failed to satisfy constraint: string array attribute}}
abp.operator @params_a_string attributes {params = "x"} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{params names 3 parameter(s) but forward takes 1 scalar argument(s); name each one, in order}}
abp.operator @params_count attributes {params = ["a", "b", "c"]} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{params entry #0 ('2x') must be an identifier}}
abp.operator @params_identifier attributes {params = ["2x"]} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{params names 'a' twice}}
abp.operator @params_twice attributes {params = ["a", "a"]} forward {
^bb0(%x: tensor<?xf32>, %s: f32, %t: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{name 'my-op' must be an identifier (a letter or '_', then letters, digits or '_'): it names the generated kernels}}
abp.operator @"my-op" forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// A name defined nowhere is still MLIR's own error.
abp.operator @op forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  // expected-error @+1 {{use of undeclared SSA value name}}
  abp.return %nowhere : tensor<?xf32>
}

// -----

// A whole-tensor reduction is one value: an operator's outputs are tensors.
abp.operator @returns_a_total forward {
^bb0(%x: tensor<?xf32>):
  %t = abp.reduce_tensor sum %x : tensor<?xf32> -> f32
  // expected-error @+1 {{returns a whole-tensor reduction (abp.reduce_tensor); an output is a tensor: use the value in an abp.map, or save it}}
  abp.return %t : f32
} backward {
^bb0(%dy: f32):
  abp.return %dy : f32
}

// -----

// expected-error @+1 {{is a total kernel and expects 'outs' = [#abp.total], got [#abp.dense]}}
abp.kernel @total_with_a_dense_output attributes {ins = [#abp.dense], outs = [#abp.dense], total = 0 : i32} {
^bb0(%x: f32):
  abp.yield %x : f32
}

// -----

// expected-error @+1 {{expects each of 'outs' to be #abp.dense, #abp.packed<b> or #abp.rows, got #abp.total (only a total kernel, with `total = <kind>`, writes one)}}
abp.kernel @not_a_total_kernel attributes {ins = [#abp.dense], outs = [#abp.total]} {
^bb0(%x: f32):
  abp.yield %x : f32
}

// -----

// A misspelt attribute (`no_gard` for `no_grad`) was kept and ignored.
// expected-error @+1 {{'abp.operator' op has no attribute 'no_gard'; an operator takes 'params', 'no_grad' and 'variants' (other attributes need a dialect prefix, as 'abp.saved_bits')}}
abp.operator @misspelt_attribute attributes {no_gard = array<i64: 1>} forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// A prefixed attribute (a pass's record, a user's note) is kept, and so is MLIR's symbol visibility.
abp.operator @prefixed_attribute attributes {abp.note = "kept", params = [], sym_visibility = "private"} forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
