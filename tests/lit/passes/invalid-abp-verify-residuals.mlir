// RUN: abp-opt %s -split-input-file -abp-verify-residuals -verify-diagnostics

abp.operator @unused forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{saves residual #0 but backward never uses it}}
  abp.return %x : tensor<?xf32> saves %x : tensor<?xf32>
} backward {
// expected-note @+1 {{the unused backward argument}}
^bb0(%x: tensor<?xf32>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @twice forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{saves the same value twice (residual #1)}}
  abp.return %x : tensor<?xf32> saves %x, %x : tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%a: tensor<?xf32>, %b: tensor<?xf32>, %dy: tensor<?xf32>):
  abp.return %a : tensor<?xf32>
}
