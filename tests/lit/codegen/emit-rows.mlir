// The row-kernel emitter: uniforms, stages and sweeps shared by a GPU driver (warp shuffles /
// block reduction) and a CPU driver (loop fission + the host replay of the reduction order);
// entries for f32/f16/bf16 and f64; the manifest's row-kernel records.
// RUN: abp-compile %s --emit=cuda | FileCheck %s
// RUN: abp-compile %s --emit=manifest | FileCheck %s --check-prefix=MANIFEST

// CHECK-LABEL: // row kernel ln_fwd: 2 reduction stage(s); rows of <= 256 elements per 8 lanes, <= 1024 per warp, longer rows per block of 256 threads; 8 element(s) per thread and step
// CHECK: template <typename C> struct ln_fwd_uniforms {
// CHECK: template <typename C> ABP_FN void ln_fwd_stage1(ln_fwd_uniforms<C> &u, const C *sums, abp::i64 cols) {
// CHECK: u.u[[MEAN:[0-9]+]] = sums[0] / (C)cols;
// CHECK: template <typename C> ABP_FN void ln_fwd_elem0(const ln_fwd_uniforms<C> &u, C a0, C &o0) {
// Every sweep reads x, so a short row's x is kept in registers: the first sweep loads and keeps
// each chunk, the later ones read what it kept. K chunks per lane (0: re-read, long rows).
// CHECK: template <typename T, typename C, int RT, int K>
// CHECK-NEXT: ABP_FN void ln_fwd_sweep0(const ln_fwd_uniforms<C> &u, const T *ABP_RESTRICT a0, abp::i64 cols, int lane, C *acc, C (&keep_a0)[K > 0 ? K : 1][8]) {
// CHECK: const abp::i64 chunks = K > 0 ? K : (cols + (abp::i64)RT * N - 1) / ((abp::i64)RT * N);
// CHECK-NEXT: #if ABP_GPU
// CHECK-NEXT: #pragma unroll
// CHECK-NEXT: #endif
// CHECK-NEXT: for (abp::i64 it = 0; it < chunks; ++it) {
// CHECK-NEXT: const abp::i64 j = (abp::i64)lane * N + it * ((abp::i64)RT * N);
// CHECK-NEXT: if (j >= cols)
// CHECK-NEXT: break;
// CHECK: abp::loadChunk<N>(a0, j, cols, vec, e_a0);
// CHECK-NEXT: if (K > 0)
// CHECK-NEXT: for (int k = 0; k < N; ++k) keep_a0[K > 0 ? it : 0][k] = e_a0[k];
// CHECK: if (!full && j + k >= cols)
// CHECK: acc[0] += o0;
// The second stage's element function recomputes x - mean from the input.
// CHECK: ABP_FN void ln_fwd_elem1(const ln_fwd_uniforms<C> &u, C a0, C &o0) {
// CHECK: const C v0 = a0 - u.u[[MEAN]];
// CHECK: ABP_FN void ln_fwd_sweep1(
// CHECK: if (K > 0)
// CHECK-NEXT: for (int k = 0; k < N; ++k) e_a0[k] = keep_a0[K > 0 ? it : 0][k];
// CHECK-NEXT: else
// CHECK-NEXT: abp::loadChunk<N>(a0, j, cols, vec, e_a0);
// CHECK: ABP_FN void ln_fwd_sweep2(const ln_fwd_uniforms<C> &u, const T *ABP_RESTRICT a0, T *ABP_RESTRICT r1, abp::i64 cols, int lane, C (&keep_a0)[K > 0 ? K : 1][8]) {
// CHECK: abp::storeChunk<N>(r1, j, cols, vec, e_r1);
// CHECK: #if ABP_GPU
// CHECK: ABP_FN void ln_fwd_rows(
// A warp's rows advance in step (their shuffles span the warp); lanes past the last row see an
// empty row.
// CHECK: for (abp::i64 first = (abp::i64)blockIdx.x * G + group - group % W; first < rows; first += (abp::i64)gridDim.x * G) {
// CHECK: const bool live = row < rows;
// CHECK: const abp::i64 cols = live ? allCols : 0;
// CHECK: C keep_a0[K > 0 ? K : 1][8];
// CHECK: ln_fwd_sweep0<T, C, RT, K>(u, a0 + base, cols, lane, acc, keep_a0);
// CHECK: abp::rowAllReduce<RT, abp::kReduceSum>(acc, scratch);
// CHECK: if (lane == 0 && live) {
// CHECK: #if ABP_HOST
// CHECK: static void ln_fwd_hostRows(
// The CPU driver runs a sweep's lanes one after another: each lane keeps its own chunks.
// CHECK: C keep_a0[K > 0 ? RT : 1][K > 0 ? K : 1][8];
// CHECK: for (int lane = 0; lane < RT; ++lane)
// CHECK: ln_fwd_sweep0<T, C, RT, K>(u, a0 + base, cols, lane, acc[lane], keep_a0[K > 0 ? lane : 0]);
// CHECK: abp::hostRowAllReduce<RT, abp::kReduceSum>(acc);
// CHECK: ABP_KERNEL void abp_ln_fwd_f32_[[H:[0-9a-f]+]](const float *ABP_RESTRICT a0, float a1, float *ABP_RESTRICT r0, float *ABP_RESTRICT r1, abp::i64 rows, abp::i64 cols) {
// CHECK: __shared__ float scratch[32];
// CHECK: if (cols <= 256)
// Rows of <= 256 over 8 lanes and <= 1024 over 32 are 4 chunks of 8 per lane: kept (32 fp32
// registers for x); longer rows re-read.
// CHECK: ln_fwd_rows<float, float, 8, 4>(
// CHECK: else if (cols <= 1024)
// CHECK: ln_fwd_rows<float, float, 32, 4>(
// CHECK: ln_fwd_rows<float, float, 256, 0>(
// CHECK: extern "C" void abp_ln_fwd_f32_[[H]]__host(void **args, abp::i64 grid, abp::i64 block, abp::i64 b0, abp::i64 b1) {
// CHECK: ABP_KERNEL void abp_ln_fwd_bf16_[[H]](const abp::bf16 *ABP_RESTRICT a0, float a1, float *ABP_RESTRICT r0, abp::bf16 *ABP_RESTRICT r1,
// CHECK: ABP_KERNEL void abp_ln_fwd_f64_[[H]](const double *ABP_RESTRICT a0, float a1, double *ABP_RESTRICT r0, double *ABP_RESTRICT r1,
// fp64 keeps 4 chunks of 8 doubles: 64 registers, within the budget.
// CHECK: ln_fwd_hostRows<double, double, 32, 4>(

