#!/usr/bin/env bash
# tests/sanitize/run.sh SOURCE_DIR TREE — the runtime, the C API and their GoogleTests built with
# AddressSanitizer and UndefinedBehaviorSanitizer in a second build tree (no MLIR: the runtime wing
# alone, ABP_ENABLE_COMPILER=OFF), then run; any report fails the test. Incremental after the
# first run. Registered as the ctest `sanitizers` (tests/CMakeLists.txt).
set -euo pipefail
src=$1
tree=$2
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$tree/CMakeCache.txt" ]]; then
  cmake -S "$src" -B "$tree" "${generator[@]}" -DABP_ENABLE_COMPILER=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DABP_TORCH2_PYTHON=OFF -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
fi
cmake --build "$tree" -j 2
cd "$tree"
# The host libraries the runtime compiles and dlopens at run time are not instrumented; leaks
# of the process-wide singletons (made on purpose to outlive static destructors) are not bugs.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ctest --output-on-failure -j 2 -E "^(pytest|pytest-torch2|install-|sanitizers)"
