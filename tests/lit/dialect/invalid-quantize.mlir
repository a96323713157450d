// Bucket schemes and codes types are checked where they are written.
// RUN: abp-opt %s -split-input-file -verify-diagnostics

func.func private @f(%x: tensor<?xf32>) -> !abp.codes<2> {
  // expected-error @+1 {{#abp.buckets expects strictly increasing borders (in fp32), but border #2 (5.000000e-01) does not exceed border #1 (1.000000e+00)}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0, 1.0, 0.5], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  return %c : !abp.codes<2>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> !abp.codes<2> {
  // expected-error @+1 {{#abp.buckets expects a power-of-two number of levels in [2, 256] (2^bits for 1..8 bits), got 3}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0, 1.0], levels = [0.0, 0.5, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  return %c : !abp.codes<2>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> !abp.codes<2> {
  // expected-error @+1 {{#abp.buckets expects 3 inner borders for 4 levels, got 2}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<2>
  return %c : !abp.codes<2>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> !abp.codes<3> {
  // expected-error @+1 {{'abp.quantize' op expects 2^bits = 8 levels for '!abp.codes<3>', but the scheme has 4}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : tensor<?xf32> -> !abp.codes<3>
  return %c : !abp.codes<3>
}

// -----

func.func private @f(%c: !abp.codes<1>) -> tensor<?xf32> {
  // expected-error @+1 {{'abp.dequantize' op expects 2^bits = 2 levels for '!abp.codes<1>', but the scheme has 4}}
  %d = abp.dequantize %c {scheme = #abp.buckets<borders = [-1.0, 0.0, 1.0], levels = [0.0, 0.25, 0.75, 1.0]>} : !abp.codes<1> -> tensor<?xf32>
  return %d : tensor<?xf32>
}

// -----

// expected-error @+1 {{!abp.codes expects bits in [1, 8], got 9}}
func.func private @f(%c: !abp.codes<9>)

// -----

// expected-error @+1 {{#abp.packed expects bits in [1, 8], got 0}}
func.func private @f() attributes {layout = #abp.packed<0>}

// -----

func.func private @f(%x: tensor<?xf32>) -> !abp.codes<1> {
  // expected-error @+1 {{#abp.buckets border #0 (nan) is not a finite f32 value}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0x7FF8000000000000], levels = [0.0, 1.0]>} : tensor<?xf32> -> !abp.codes<1>
  return %c : !abp.codes<1>
}

// -----

// Finite in f64, but not in the f32 the kernels and manifests hold.
func.func private @f(%x: tensor<?xf32>) -> !abp.codes<1> {
  // expected-error @+1 {{#abp.buckets level #1 (1.000000e+39) is not a finite f32 value}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0e39]>} : tensor<?xf32> -> !abp.codes<1>
  return %c : !abp.codes<1>
}

// -----

func.func private @f(%x: tensor<?xf32>) -> !abp.codes<1> {
  // expected-error @+1 {{#abp.buckets border #0 (-1.000000e+39) is not a finite f32 value}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [-1.0e39], levels = [0.0, 1.0]>} : tensor<?xf32> -> !abp.codes<1>
  return %c : !abp.codes<1>
}
