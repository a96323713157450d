// RUN: abp-opt %s -split-input-file -abp-verify-module -verify-diagnostics
// RUN: not abp-compile %s --emit=cuda 2>&1 | FileCheck %s --check-prefix=PIPELINE

// Found by the fuzzer (tests/fuzz): a module's body is a graph region, where an op may use its
// own result; the canonicalizer folded this one into itself forever, hanging the pipeline.
// expected-error @+2 {{cannot be lowered: a module of abp IR holds only abp.operator, abp.kernel and func.func at its top level}}
// PIPELINE: invalid-abp-verify-module.mlir:[[# @LINE + 1]]:6: error: 'arith.maximumf' op cannot be lowered
%x = arith.maximumf %x, %x : f32

// -----

func.func private @f(%y: f32) -> f32 {
  return %y : f32
}
// expected-error @+1 {{'arith.constant' op cannot be lowered}}
%zero = arith.constant 0.0 : f32

// -----

// Found by the fuzzer: a callee no map calls is still emitted, under its own name, which must
// therefore be a C++ identifier too.
// expected-error @+1 {{'func.func' op name 'act.floor' must be an identifier (a letter or '_', then letters, digits or '_'): it becomes a C++ function name}}
func.func private @act.floor(%z: f32) -> f32 {
  return %z : f32
}

// -----

// Emitted although nothing calls it, so its body is checked as a called one would be.
func.func private @unused(%z: f32) -> f32 {
  // expected-error @+1 {{'math.atan' op is not a scalar operation abp compiles into kernels}}
  %a = math.atan %z : f32
  return %a : f32
}
