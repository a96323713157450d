// Per-column broadcasts and sums check their shapes, what they may be combined with, and where
// a column sum may go.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

abp.operator @col_count forward {
^bb0(%x: tensor<?x4xf32>, %w: tensor<5xf32>):
  // expected-error @+1 {{expects one value per column: 'tensor<?x4xf32>' has 4 columns but 'tensor<5xf32>' has 5}}
  %wb = abp.broadcast_cols %w : tensor<5xf32> -> tensor<?x4xf32>
  abp.return %wb : tensor<?x4xf32>
} backward {
^bb0(%dy: tensor<?x4xf32>):
  %dw = abp.reduce_cols sum %dy : tensor<?x4xf32> -> tensor<5xf32>
  abp.return %dy, %dw : tensor<?x4xf32>, tensor<5xf32>
}

// -----

abp.operator @both_ways forward {
^bb0(%x: tensor<?x?xf32>, %v: tensor<?xf32>):
  %rb = abp.broadcast_rows %v : tensor<?xf32> -> tensor<?x?xf32>
  // expected-error @+1 {{broadcasts a value that 'abp.broadcast_rows' uses per row; a tensor<?xf32> is either one value per row or one per column}}
  %cb = abp.broadcast_cols %v : tensor<?xf32> -> tensor<?x?xf32>
  abp.return %rb : tensor<?x?xf32>
} backward {
^bb0(%dy: tensor<?x?xf32>):
  abp.return %dy, %dy : tensor<?x?xf32>, tensor<?x?xf32>
}

// -----

abp.operator @not_a_sum forward {
^bb0(%x: tensor<?x?xf32>):
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%dy: tensor<?x?xf32>):
  // expected-error @+1 {{supports only `sum` (the gradient of a per-column input), got `max`}}
  %m = abp.reduce_cols max %dy : tensor<?x?xf32> -> tensor<?xf32>
  abp.return %dy : tensor<?x?xf32>
}

// -----

abp.operator @used_again forward {
^bb0(%x: tensor<?x?xf32>, %w: tensor<?xf32>):
  %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
  abp.return %wb : tensor<?x?xf32>
} backward {
^bb0(%dy: tensor<?x?xf32>):
  // expected-error @+1 {{result may only be returned as a gradient by backward's abp.return (the sum runs after the direction's kernel), but it is used by abp.broadcast_cols}}
  %dw = abp.reduce_cols sum %dy : tensor<?x?xf32> -> tensor<?xf32>
  %again = abp.broadcast_cols %dw : tensor<?xf32> -> tensor<?x?xf32>
  abp.return %again, %dw : tensor<?x?xf32>, tensor<?xf32>
}

// -----

abp.operator @in_forward forward {
^bb0(%x: tensor<?x?xf32>):
  // expected-error @+1 {{must be in an operator's backward region: it sums a per-column input's gradient over the rows}}
  %s = abp.reduce_cols sum %x : tensor<?x?xf32> -> tensor<?xf32>
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%dy: tensor<?x?xf32>):
  abp.return %dy : tensor<?x?xf32>
}
