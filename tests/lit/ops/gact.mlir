// ops/gact/gact.mlir: each codec is one row kernel per direction. Forward: min and max in one
// reduction stage, then a sweep drawing Philox uniforms and packing the codes; i64 seed and offset
// are scalar arguments. Backward: unpack and q / s + m with no reduction.
// RUN: abp-compile %abp_src/ops/gact/gact.mlir --emit=kernel | FileCheck %s
// RUN: abp-compile %abp_src/ops/gact/gact.mlir --emit=cuda | FileCheck %s --check-prefix=CUDA
// RUN: abp-compile %abp_src/ops/gact/gact.mlir --emit=manifest | FileCheck %s --check-prefix=MANIFEST
// CHECK: abp.kernel @gact_b1_fwd
// CHECK-SAME: ins = [#abp.dense, #abp.scalar, #abp.scalar], outs = [#abp.rows, #abp.rows, #abp.packed<1>], rows
// CHECK: ^bb0(%{{.*}}: f32, %{{.*}}: i64, %{{.*}}: i64):
// CHECK: abp.uniform %{{[^ ]*}}, %{{[^ ]*}} {bits = 16 : i32} : i64, i64 -> f32
// CHECK: abp.kernel @gact_b1_bwd
// CHECK-SAME: ins = [#abp.packed<1>, #abp.rows, #abp.rows], outs = [#abp.dense], rows
// CHECK: abp.operator @gact_b1 attributes {abp.saved_bits = 1 : i64, abp.saved_row_bits = 64 : i64
// CHECK: abp.operator @gact_b8 attributes {abp.saved_bits = 8 : i64, abp.saved_row_bits = 64 : i64

// CUDA-LABEL: row kernel gact_b4_fwd: 1 reduction stage(s)
// CUDA: abp::u64 u0;
// CUDA: abp::u64 u1;
// The range sweep draws nothing, so it takes no flat index.
// The range sweep keeps a short row's x for the quantizing sweep (one read of the row).
// CUDA: ABP_FN void gact_b4_fwd_sweep0(const gact_b4_fwd_uniforms<C> &u, const T *ABP_RESTRICT a0, abp::i64 cols, int lane, C *acc, C (&keep_a0)[K > 0 ? K : 1][8]) {
// CUDA: acc[0] = abp::reduceCombine(abp::kReduceMin, acc[0], o0);
// CUDA: acc[1] = abp::reduceCombine(abp::kReduceMax, acc[1], o1);
// CUDA: ABP_FN void gact_b4_fwd_elem1(const gact_b4_fwd_uniforms<C> &u, C a0, C d0, abp::u32 &o0) {
// CUDA: abp::floor(
// CUDA: abp::toUnsignedSat<abp::u8>(
// The sweep draws a chunk at a time (16-bit draws: one Philox call per eight elements), at the
// row's first flat index plus the chunk's column.
// CUDA: abp::uniform16Chunk<N>(u.u0, u.u1 + (abp::u64)(base + j), d0_);
// CUDA: gact_b4_fwd_elem1<C>(u, e_a0[k], (C)d0_[k], e_r2[k]);
// CUDA: abp::storePacked<N * 4 / 8>(r2, j * 4 / 8, full ? N * 4 / 8 : ((cols - j) * 4 + 7) / 8, abp::packCodes<4, N>(e_r2));
// CUDA: , r2 + base * 4 / 8, cols, lane, base, keep_a0);
// CUDA-LABEL: row kernel gact_b4_bwd: 0 reduction stage(s)
// CUDA: abp::unpackCodes<4, N>(abp::loadPacked<N * 4 / 8>(a0, j * 4 / 8, full ? N * 4 / 8 : ((cols - j) * 4 + 7) / 8), e_a0);

// MANIFEST: "name": "gact_b2",
// MANIFEST-NEXT: "inputs": 1,
// MANIFEST-NEXT: "outputs": 0,
// MANIFEST-NEXT: "params": ["seed","offset"],
// MANIFEST-NEXT: "row_wise": true,
// MANIFEST-NEXT: "no_grad": [],
// MANIFEST-NEXT: "residuals": [{"kind":"codes","bits":2},{"kind":"rows","bits":32},{"kind":"rows","bits":32}]
// MANIFEST: {"name":"gact_b2_fwd","kind":"rows"
// MANIFEST-SAME: "args":[{"role":"in","layout":"dense"},{"role":"scalar","type":"i64"},{"role":"scalar","type":"i64"},{"role":"out","layout":"rows"},{"role":"out","layout":"rows"},{"role":"out","layout":"packed","bits":2},{"role":"rows"},{"role":"cols"}]
