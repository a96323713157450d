// RUN: abp-opt %s -split-input-file -abp-fuse-kernels -verify-diagnostics

abp.operator @unlowered forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{cannot be fused into a kernel; only abp.map, abp.pack, abp.unpack, abp.uniform, abp.reduce_rows and abp.broadcast_rows may remain after lowering}}
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

