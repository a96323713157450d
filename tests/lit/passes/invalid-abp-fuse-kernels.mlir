// RUN: abp-opt %s -split-input-file -abp-fuse-kernels -verify-diagnostics

abp.operator @unlowered forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{cannot be fused into a kernel; only abp.map, abp.pack, abp.unpack, abp.uniform, abp.reduce_rows, abp.reduce_tensor, abp.broadcast_rows, abp.broadcast_cols, abp.reduce_cols, abp.sample and abp.unsample may remain after lowering}}
  %c = abp.quantize %x {scheme = #abp.buckets<borders = [0.0], levels = [0.0, 1.0]>} : tensor<?xf32> -> !abp.codes<1>
  abp.return %x : tensor<?xf32> saves %c : !abp.codes<1>
} backward {
^bb0(%c: !abp.codes<1>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}

// -----

abp.operator @unpacked_codes forward {
^bb0(%x: tensor<?xf32>):
  // expected-error @+1 {{produces an i8 code tensor that leaves the kernel unpacked; store codes with abp.pack}}
  %m = abp.map(%x) : (tensor<?xf32>) -> tensor<?xi8> {
  ^bb0(%v: f32):
    %e = arith.constant 1 : i8
    abp.yield %e : i8
  }
  abp.return %x : tensor<?xf32> saves %m : tensor<?xi8>
} backward {
^bb0(%m: tensor<?xi8>, %dy: tensor<?xf32>):
  abp.return %dy : tensor<?xf32>
}


// -----

// The kernel's rows are the index's: the gathered matrix must be read from memory, not computed
// row by row in the same kernel.
abp.operator @gather_computed attributes {no_grad = array<i64: 1, 2>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>):
  %sq = abp.map(%x) : (tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32):
    %s = arith.mulf %a, %a : f32
    abp.yield %s : f32
  }
  // expected-error @+1 {{gathers rows of a value computed in the same kernel}}
  %kept = abp.sample %sq, %index, %weight
      : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
  abp.return saves %kept : tensor<?x?xf32>
} backward {
^bb0(%kept: tensor<?x?xf32>):
  abp.return %kept : tensor<?x?xf32>
}

// -----

// One kernel reads a matrix either row by row or through one index, never both.
abp.operator @gather_and_read attributes {no_grad = array<i64: 1, 2>} forward {
^bb0(%x: tensor<?x?xf32>, %index: tensor<?xi32>, %weight: tensor<?xf32>):
  // expected-error @+1 {{gathers rows of a matrix that the kernel also reads otherwise}}
  %kept = abp.sample %x, %index, %weight
      : tensor<?x?xf32>, tensor<?xi32>, tensor<?xf32> -> tensor<?x?xf32>
  %sum = abp.map(%kept, %x) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %s = arith.addf %a, %b : f32
    abp.yield %s : f32
  }
  abp.return saves %sum : tensor<?x?xf32>
} backward {
^bb0(%kept: tensor<?x?xf32>):
  abp.return %kept : tensor<?x?xf32>
}

// -----

// A whole-tensor reduction recomputes its operand element by element: a value computed along
// rows cannot be part of it.
abp.operator @total_of_row_values forward {
^bb0(%x: tensor<?x?xf32>):
  %m = abp.reduce_rows mean %x : tensor<?x?xf32> -> tensor<?xf32>
  %mb = abp.broadcast_rows %m : tensor<?xf32> -> tensor<?x?xf32>
  %d = abp.map(%x, %mb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %s = arith.subf %a, %b : f32
    abp.yield %s : f32
  }
  // expected-error @+1 {{reduces a value computed by 'abp.broadcast_rows'; a whole-tensor reduction recomputes its operand element by element}}
  %t = abp.reduce_tensor max %d : tensor<?x?xf32> -> f32
  %y = abp.map(%x, %t) : (tensor<?x?xf32>, f32) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %s = arith.mulf %a, %b : f32
    abp.yield %s : f32
  }
  abp.return %y : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

abp.operator @total_of_a_per_row_value forward {
^bb0(%x: tensor<?x?xf32>):
  %m = abp.reduce_rows mean %x : tensor<?x?xf32> -> tensor<?xf32>
  // expected-error @+1 {{reduces a per-row value (rank below the operator's inputs'); a whole-tensor reduction runs over every element of the operator's tensors}}
  %t = abp.reduce_tensor sum %m : tensor<?xf32> -> f32
  %y = abp.map(%x, %t) : (tensor<?x?xf32>, f32) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %s = arith.mulf %a, %b : f32
    abp.yield %s : f32
  }
  abp.return %y : tensor<?x?xf32>
} backward {
^bb0(%g: tensor<?x?xf32>):
  abp.return %g : tensor<?x?xf32>
}

// -----

// A per-column vector is read at each element's column: one the kernel computes (a rank-1 map
// there is per row) cannot be.
abp.operator @computed_cols forward {
^bb0(%x: tensor<?x?xf32>, %w: tensor<?xf32>):
  %w2 = abp.map(%w) : (tensor<?xf32>) -> tensor<?xf32> {
  ^bb0(%a: f32):
    %p = arith.mulf %a, %a : f32
    abp.yield %p : f32
  }
  // expected-error @+1 {{broadcasts a per-column value computed in the same kernel; broadcast an operator argument or residual, and compute on its row-wide broadcast}}
  %wb = abp.broadcast_cols %w2 : tensor<?xf32> -> tensor<?x?xf32>
  %y = abp.map(%x, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.mulf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %y : tensor<?x?xf32> saves %w : tensor<?xf32>
} backward {
^bb0(%w: tensor<?xf32>, %dy: tensor<?x?xf32>):
  %wb = abp.broadcast_cols %w : tensor<?xf32> -> tensor<?x?xf32>
  %dx = abp.map(%dy, %wb) : (tensor<?x?xf32>, tensor<?x?xf32>) -> tensor<?x?xf32> {
  ^bb0(%a: f32, %b: f32):
    %p = arith.mulf %a, %b : f32
    abp.yield %p : f32
  }
  abp.return %dx, %w : tensor<?x?xf32>, tensor<?xf32>
}
