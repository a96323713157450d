// abp.sample / abp.unsample, no_grad and gathered kernel arguments reject misuse with located errors.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

abp.operator @wrong_columns attributes {no_grad = array<i64: 1, 2>} forward {
^bb0(%x: tensor<?x4xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>):
  // expected-error @+1 {{keeps whole rows, so the result must have the input's 4 columns, got 5}}
  %kept = abp.sample %x, %index, %weight : tensor<?x4xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x5xf32>
  abp.return %x : tensor<?x4xf32>
} backward {
^bb0(%g: tensor<?x4xf32>):
  abp.return %g : tensor<?x4xf32>
}

// -----

abp.operator @index_count attributes {no_grad = array<i64: 1, 2>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<3xi32>, %weight: tensor<3xf32>):
  // expected-error @+1 {{expects one index entry per result row: 'tensor<2x?xf32>' has 2 rows but 'tensor<3xi32>' has 3}}
  %kept = abp.sample %x, %index, %weight : tensor<?x?xf32>, tensor<3xi32>, tensor<3xf32> -> tensor<2x?xf32>
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

abp.operator @weight_count attributes {no_grad = array<i64: 1, 2>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<3xi32>, %weight: tensor<4xf32>):
  // expected-error @+1 {{expects one weight per index ('tensor<3xi32>'), got 'tensor<4xf32>'}}
  %kept = abp.sample %x, %index, %weight : tensor<?x?xf32>, tensor<3xi32>, tensor<4xf32> -> tensor<?x?xf32>
  abp.return %kept : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

abp.operator @vector_slot attributes {no_grad = array<i64: 1>} forward {
^bb0(%kept: tensor<?xf32>, %slot: tensor<?xi32>):
  // expected-error @+1 {{expects matrices (rank 2) in and out, got 'tensor<?xf32>' and 'tensor<?x?xf32>'}}
  %x = abp.unsample %kept, %slot : tensor<?xf32>, tensor<?xi32> -> tensor<?x?xf32>
  abp.return %kept : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}

// -----

// expected-error @+1 {{forward argument #1 of type 'tensor<?xi32>' has no gradient; list it in no_grad}}
abp.operator @index_without_no_grad forward {
^bb0(%kept: tensor<?x?xf32>, %slot: tensor<?xi32>):
  %x = abp.unsample %kept, %slot : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g, %g : tensor<?x?xf32>, tensor<?x?xf32>
}

// -----

// expected-error @+1 {{no_grad entry #0 (2) must name a tensor argument of forward (it has 3 argument(s))}}
abp.operator @no_grad_on_a_parameter attributes {no_grad = array<i64: 2>} forward {
^bb0(%x: tensor<?xf32>, %y: tensor<?xf32>, %a: f32):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g, %g : tensor<?xf32>, tensor<?xf32>
}

// -----

// expected-error @+1 {{no_grad lists forward argument #1 twice}}
abp.operator @no_grad_twice attributes {no_grad = array<i64: 1, 1>} forward {
^bb0(%x: tensor<?xf32>, %y: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}

// -----

// expected-error @+1 {{gathers argument #0 by argument #1, which must be an #abp.rows input the body sees as i32}}
abp.kernel @gather_by_floats attributes {ins = [#abp.gathered<1>, #abp.rows], outs = [#abp.dense], rows} {
^bb0(%x: f32, %i: f32):
  abp.yield %x : f32
}

// -----

// expected-error @+1 {{has a #abp.gathered argument but is not a row kernel}}
abp.kernel @gather_elementwise attributes {ins = [#abp.gathered<1>, #abp.dense], outs = [#abp.dense]} {
^bb0(%x: f32, %i: f32):
  abp.yield %x : f32
}
