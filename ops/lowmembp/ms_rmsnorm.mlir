// MS-RMSNorm (LowMemoryBP, docs/algorithms.md §5): RMSNorm without affine whose backward reads only
// its own output y, which the next Linear keeps anyway (share-saved), and r per row.
//   forward:  r = (mean(x²) + ε)^(−1/2), y = x·r
//   backward: dx = r·(g − y·mean(g∘y))                      (exact, ε included)
abp.operator @ms_rmsnorm attributes {params = ["eps"]} forward {
^bb0(%x: tensor<?x?xf32>, %eps: f32):
  %sq = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  %ms = abp.reduce_rows mean %sq : tensor<?x?xf32> -> tensor<?xf32>
  %r = abp.map(%ms) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %one = arith.constant 1.0 : f32
    %ve = arith.addf %v, %eps : f32
    %sd = math.sqrt %ve : f32
    %q = arith.divf %one, %sd : f32
    abp.yield %q : f32
  }
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%x, %rb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %q: f32):
    %p = arith.mulf %a, %q : f32
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
  %mgy = abp.reduce_rows mean %gy : tensor<?x?xf32> -> tensor<?xf32>
  %mgyb = abp.broadcast_rows %mgy : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%g, %y, %mgyb, %rb)
      : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32, %m: f32, %q: f32):
    %u = arith.mulf %b, %m : f32
    %v = arith.subf %a, %u : f32
    %w = arith.mulf %q, %v : f32
    abp.yield %w : f32
  }
  abp.return %dx : tensor<?x?xf32>
}
