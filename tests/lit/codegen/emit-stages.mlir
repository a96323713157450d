// Every stage of abp-compile can be emitted, and ABP_DUMP_DIR keeps all of them.
// RUN: abp-compile %s --emit=mlir | FileCheck %s --check-prefix=MLIR
// RUN: abp-compile %s --emit=kernel | FileCheck %s --check-prefix=KERNEL
// RUN: abp-compile %s --emit=ptx --arch=sm_90 | FileCheck %s --check-prefix=PTX
// RUN: abp-compile %s --emit=cubin --arch=sm_80 -o %t.cubin && test -s %t.cubin
// RUN: abp-compile %s --emit=host -o %t.so && nm -D %t.so | FileCheck %s --check-prefix=HOST
// RUN: not env ABP_HOST_CXX=/nonexistent abp-compile %s --emit=host -o %t.bad.so 2>&1 | FileCheck %s --check-prefix=NOCXX
// RUN: rm -rf %t.dump %t.bundle && env ABP_DUMP_DIR=%t.dump abp-compile %s --emit=bundle -o %t.bundle
// RUN: ls %t.dump/emit-stages | FileCheck %s --check-prefix=DUMP
// RUN: ls %t.bundle | FileCheck %s --check-prefix=BUNDLE

// NOCXX: abp: the host compiler failed on 'emit-stages'
// NOCXX: compiler log (cannot run '/nonexistent')
// MLIR: abp.operator @twice forward
// MLIR: abp.quantize
// KERNEL: abp.kernel @twice_fwd attributes {block_size = 256 : i64, chunk = 8 : i64
// KERNEL: abp.launch @twice_fwd
// PTX: .target sm_90
// PTX: .visible .entry abp_twice_fwd_f32_
// PTX: ld.global.nc.v4
// HOST-DAG: T abp_twice_bwd_bf16_{{[0-9a-f]+}}__host
// HOST-DAG: T abp_twice_fwd_f32_{{[0-9a-f]+}}__host
// DUMP: after-01-abp-verify-module.mlir
// DUMP: after-02-abp-instantiate-variants.mlir
// DUMP: after-03-abp-verify-residuals.mlir
// DUMP: after-06-abp-fuse-kernels.mlir
// DUMP: after-09-abp-map-threads.mlir
// DUMP: input.mlir
// DUMP: kernel.cu
// DUMP: manifest.json
// BUNDLE: emit-stages.cu
// BUNDLE: emit-stages.json
#s = #abp.buckets<borders = [0.0], levels = [0.5, 2.0]>
func.func private @double(%x: f32) -> f32 {
  %c = arith.constant 2.0 : f32
  %y = arith.mulf %x, %c : f32
  return %y : f32
}
abp.operator @twice forward {
^bb0(%x: tensor<?xf32>):
  %y = abp.map @double(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #s} : tensor<?xf32> -> !abp.codes<1>
  abp.return %y : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #s} : !abp.codes<1> -> tensor<?xf32>
  %dx = abp.map @double(%d) : (tensor<?xf32>) -> tensor<?xf32>
  abp.return %dx : tensor<?xf32>
}
