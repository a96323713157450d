// abp.uniform in an elementwise kernel: the body takes the element's flat index and the thread's
// Philox cache; i64 parameters are passed by value as abp::u64 and declared "i64" in the manifest.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=manifest | FileCheck %s --check-prefix=MANIFEST

// Kernel arguments come in first-use order: seed and offset (the draw), then x.
// CHECK: ABP_FN void noise_fwd_body(abp::u64 a0, abp::u64 a1, float a2, float & r0, abp::i64 idx, abp::PhiloxCache &rng) {
// CHECK: abp::uniformAt(rng, a0, a1 + idx)
// CHECK: abp::PhiloxCache rng;
// CHECK: noise_fwd_body(a0, a1, e_a2[k], e_r0[k], i + k, rng);
// CHECK: ABP_KERNEL void abp_noise_fwd_f32_{{[0-9a-f]+}}(abp::u64 a0, abp::u64 a1, const float *ABP_RESTRICT a2, float *ABP_RESTRICT r0, abp::i64 n) {
// CHECK: abp::u64 a0 = *static_cast<abp::u64 *>(args[0]);

// MANIFEST: "params": ["seed","offset"],
// MANIFEST: "args":[{"role":"scalar","type":"i64"},{"role":"scalar","type":"i64"},{"role":"in","layout":"dense"},{"role":"out","layout":"dense"},{"role":"count"}]

abp.operator @noise attributes {params = ["seed", "offset"]} forward {
^bb0(%x: tensor<?xf32>, %seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?xf32>
  %y = abp.map(%x, %u) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.addf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}

// 16-bit draws take uniform16At (half-word c mod 8 of the Philox block c / 8).
// CHECK: ABP_FN void noise16_fwd_body(
// CHECK: abp::uniform16At(rng, a0, a1 + idx)
abp.operator @noise16 attributes {params = ["seed", "offset"]} forward {
^bb0(%x: tensor<?xf32>, %seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset {bits = 16 : i32} : i64, i64 -> tensor<?xf32>
  %y = abp.map(%x, %u) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.addf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %y : tensor<?xf32>
} backward {
^bb0(%g: tensor<?xf32>):
  abp.return %g : tensor<?xf32>
}
