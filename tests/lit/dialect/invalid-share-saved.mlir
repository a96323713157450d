// share_saved: the residual must be an output its consumer keeps, and an operator that shares
// may save nothing else per element — in particular not its input.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

// A backward that still reads the input is rejected, at the forward terminator.
abp.operator @still_reads_input forward {
^bb0(%x: tensor<?x?xf32>):
  %y = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  // expected-error @+1 {{shares a saved tensor, so residual #1 must be a per-row statistic (a rank-1 tensor) or an f32 parameter, got 'tensor<?x?xf32>'; backward would read forward input #0, which the shared output is meant to replace}}
  abp.return %y : tensor<?x?xf32> saves %ys, %x : tensor<?x?xf32>, tensor<?x?xf32>
} backward {
^bb0(%y: tensor<?x?xf32>, %x: tensor<?x?xf32>, %g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

// A full-size value computed from the input is just as bad: it is the input again.
abp.operator @saves_a_copy forward {
^bb0(%x: tensor<?x?xf32>):
  %y = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  }
  // expected-note @+1 {{the full-size residual is computed here}}
  %c = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  // expected-error @+1 {{residual #1 must be a per-row statistic}}
  abp.return %y : tensor<?x?xf32> saves %ys, %c : tensor<?x?xf32>, tensor<?x?xf32>
} backward {
^bb0(%y: tensor<?x?xf32>, %c: tensor<?x?xf32>, %g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

abp.operator @not_an_output forward {
^bb0(%x: tensor<?x?xf32>):
  %y = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  }
  // expected-error @+1 {{must share an output of the operator}}
  %xs = abp.share_saved %x : tensor<?x?xf32>
  abp.return %y : tensor<?x?xf32> saves %xs : tensor<?x?xf32>
} backward {
^bb0(%xs: tensor<?x?xf32>, %g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

abp.operator @used_in_forward forward {
^bb0(%x: tensor<?x?xf32>):
  // expected-error @+1 {{result may only be saved by the forward abp.return, but it is used by abp.map}}
  %xs = abp.share_saved %x : tensor<?x?xf32>
  %y = abp.map(%xs) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    abp.yield %a : f32
  }
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

abp.operator @in_backward forward {
^bb0(%x: tensor<?x?xf32>):
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  // expected-error @+1 {{must be in the forward region}}
  %gs = abp.share_saved %g : tensor<?x?xf32>
  abp.return %g : tensor<?x?xf32>
}
