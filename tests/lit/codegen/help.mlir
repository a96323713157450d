// abp-compile --help lists its own options, not the hundreds of LLVM backend options the binary
// links; MLIR's printing options stay available and are listed by --help-hidden.
// RUN: abp-compile --help | FileCheck %s --implicit-check-not=amdgpu --implicit-check-not=mlir-print
// RUN: abp-compile --help-hidden | FileCheck %s --check-prefix=HIDDEN

// CHECK: --help
// CHECK: abp-compile options:
// CHECK-DAG: --arch=<string>
// CHECK-DAG: --display-path=<string>
// CHECK-DAG: --emit=<value>
// CHECK-DAG: --print-env

// HIDDEN: --mlir-print-debuginfo
