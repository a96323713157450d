// A total kernel (abp.reduce_tensor): each thread's partial over its chunks in element order,
// then abp::totalFinish on the GPU and abp::hostTotalFinish on the CPU path (the same order);
// one symbol per dtype, f64 included. The kernel reading the result takes a pointer to it. Both
// builds compile: the host library and PTX through NVRTC.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=manifest | FileCheck %s --check-prefix=MANIFEST
// RUN: abp-compile %s --emit=host -o %t.so && abp-compile %s --emit=ptx --arch=sm_80 -o %t.ptx

// CHECK: // total kernel scaled_fwd_total0: the mean of one value per element over the whole launch
// CHECK: ABP_FN void scaled_fwd_total0_body(C a0, C &value) {
// CHECK: ABP_FN C scaled_fwd_total0_thread(const T *ABP_RESTRICT a0, abp::i64 n, abp::i64 first, abp::i64 stride) {
// CHECK: C acc = abp::reduceIdentity<C>(0);
// CHECK: for (int k = 0; k < N && i + k < n; ++k) {
// CHECK: acc = abp::reduceCombine(0, acc, value);
// CHECK: ABP_KERNEL void abp_scaled_fwd_total0_f32_{{[0-9a-f]+}}(const float *ABP_RESTRICT a0, float *ABP_RESTRICT r0, float *scratch, abp::i64 n) {
// CHECK-NEXT: abp::totalFinish<256, 0>(scaled_fwd_total0_thread<float, float>(a0, n, abp::globalThread(), abp::gridThreads()), r0, scratch, n, true);
// CHECK: abp::hostTotalFinish<256, 0>(acc, b, grid, r0, scratch, n, true);
// CHECK: abp_scaled_fwd_total0_f64_
// The direction's kernel reads the mean through a pointer, once per element of its chunk.
// CHECK: ABP_KERNEL void abp_scaled_fwd_f32_{{[0-9a-f]+}}(const float *ABP_RESTRICT a0, const float *ABP_RESTRICT a1, float *ABP_RESTRICT r0, abp::i64 n) {

// MANIFEST: "format": 4,
// MANIFEST: "residuals": [{"kind":"total"}],
// MANIFEST: "forward": {"kernel":"scaled_fwd","args":["input0","total0"],"totals":[{"kernel":"scaled_fwd_total0","args":["input0"]}],"produces":["result0","total0"]},
// MANIFEST: "backward": {"kernel":"scaled_bwd","args":["grad0","residual0"],"produces":["result0"]}
// MANIFEST: {"name":"scaled_fwd_total0","kind":"total","reduce":"mean",{{.*}}"args":[{"role":"in","layout":"dense"},{"role":"out","layout":"total"},{"role":"scratch","values":1025},{"role":"count"}]}
// MANIFEST: {"name":"scaled_fwd","kind":"elementwise",{{.*}}"args":[{"role":"in","layout":"dense"},{"role":"in","layout":"total"},{"role":"out","layout":"dense"},{"role":"count"}]}

abp.operator @scaled forward {
^bb0(%x: tensor<?xf32>):
  %m = abp.reduce_tensor mean %x : tensor<?xf32> -> f32
  %y = abp.map(%x, %m) : (tensor<?xf32>, f32) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.mulf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %y : tensor<?xf32> saves %m : f32
} backward {
^bb0(%m: f32, %g: tensor<?xf32>):
  %dx = abp.map(%g, %m) : (tensor<?xf32>, f32) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.mulf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %dx : tensor<?xf32>
}
