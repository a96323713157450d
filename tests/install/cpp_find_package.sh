#!/usr/bin/env bash
# Installs the build with `cmake --install` into a fresh prefix, builds examples/cpp against it
# with find_package(abp), and runs the program with no ABP_* variable set: the installed library
# must find its own kernels. Usage: cpp_find_package.sh <build dir> <source dir> <work dir>
set -euo pipefail
build=$1 source=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" --component runtime >"$work/install.log"
cmake -S "$source/examples/cpp" -B "$work/example" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >"$work/configure.log"
cmake --build "$work/example" >"$work/build.log"
# Nothing from the build tree may leak in: no ABP_* variable, no library path.
for name in $(env | sed -n 's/^\(ABP_[A-Z_]*\)=.*/\1/p'); do unset "$name"; done
unset LD_LIBRARY_PATH
"$work/example/gelu_example"
# The program links the installed libabp.so, not the build tree's.
ldd "$work/example/gelu_example" | grep -F "$work/prefix/lib/libabp.so"
