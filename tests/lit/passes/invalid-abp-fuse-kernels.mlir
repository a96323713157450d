// RUN: abp-opt %s -split-input-file -abp-fuse-kernels -verify-diagnostics

abp.operator @unlowered forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{cannot be fused into a kernel; only abp.map, abp.pack, abp.unpack, abp.reduce_rows and abp.broadcast_rows may remain after lowering}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} : tensor<?xf32> -> !abp.codes<1>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @unpacked_codes forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{produces an i8 code tensor that leaves the kernel unpacked; store codes with abp.pack}}
  %m = abp.map(%x) : (tensor<?xf32>) -> tensor<?xi8> {
  ^bb0(%v: f32):
    %e = arith.constant 1 : i8
    abp.yield %e : i8
  }
  abp.return %x : tensor<?xf32> saves %m : tensor<?xi8>
} backward {
^bb0(%m: tensor<?xi8>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

// Packed codes cannot enter a row kernel (yet): the diagnostic points at the codes.
abp.operator @codes_in_rows forward {
^bb0(%x: tensor<?x?xf32>):
  %m = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xi8> {
  ^bb0(%a: f32):
    %z = arith.constant 0.0 : f32
    %b = arith.cmpf ogt, %a, %z : f32
    %e = arith.extui %b : i1 to i8
    abp.yield %e : i8
  }
  %c = abp.pack %m : tensor<?x?xi8> -> !abp.codes<1>
  abp.return %x : tensor<?x?xf32> saves %c : !abp.codes<1>
} backward {
// expected-error @+1 {{packed codes cannot enter a row kernel (not supported yet)}}
^bb0(%c: !abp.codes<1>, %g: tensor<?x?xf32>):
  %d = abp.unpack %c : !abp.codes<1> -> tensor<?x?xi8>
  %m = abp.reduce_rows sum %g : tensor<?x?xf32> -> tensor<?xf32>
  %mb = abp.broadcast_rows %m : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%d, %mb) : (tensor<?x?xi8>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%k: i8, %s: f32):
    %f = arith.uitofp %k : i8 to f32
    %p = arith.mulf %f, %s : f32
    abp.yield %p : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
