// The CUDA emitter: scalar bodies, the chunked grid-stride loop with 128-bit and packed
// accesses, one extern "C" entry per dtype, the CPU-path entries, and the manifest.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=manifest | FileCheck %s --check-prefix=MANIFEST

// The map's callee @scale is inlined into the kernel body: no helper function is emitted.
// CHECK: #include "abp_device.h"
// CHECK-NOT: fn_scale
// CHECK-LABEL: // kernel op_fwd: 8 element(s) per thread and step, 256 threads per block
// CHECK: ABP_FN void op_fwd_body(float a0, float & r0, abp::u32 & r1) {
// CHECK: const float v[[TWO:[0-9]+]] = 2.0f;
// CHECK: const float v{{[0-9]+}} = a0 * v[[TWO]];
// CHECK: const bool v{{[0-9]+}} = (a0 > v{{[0-9]+}});
// CHECK: template <typename T>
// CHECK: ABP_FN void op_fwd_loop(const T *ABP_RESTRICT a0, T *ABP_RESTRICT r0, abp::u8 *ABP_RESTRICT r1, abp::i64 n, abp::i64 first, abp::i64 stride, abp::i64 last) {
// CHECK: constexpr int N = 8;
// CHECK: const bool aligned = abp::aligned16(a0) && abp::aligned16(r0);
// CHECK: const abp::i64 end = last < chunks ? last : chunks;
// CHECK: for (abp::i64 c = first; c < end; c += stride) {
// CHECK: abp::loadChunk<N>(a0, i, n, vec, e_a0);
// CHECK: op_fwd_body(e_a0[k], e_r0[k], e_r1[k]);
// CHECK: abp::storeChunk<N>(r0, i, n, vec, e_r0);
// CHECK: if (i + k >= n) e_r1[k] = 0;
// CHECK: abp::storePacked<N * 3 / 8>(r1, c * (N * 3 / 8), full ? N * 3 / 8 : ((n - i) * 3 + 7) / 8, abp::packCodes<3, N>(e_r1));
// CHECK: ABP_KERNEL void abp_op_fwd_f32_[[H:[0-9a-f]{8}]](const float *ABP_RESTRICT a0, float *ABP_RESTRICT r0, abp::u8 *ABP_RESTRICT r1, abp::i64 n) {
// CHECK-NEXT: op_fwd_loop<float>(a0, r0, r1, n, abp::globalThread(), abp::gridThreads(), n);
// CHECK: extern "C" void abp_op_fwd_f32_[[H]]__host(void **args, abp::i64 grid, abp::i64 block, abp::i64 b0, abp::i64 b1) {
// CHECK: const abp::i64 chunks = (n + 8 - 1) / 8;
// CHECK-NEXT: for (abp::i64 base = 0; base < chunks; base += grid * block)
// CHECK-NEXT: op_fwd_loop<float>(a0, r0, r1, n, base + b0 * block, 1, base + b1 * block);
// CHECK: ABP_KERNEL void abp_op_fwd_f16_[[H]](const abp::f16 *ABP_RESTRICT a0,
// CHECK: ABP_KERNEL void abp_op_fwd_bf16_[[H]](const abp::bf16 *ABP_RESTRICT a0,

// CHECK-LABEL: // kernel op_bwd:
// CHECK: ABP_FN void op_bwd_body(abp::u8 a0, float a1, float a2, float & r0) {
// CHECK: abp::unpackCodes<3, N>(abp::loadPacked<N * 3 / 8>(a0, c * (N * 3 / 8), full ? N * 3 / 8 : ((n - i) * 3 + 7) / 8), e_a0);
// CHECK: op_bwd_body((abp::u8)e_a0[k], e_a1[k], a2, e_r0[k]);
// CHECK: ABP_KERNEL void abp_op_bwd_f32_{{[0-9a-f]+}}(const abp::u8 *ABP_RESTRICT a0, const float *ABP_RESTRICT a1, float a2, float *ABP_RESTRICT r0, abp::i64 n) {

// MANIFEST: "format": 4,
// MANIFEST: "name": "op",
// MANIFEST: "inputs": 1,
// MANIFEST: "outputs": 1,
// MANIFEST: "params": ["scale"],
// MANIFEST: "row_wise": false,
// MANIFEST: "residuals": [{"kind":"codes","bits":3},{"kind":"scalar"}],
// MANIFEST: "saved_bits_per_element": 3,
// MANIFEST: "saved_bits_per_row": 0,
// MANIFEST: "tables": [{"borders":[-3,-2,-1,0,1,2,3],"levels":[0,0.100000001,0.200000003,0.300000012,0.400000006,0.5,0.600000024,0.699999988]}],
// MANIFEST: "forward": {"kernel":"op_fwd","args":["input0"],"produces":["result0","result1","param0"]},
// MANIFEST: "backward": {"kernel":"op_bwd","args":["residual0","grad0","residual1"],"produces":["result0"]}
// MANIFEST: "kernels": [
// MANIFEST: {"name":"op_fwd","kind":"elementwise","symbols":{"f32":"abp_op_fwd_f32_{{[0-9a-f]+}}","f16":"abp_op_fwd_f16_{{[0-9a-f]+}}","bf16":"abp_op_fwd_bf16_{{[0-9a-f]+}}"},"block":256,"chunk":8,"args":[{"role":"in","layout":"dense"},{"role":"out","layout":"dense"},{"role":"out","layout":"packed","bits":3},{"role":"count"}]}
// MANIFEST: {"name":"op_bwd",{{.*}}"args":[{"role":"in","layout":"packed","bits":3},{"role":"in","layout":"dense"},{"role":"scalar","type":"f32"},{"role":"out","layout":"dense"},{"role":"count"}]}

#s = #abp.buckets<borders = [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0], levels = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]>
func.func private @scale(%x: f32) -> f32 {
  %c = arith.constant 2.0 : f32
  %y = arith.mulf %x, %c : f32
  return %y : f32
}
abp.operator @op attributes {params = ["scale"]} forward {
^bb0(%x: tensor<?xf32>, %s: f32):
  %y = abp.map @scale(%x) : (tensor<?xf32>) -> tensor<?xf32>
  %c = abp.quantize %x {scheme = #s} : tensor<?xf32> -> !abp.codes<3>
  abp.return %y : tensor<?xf32> saves %c, %s : !abp.codes<3>, f32
} backward {
^bb0(%c: !abp.codes<3>, %s: f32, %dy: tensor<?xf32>):
  %d = abp.dequantize %c {scheme = #s} : !abp.codes<3> -> tensor<?xf32>
  %dx = abp.map(%d, %dy) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %m = arith.mulf %a, %b : f32
    %r = arith.mulf %m, %s : f32
    abp.yield %r : f32
  }
  abp.return %dx : tensor<?xf32>
}
