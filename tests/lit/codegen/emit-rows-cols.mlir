// A per-feature gain and bias (abp.broadcast_cols) make the direction a row kernel that reads
// them as #abp.cols; their gradients (abp.reduce_cols) are not fused: the kernel writes the
// row-wide operand, and the column sums follow its launch. Residuals that are per-column inputs
// cost nothing per row (abp-verify-residuals: only 1/σ counts).
// RUN: abp-opt %s -abp-pipeline | FileCheck %s
// RUN: abp-compile %s --emit=cuda | FileCheck %s --check-prefix=SOURCE
// RUN: abp-compile %s --emit=manifest | FileCheck %s --check-prefix=MANIFEST
// RUN: abp-compile %s --emit=host -o %t.so && abp-compile %s --emit=ptx --arch=sm_80 -o %t.ptx

// CHECK: abp.kernel @cols_layernorm_fwd attributes {{{.*}}ins = [#abp.dense, #abp.scalar, #abp.cols, #abp.cols], outs = [#abp.rows, #abp.dense], rows
// CHECK: abp.kernel @cols_layernorm_bwd attributes {{{.*}}ins = [#abp.cols, #abp.cols, #abp.dense, #abp.dense, #abp.rows], outs = [#abp.dense, #abp.dense], rows
// CHECK: abp.operator @cols_layernorm attributes {abp.saved_bits = 0 : i64, abp.saved_row_bits = 32 : i64
// CHECK: %[[L:.*]]:2 = abp.launch @cols_layernorm_bwd
// CHECK-NEXT: %[[DW:.*]] = abp.reduce_cols sum %[[L]]#1 : tensor<?x?xf32> -> tensor<?xf32>
// CHECK-NEXT: %[[DB:.*]] = abp.reduce_cols sum %arg4 : tensor<?x?xf32> -> tensor<?xf32>
// CHECK-NEXT: abp.return %[[L]]#0, %[[DW]], %[[DB]]

// Every row reads the vector itself: its pointer goes to the sweeps without the row's offset.
// SOURCE: cols_layernorm_fwd_sweep2<T, C, RT, K>(u, a0 + base, a2, a3, r1 + base, cols, lane

// MANIFEST: "format": 4,
// MANIFEST: "residuals": [{"kind":"shared","output":0},{"kind":"rows","bits":32},{"kind":"cols","bits":32},{"kind":"cols","bits":32}],
// MANIFEST: "saved_bits_per_row": 32,
// MANIFEST: "forward": {"kernel":"cols_layernorm_fwd","args":["input0","param0","input1","input2"],"produces":["result1","result1","result0","input1","input2"]},
// MANIFEST: "backward": {"kernel":"cols_layernorm_bwd","args":["residual2","residual3","residual0","grad0","residual1"],"col_sums":["result1","grad0"],"produces":["result0","colsum0","colsum1"]}
// MANIFEST: "args":[{"role":"in","layout":"dense"},{"role":"scalar","type":"f32"},{"role":"in","layout":"cols"},{"role":"in","layout":"cols"},{"role":"out","layout":"rows"},{"role":"out","layout":"dense"},{"role":"rows"},{"role":"cols"}]

// Affine MS-LayerNorm: y = n·γ + β, backward from y (n recovered as (y − β)/γ, 0 where γ = 0).
abp.operator @cols_layernorm attributes {params = ["eps"]} forward {
^bb0(%x: tensor<?x?xf32>, %w: tensor<?xf32>, %b: tensor<?xf32>, %eps: f32):
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
    %one = arith.constant 1.0 : f32
    %ve = arith.addf %v, %eps : f32
    %sd = math.sqrt %ve : f32
    %q = arith.divf %one, %sd : f32
    abp.yield %q : f32
  }
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
  %bb = abp.broadcast_cols %b : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%xc, %rb, %wb, %bb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%d: f32, %q: f32, %g: f32, %c: f32):
    %n = arith.mulf %d, %q : f32
    %p = arith.mulf %n, %g : f32
    %o = arith.addf %p, %c : f32
    abp.yield %o : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  abp.return %y : tensor<?x?xf32> saves %ys, %r, %w, %b : tensor<?x?xf32>, tensor<?xf32>, tensor<?xf32>, tensor<?xf32>
} backward {
^bb0(%y: tensor<?x?xf32>, %r: tensor<?xf32>, %w: tensor<?xf32>, %b: tensor<?xf32>, %g: tensor<?x?xf32>):
  %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
  %bb = abp.broadcast_cols %b : tensor<?xf32> -> tensor<?x?xf32>
  %n = abp.map(%y, %wb, %bb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%v: f32, %gm: f32, %c: f32):
    %zero = arith.constant 0.0 : f32
    %one = arith.constant 1.0 : f32
    %isz = arith.cmpf oeq, %gm, %zero : f32
    %safe = arith.select %isz, %one, %gm : f32
    %cen = arith.subf %v, %c : f32
    %q = arith.divf %cen, %safe : f32
    abp.yield %q : f32
  }
  %dn = abp.map(%g, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %gm: f32):
    %p = arith.mulf %a, %gm : f32
    abp.yield %p : f32
  }
  %gy = abp.map(%dn, %n) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %c: f32):
    %p = arith.mulf %a, %c : f32
    abp.yield %p : f32
  }
  %mg = abp.reduce_rows mean %dn : tensor<?x?xf32> -> tensor<?xf32>
  %mgy = abp.reduce_rows mean %gy : tensor<?x?xf32> -> tensor<?xf32>
  %mgb = abp.broadcast_rows %mg : tensor<?xf32> -> tensor<?x?xf32>
  %mgyb = abp.broadcast_rows %mgy : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%dn, %n, %mgb, %mgyb, %rb)
      : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>)
      -> tensor<?x?xf32> {
  ^bb0(%a: f32, %c: f32, %m1: f32, %m2: f32, %q: f32):
    %t = arith.subf %a, %m1 : f32
    %u = arith.mulf %c, %m2 : f32
    %v = arith.subf %t, %u : f32
    %o = arith.mulf %q, %v : f32
    abp.yield %o : f32
  }
  %gn = abp.map(%g, %n) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %c: f32):
    %p = arith.mulf %a, %c : f32
    abp.yield %p : f32
  }
  %dw = abp.reduce_cols sum %gn : tensor<?x?xf32> -> tensor<?xf32>
  %db = abp.reduce_cols sum %g : tensor<?x?xf32> -> tensor<?xf32>
  abp.return %dx, %dw, %db : tensor<?x?xf32>, tensor<?xf32>, tensor<?xf32>
}
