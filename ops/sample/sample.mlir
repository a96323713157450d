// Row sampling for sampled linear layers (docs/algorithms.md §3 RMM, §7 VCAS, §8 WTA-CRS): the
// data-parallel pieces, each one kernel. Which rows to keep (the plan: water-filling,
// winner-take-all, i.i.d. or Bernoulli draws over one score per row) is computed by
// abp._selection from these kernels' scores and Philox draws; the matrix products are the
// framework's (docs/design.md, "Sampled linear layers").

// Row norms ‖x_r‖ (the sampling scores), differentiable: dx = dn · x / ‖x‖, 0 on a zero row.
abp.operator @row_norms forward {
^bb0(%x: tensor<?x?xf32>):
  %sq = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  %ss = abp.reduce_rows sum %sq : tensor<?x?xf32> -> tensor<?xf32>
  %n = abp.map(%ss) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%v: f32):
    %r = math.sqrt %v : f32
    abp.yield %r : f32
  }
  abp.return %n : tensor<?xf32> saves %x, %n : tensor<?x?xf32>, tensor<?xf32>
} backward {
^bb0(%x: tensor<?x?xf32>, %n: tensor<?xf32>, %dn: tensor<?xf32>):
  %q = abp.map(%dn, %n) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%g: f32, %m: f32):
    %zero = arith.constant 0.0 : f32
    %d = arith.divf %g, %m : f32
    %pos = arith.cmpf ogt, %m, %zero : f32
    %r = arith.select %pos, %d, %zero : f32
    abp.yield %r : f32
  }
  %qb = abp.broadcast_rows %q : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%x, %qb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %s: f32):
    %p = arith.mulf %a, %s : f32
    abp.yield %p : f32
  }
  abp.return %dx : tensor<?x?xf32>
}

// A sampled residual, as a codec (no outputs): forward keeps the plan's rows, each times its
// Horvitz–Thompson weight; backward puts them back (zeros elsewhere): an unbiased estimate of
// the input for anything linear in its rows, such as dW = dYᵀX.
abp.operator @sample_rows attributes {no_grad = array<i64: 1, 2, 3>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>, %slot: tensor<?xi32>):
  %kept = abp.sample %x, %index, %weight
      : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return saves %kept, %slot : tensor<?x?xf32>, tensor<?xi32>
} backward {
^bb0(%kept: tensor<?x?xf32>, %slot: tensor<?xi32>):
  %x = abp.unsample %kept, %slot : tensor<?x?xf32>, tensor<?xi32> -> tensor<?x?xf32>
  abp.return %x : tensor<?x?xf32>
}

// U[0, 1) draws from the shared Philox stream: element e draws at counter offset + e. The
// sampling plans' randomness (which rows, Bernoulli keeps) comes from here.
abp.operator @philox_uniform attributes {params = ["seed", "offset"]} forward {
^bb0(%seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?xf32>
  abp.return %u : tensor<?xf32>
} backward {
^bb0(%du: tensor<?xf32>):
  abp.return
}

// RMM's Gaussian sketch S (k × N, entries N(0, 1)), regenerated in backward from its key:
// Box–Muller from two draws, at offset + e and second_offset + e.
abp.operator @sketch_gaussian attributes {params = ["seed", "offset", "second_offset"]} forward {
^bb0(%seed: i64, %offset: i64, %second: i64):
  %u1 = abp.uniform %seed, %offset : i64, i64 -> tensor<?xf32>
  %u2 = abp.uniform %seed, %second : i64, i64 -> tensor<?xf32>
  %z = abp.map(%u1, %u2) : (tensor<?xf32>, tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32, %b: f32):
    %one = arith.constant 1.0 : f32
    %m2 = arith.constant -2.0 : f32
    %tau = arith.constant 6.28318530717958647692 : f32
    %c = arith.subf %one, %a : f32
    %l = math.log %c : f32
    %r2 = arith.mulf %m2, %l : f32
    %r = math.sqrt %r2 : f32
    %t = arith.mulf %tau, %b : f32
    %cs = math.cos %t : f32
    %v = arith.mulf %r, %cs : f32
    abp.yield %v : f32
  }
  abp.return %z : tensor<?xf32>
} backward {
^bb0(%dz: tensor<?xf32>):
  abp.return
}

// RMM's Rademacher sketch S (entries ±1, each with probability 1/2).
abp.operator @sketch_rademacher attributes {params = ["seed", "offset"]} forward {
^bb0(%seed: i64, %offset: i64):
  %u = abp.uniform %seed, %offset : i64, i64 -> tensor<?xf32>
  %s = abp.map(%u) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
    %half = arith.constant 0.5 : f32
    %one = arith.constant 1.0 : f32
    %mone = arith.constant -1.0 : f32
    %lo = arith.cmpf olt, %a, %half : f32
    %v = arith.select %lo, %mone, %one : f32
    abp.yield %v : f32
  }
  abp.return %s : tensor<?xf32>
} backward {
^bb0(%ds: tensor<?xf32>):
  abp.return
}
