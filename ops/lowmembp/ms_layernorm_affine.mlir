// MS-LayerNorm with its affine map in the kernels (docs/algorithms.md §5): y = n·γ + β with
// n = (x − μ)·r and γ = weight + offset (offset 1 for Gemma-style norms whose weight starts at 0).
// Backward reads only y (shared with the next Linear), r = 1/σ per row, and the caller's weight
// and bias (per-column inputs, saved as they are: no bytes per row). It recovers
//   n = (y − β)/γ   (0 where γ = 0: not recoverable there; abp.convert refuses such norms)
//   dn = g·γ,  dx = r·(dn − mean(dn) − n·mean(dn∘n)),  dγ = Σ_rows g∘n,  dβ = Σ_rows g
// in one row kernel; the two column sums follow its launch (abp.reduce_cols).
// @ms_layernorm_gain below is the same without β (torch's LayerNorm(bias=False)).
abp.operator @ms_layernorm_affine attributes {params = ["eps", "offset"]} forward {
^bb0(%x: tensor<?x?xf32>, %w: tensor<?xf32>, %b: tensor<?xf32>, %eps: f32, %off: f32):
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
    %gm = arith.addf %g, %off : f32
    %p = arith.mulf %n, %gm : f32
    %o = arith.addf %p, %c : f32
    abp.yield %o : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  abp.return %y : tensor<?x?xf32> saves %ys, %r, %w, %b, %off : tensor<?x?xf32>, tensor<?xf32>, tensor<?xf32>, tensor<?xf32>, f32
} backward {
^bb0(%y: tensor<?x?xf32>, %r: tensor<?xf32>, %w: tensor<?xf32>, %b: tensor<?xf32>, %off: f32, %g: tensor<?x?xf32>):
  %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
  %bb = abp.broadcast_cols %b : tensor<?xf32> -> tensor<?x?xf32>
  %n = abp.map(%y, %wb, %bb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%v: f32, %wv: f32, %c: f32):
    %zero = arith.constant 0.0 : f32
    %one = arith.constant 1.0 : f32
    %gm = arith.addf %wv, %off : f32
    %isz = arith.cmpf oeq, %gm, %zero : f32
    %safe = arith.select %isz, %one, %gm : f32
    %cen = arith.subf %v, %c : f32
    %q = arith.divf %cen, %safe : f32
    abp.yield %q : f32
  }
  %dn = abp.map(%g, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %wv: f32):
    %gm = arith.addf %wv, %off : f32
    %p = arith.mulf %a, %gm : f32
    abp.yield %p : f32
  }
  %dnn = abp.map(%dn, %n) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %c: f32):
    %p = arith.mulf %a, %c : f32
    abp.yield %p : f32
  }
  %mg = abp.reduce_rows mean %dn : tensor<?x?xf32> -> tensor<?xf32>
  %mgn = abp.reduce_rows mean %dnn : tensor<?x?xf32> -> tensor<?xf32>
  %mgb = abp.broadcast_rows %mg : tensor<?xf32> -> tensor<?x?xf32>
  %mgnb = abp.broadcast_rows %mgn : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%dn, %n, %mgb, %mgnb, %rb)
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

abp.operator @ms_layernorm_gain attributes {params = ["eps", "offset"]} forward {
^bb0(%x: tensor<?x?xf32>, %w: tensor<?xf32>, %eps: f32, %off: f32):
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
  %y = abp.map(%xc, %rb, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%d: f32, %q: f32, %g: f32):
    %n = arith.mulf %d, %q : f32
    %gm = arith.addf %g, %off : f32
    %p = arith.mulf %n, %gm : f32
    abp.yield %p : f32
  }
  %ys = abp.share_saved %y : tensor<?x?xf32>
  abp.return %y : tensor<?x?xf32> saves %ys, %r, %w, %off : tensor<?x?xf32>, tensor<?xf32>, tensor<?xf32>, f32
} backward {
^bb0(%y: tensor<?x?xf32>, %r: tensor<?xf32>, %w: tensor<?xf32>, %off: f32, %g: tensor<?x?xf32>):
  %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
  %n = abp.map(%y, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%v: f32, %wv: f32):
    %zero = arith.constant 0.0 : f32
    %one = arith.constant 1.0 : f32
    %gm = arith.addf %wv, %off : f32
    %isz = arith.cmpf oeq, %gm, %zero : f32
    %safe = arith.select %isz, %one, %gm : f32
    %q = arith.divf %v, %safe : f32
    abp.yield %q : f32
  }
  %dn = abp.map(%g, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %wv: f32):
    %gm = arith.addf %wv, %off : f32
    %p = arith.mulf %a, %gm : f32
    abp.yield %p : f32
  }
  %dnn = abp.map(%dn, %n) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %c: f32):
    %p = arith.mulf %a, %c : f32
    abp.yield %p : f32
  }
  %mg = abp.reduce_rows mean %dn : tensor<?x?xf32> -> tensor<?xf32>
  %mgn = abp.reduce_rows mean %dnn : tensor<?x?xf32> -> tensor<?xf32>
  %mgb = abp.broadcast_rows %mg : tensor<?xf32> -> tensor<?x?xf32>
  %mgnb = abp.broadcast_rows %mgn : tensor<?xf32> -> tensor<?x?xf32>
  %rb = abp.broadcast_rows %r : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%dn, %n, %mgb, %mgnb, %rb)
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
  abp.return %dx, %dw : tensor<?x?xf32>, tensor<?xf32>
}
