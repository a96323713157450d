// RUN: abp-opt %s -split-input-file -abp-instantiate-variants -verify-diagnostics

// expected-error @+1 {{has variants but no abp.quantize/abp.dequantize scheme to vary}}
abp.operator @none variants {none_b1 = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// expected-error @+1 {{has variants but uses more than one bucket scheme}}
abp.operator @two variants {two_b1 = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} forward {
^bb0(%x: tensor<?xf32>):
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} : tensor<?xf32> -> !abp.codes<1>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #abp.buckets<borders = [1.0], levels = [0.0, 1.0]>} : !abp.codes<1> -> tensor<?xf32>
  abp.return %d : tensor<?xf32>
}

// -----

abp.operator @taken forward {
^bb0(%x: tensor<?xf32>):
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}
// expected-error @+1 {{variant name @taken is already a symbol of the module}}
abp.operator @clash variants {taken = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} forward {
^bb0(%x: tensor<?xf32>):
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [1.0], levels = [0.0, 1.0]>} : tensor<?xf32> -> !abp.codes<1>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #abp.buckets<borders = [1.0], levels = [0.0, 1.0]>} : !abp.codes<1> -> tensor<?xf32>
  abp.return %d : tensor<?xf32>
}
