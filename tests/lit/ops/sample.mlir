// ops/sample/sample.mlir: the sampled linear layers' kernels. Row norms are one reduction stage;
// the sample_rows codec gathers rows through an i32 index as it reads them (a null row pointer,
// from a negative slot, reads zeros); the draws and sketches are elementwise kernels without a
// tensor input.
// RUN: abp-compile %abp_src/ops/sample/sample.mlir --emit=kernel | FileCheck %s
// RUN: abp-compile %abp_src/ops/sample/sample.mlir --emit=cuda | FileCheck %s --check-prefix=CUDA
// RUN: abp-compile %abp_src/ops/sample/sample.mlir --emit=manifest | FileCheck %s --check-prefix=MANIFEST
// CHECK: abp.kernel @row_norms_fwd
// CHECK-SAME: ins = [#abp.dense], outs = [#abp.rows], rows
// CHECK: abp.reduce_rows sum
// CHECK: math.sqrt
// CHECK: abp.kernel @sample_rows_fwd
// CHECK-SAME: ins = [#abp.gathered<1>, #abp.rows, #abp.rows], outs = [#abp.dense], rows
// CHECK: abp.kernel @sample_rows_bwd
// CHECK-SAME: ins = [#abp.gathered<1>, #abp.rows], outs = [#abp.dense], rows
// CHECK: abp.kernel @philox_uniform_fwd
// CHECK-SAME: ins = [#abp.scalar, #abp.scalar], outs = [#abp.dense]
// CHECK: abp.kernel @sketch_gaussian_fwd
// CHECK: math.cos

// CUDA-LABEL: row kernel sample_rows_fwd: 0 reduction stage(s)
// CUDA: abp::u32 u0;
// CUDA: if (a0)
// CUDA-NEXT: abp::loadChunk<N>(a0, j, cols, vec, e_a0);
// CUDA-NEXT: else
// CUDA-NEXT: for (int k = 0; k < N; ++k) e_a0[k] = (C)0;
// CUDA: ABP_FN void sample_rows_fwd_rows(const T *ABP_RESTRICT a0, const abp::i32 *ABP_RESTRICT a1, const C *ABP_RESTRICT a2, T *ABP_RESTRICT r0, abp::i64 rows, abp::i64 cols, C *scratch) {
// CUDA: u.u0 = live ? a1[row] : (abp::i32)0;
// CUDA: const T *g_a0 = (abp::i32)u.u0 >= 0 ? a0 + (abp::i64)(abp::i32)u.u0 * cols : nullptr;
// CUDA: sample_rows_fwd_sweep0<T, C, RT, K>(u, g_a0, r0 + base, cols, lane);
// CUDA: u.u0 = a1[row];
// CUDA-LABEL: row kernel sample_rows_bwd
// CUDA: abp::cos(

// MANIFEST: "name": "sample_rows",
// MANIFEST-NEXT: "inputs": 4,
// MANIFEST-NEXT: "outputs": 0,
// MANIFEST-NEXT: "params": [],
// MANIFEST-NEXT: "row_wise": true,
// MANIFEST-NEXT: "no_grad": [1,2,3],
// MANIFEST-NEXT: "residuals": [{"kind":"tensor","bits":32},{"kind":"rows","bits":32}],
// MANIFEST: "forward": {"kernel":"sample_rows_fwd","args":["input0","input1","input2"],"produces":["result0","input3"]},
// MANIFEST-NEXT: "backward": {"kernel":"sample_rows_bwd","args":["residual0","residual1"],"produces":["result0"]}
// MANIFEST: "name": "philox_uniform",
// MANIFEST-NEXT: "inputs": 0,
// MANIFEST: "backward": {"kernel":null,"args":[],"produces":[]}
// MANIFEST: {"name":"sample_rows_fwd","kind":"rows"
// MANIFEST-SAME: "args":[{"role":"in","layout":"gathered","by":1},{"role":"in","layout":"rows","type":"i32"},{"role":"in","layout":"rows"},{"role":"out","layout":"dense"},{"role":"rows"},{"role":"cols"}]
