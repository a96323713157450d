// The group codec ops, abp.uniform and i64 kernel scalars reject misuse with located errors.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

abp.operator @scalar_draw forward {
^bb0(%x: tensor<?xf32>, %seed: i64, %offset: i64):
  // expected-error @+1 {{yields an f32 draw only in a kernel body, where each element has its index}}
  %u = abp.uniform %seed, %offset : i64, i64 -> f32
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}

// -----

abp.operator @odd_width_draw forward {
^bb0(%x: tensor<?xf32>, %seed: i64, %offset: i64):
  // expected-error @+1 {{draws 24-bit or 16-bit uniforms, got bits = 12}}
  %u = abp.uniform %seed, %offset {bits = 12 : i32} : i64, i64 -> tensor<?xf32>
  abp.return %x : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}

// -----

abp.operator @flat_groups forward {
^bb0(%x: tensor<?xf32>, %seed: i64, %offset: i64):
  // expected-error @+1 {{expects a row-wide tensor<?x?xf32> and a per-row tensor<?xf32>}}
  %c, %m, %s = abp.quantize_groups %x, %seed, %offset
      : tensor<?xf32>, i64, i64 -> !abp.codes<2>, tensor<?xf32>, tensor<?xf32>
  abp.return saves %c, %m, %s : !abp.codes<2>, tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%c: !abp.codes<2>, %m: tensor<?xf32>, %s: tensor<?xf32>):
  abp.return %m : tensor<?xf32>
}

// -----

abp.operator @wrong_rows forward {
^bb0(%x: tensor<?x?xf32>, %c: !abp.codes<2>, %m: tensor<4xf32>, %s: tensor<?xf32>):
  // expected-error @+1 {{expects one value per row: 'tensor<3x?xf32>' has 3 rows but 'tensor<4xf32>' has 4}}
  %y = abp.dequantize_groups %c, %m, %s : !abp.codes<2>, tensor<4xf32>, tensor<?xf32> -> tensor<3x?xf32>
  abp.return %x : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

// expected-error @+1 {{body argument #1 must be 'f32' or i64 for layout #abp.scalar, got 'i32'}}
abp.kernel @int_scalar attributes {ins = [#abp.dense, #abp.scalar], outs = [#abp.dense]} {
^bb0(%x: f32, %k: i32):
  abp.yield %x : f32
}
