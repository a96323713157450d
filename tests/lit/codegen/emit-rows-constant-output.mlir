// A row kernel may yield a constant as it is, to a per-row output or to every element: it gets
// a field of the uniforms like any row-uniform value (found by the fuzzer: the stores once read
// `r0[row] = ;` and `o0 = ;`). The host build proves the source compiles.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=host -o %t.so

// CHECK-LABEL: ABP_FN void const_to_rows_stage0(
// CHECK: u.u[[ONE:[0-9]+]] = v{{[0-9]+}};
// CHECK: r0[row] = u.u[[ONE]];
abp.kernel @const_to_rows attributes {ins = [#abp.dense], outs = [#abp.rows, #abp.dense], rows} {
^bb0(%x: f32):
  %one = arith.constant 1.0 : f32
  abp.yield %one, %one : f32, f32
}

// CHECK-LABEL: ABP_FN void const_to_elements_stage0(
// CHECK: u.u[[TWO:[0-9]+]] = v{{[0-9]+}};
// CHECK: ABP_FN void const_to_elements_elem0(
// CHECK: o0 = u.u[[TWO]];
abp.kernel @const_to_elements attributes {ins = [#abp.dense], outs = [#abp.dense], rows} {
^bb0(%x: f32):
  %two = arith.constant 2.0 : f32
  abp.yield %two : f32
}
