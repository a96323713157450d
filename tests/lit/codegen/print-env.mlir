// abp-compile --print-env lists the runtime's environment variables (runtime/EnvVars.def) with
// the value set, the default and what each does; without it, an input file is required.
// RUN: env ABP_LOG=1 abp-compile --print-env | FileCheck %s
// RUN: not abp-compile 2>&1 | FileCheck %s --check-prefix=NOINPUT

// CHECK: ABP_KERNEL_DIR={{.*}}  (default "")
// CHECK: ABP_CACHE_DIR={{.*}}  (default "~/.cache/abp")
// CHECK-NEXT: root of the on-disk compile cache
// CHECK: ABP_LOG=1  (default "0")
// NOINPUT: abp-compile: no input file