// MANIFEST: "row_wise": true,
// MANIFEST: "residuals": [{"kind":"shared","output":0},{"kind":"rows","bits":32}],
// MANIFEST: "saved_bits_per_element": 0,
// MANIFEST: "saved_bits_per_row": 32,
// MANIFEST: "forward": {"kernel":"ln_fwd","args":["input0","param0"],"produces":["result1","result1","result0"]},
// MANIFEST: {"name":"ln_fwd","kind":"rows","warp_max_cols":1024,"symbols":{"f32":"{{.*}}","f16":"{{.*}}","bf16":"{{.*}}","f64":"{{.*}}"},"block":256,"chunk":8,"args":[{"role":"in","layout":"dense"},{"role":"scalar","type":"f32"},{"role":"out","layout":"rows"},{"role":"out","layout":"dense"},{"role":"rows"},{"role":"cols"}]}
abp.operator @ln forward {
^bb0(%x: tensor<?x?xf32>, %eps: f32):
  %mean = abp.reduce_rows mean %x : tensor<?x?xf32> -> tensor<?xf32>
  %mb = abp.broadcast_rows %mean : tensor<?xf32> -> tensor<?x?xf32>
  %xc = abp.map(%x, %mb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %m: f32):
    %d = arith.subf %a, %m : f32
    abp.yield %d : f32
  }
  %sq = abp.map(%xc) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%d: f32):
    %s = arith.mulf %d, %d : f32
    abp.yield %s : f32
  }
  %var = abp.reduce_rows mean %sq : tensor<?x?xf32> -> tensor<?xf32>
  %r = abp.map(%var) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %ve = arith.addf %v, %eps : f32
    %q = math.rsqrt %ve : f32
    abp.yield %q : f32
  }
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%xc, %rb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%d: f32, %q: f32):
    %p = arith.mulf %d, %q : f32
    abp.yield %p : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  abp.return %y : tensor<?x?xf32> saves %ys, %r : tensor<?x?xf32>, tensor<?xf32>
} backward {
^bb0(%y: tensor<?x?xf32>, %r: tensor<?xf32>, %g: tensor<?x?xf32>):
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%g, %y, %rb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %q: f32):
    %d = arith.subf %a, %b : f32
    %p = arith.mulf %d, %q : f32
    abp.yield %p : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
