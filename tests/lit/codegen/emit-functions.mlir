// Scalar functions that hand-written kernels call are emitted as device templates over the
// compute type, declarations first (bodies may call each other in any order); functions no
// kernel reaches, directly or through another function, are not emitted. The host build proves
// the source compiles.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=host -o %t.so

// CHECK: // Scalar functions of the module (func.func), called from kernel bodies.
// CHECK-NEXT: template <typename C> ABP_FN C fn_twice(C a0);
// CHECK-NEXT: template <typename C> ABP_FN C fn_twice_plus_one(C a0);
// CHECK-NOT: fn_unused
// CHECK: template <typename C> ABP_FN C fn_twice(C a0) {
// CHECK: template <typename C> ABP_FN C fn_twice_plus_one(C a0) {
// CHECK: const C v{{[0-9]+}} = fn_twice<C>(a0);
// CHECK-LABEL: // kernel calls:
// CHECK: const float v{{[0-9]+}} = fn_twice_plus_one<float>(a0);
// CHECK-NOT: fn_unused
func.func private @twice(%x: f32) -> f32 {
  %y = arith.addf %x, %x : f32
  return %y : f32
}
func.func private @unused(%x: f32) -> f32 {
  return %x : f32
}
func.func private @twice_plus_one(%x: f32) -> f32 {
  %one = arith.constant 1.0 : f32
  %t = func.call @twice(%x) : (f32) -> f32
  %y = arith.addf %t, %one : f32
  return %y : f32
}
abp.kernel @calls attributes {ins = [#abp.dense], outs = [#abp.dense], block = 256, chunk = 4} {
^bb0(%x: f32):
  %y = func.call @twice_plus_one(%x) : (f32) -> f32
  abp.yield %y : f32
}
