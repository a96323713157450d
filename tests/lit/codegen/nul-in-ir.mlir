// A NUL character in the IR text is a located error, not skipped as whitespace (a module read
// from binary data, or cut short, compiled as what the lexer kept).
// RUN: printf 'abp.operator @nul_in_ir forward {\n^bb0(%%x: tensor<?xf32>):\n  abp.return %%x : tensor<?xf32>\0\n} backward {\n}\n' > %t.mlir
// RUN: not abp-compile %t.mlir --emit=mlir 2>&1 | FileCheck %s

// CHECK: nul-in-ir.mlir.tmp.mlir:3:{{[0-9]+}}: error: a NUL character (U+0000) in the IR text
