// Row reductions and broadcasts check their shapes and where scalar forms may appear.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

abp.operator @bad_rank forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{expects a row-wide tensor<?x?xf32> and a per-row tensor<?xf32>, got 'tensor<?xf32>' and 'tensor<?xf32>'}}
  %m = abp.reduce_rows sum %x : tensor<?xf32> -> tensor<?xf32>
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @row_count forward {
^bb0(%x: tensor<4x?xf32>):
  // expected-error @+1 {{expects one value per row: 'tensor<4x?xf32>' has 4 rows but 'tensor<5xf32>' has 5}}
  %m = abp.reduce_rows mean %x : tensor<4x?xf32> -> tensor<5xf32>
  abp.return %x : tensor<4x?xf32>
} backward {
^bb0(%dy: tensor<4x?xf32>):
  abp.return %dy : tensor<4x?xf32>
}

// -----

abp.operator @broadcast_shape forward {
^bb0(%x: tensor<?x?xf32>, %r: tensor<?x?xf32>):
  // expected-error @+1 {{expects a row-wide tensor<?x?xf32> and a per-row tensor<?xf32>}}
  %b = abp.broadcast_rows %r : tensor<?x?xf32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%dy: tensor<?x?xf32>):
  abp.return %dy, %dy : tensor<?x?xf32>, tensor<?x?xf32>
}

// -----

// The scalar form belongs to row-kernel bodies only.
abp.kernel @elementwise attributes {ins = [#abp.dense], outs = [#abp.dense]} {
^bb0(%x: f32):
  // expected-error @+1 {{on f32 scalars is only valid in the body of a row kernel}}
  %s = abp.reduce_rows sum %x : f32 -> f32
  abp.yield %s : f32
}

// -----

// expected-error @+1 {{has a #abp.rows argument but is not a row kernel (`rows`)}}
abp.kernel @rows_layout attributes {ins = [#abp.rows], outs = [#abp.dense]} {
^bb0(%x: f32):
  abp.yield %x : f32
}

