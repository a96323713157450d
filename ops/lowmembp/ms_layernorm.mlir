// MS-LayerNorm (LowMemoryBP, docs/algorithms.md §5): LayerNorm without affine whose backward reads
// only its own output y, which the next Linear keeps anyway (share-saved), and r = 1/σ per row.
//   forward:  μ = mean(x), σ² = mean((x − μ)²), r = (σ² + ε)^(−1/2), y = (x − μ)·r
//   backward: dx = r·(g − mean(g) − y·mean(g∘y))            (exact, ε included)
// The variance is two-pass (it reads x again after μ is known). 1/sqrt is written as a
// division by sqrt, which is correctly rounded on both the GPU and the CPU path.
abp.operator @ms_layernorm attributes {params = ["eps"]} forward {
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
    %one = arith.constant 1.0 : f32
    %ve = arith.addf %v, %eps : f32
    %sd = math.sqrt %ve : f32
    %q = arith.divf %one, %sd : f32
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
  %gy = abp.map(%g, %y) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.mulf %a, %b : f32
    abp.yield %p : f32
  }
  %mg = abp.reduce_rows mean %g : tensor<?x?xf32> -> tensor<?xf32>
  %mgy = abp.reduce_rows mean %gy : tensor<?x?xf32> -> tensor<?xf32>
  %mgb = abp.broadcast_rows %mg : tensor<?xf32> -> tensor<?x?xf32>
  %mgyb = abp.broadcast_rows %mgy : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%g, %y, %mgb, %mgyb, %rb)
      : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>)
      -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %m1: f32, %m2: f32, %q: f32):
    %t = arith.subf %a, %m1 : f32
    %u = arith.mulf %b, %m2 : f32
    %v = arith.subf %t, %u : f32
    %w = arith.mulf %q, %v : f32
    abp.yield %w : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
