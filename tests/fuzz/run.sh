#!/usr/bin/env bash
# tests/fuzz/run.sh SOURCE_DIR TREE ABP_COMPILE [SECONDS] — builds the libFuzzer target
# abp-fuzz-compile with clang-19 (ASan + UBSan, assertions on) in its own tree, seeds it with every
# operator in ops/ and every case of the lit suites (split at `// -----`), and fuzzes for SECONDS
# (default ABP_FUZZ_SECONDS or 180) from the seed ABP_FUZZ_SEED (default 1). Any crash, assertion,
# sanitizer report, leak or timeout fails the run, with the input kept under TREE/artifacts/ and
# printed last; docs/bad-input.md says how a finding becomes a lit test. The corpus grows in
# TREE/corpus across runs. Then every input of the corpus the compiler accepts must give source
# that builds: ABP_COMPILE (the main tree's abp-compile) compiles each distinct one, newest first,
# for the host and to PTX (at most ABP_FUZZ_BUILDS, 12: a host build takes seconds).
# Registered as ctest `fuzz`.
set -euo pipefail
src=$1
tree=$2
abp_compile=$3
seconds=${4:-${ABP_FUZZ_SECONDS:-180}}
max_builds=${ABP_FUZZ_BUILDS:-12}
cc=${ABP_FUZZ_CC:-clang-19}
cxx=${ABP_FUZZ_CXX:-clang++-19}
if ! command -v "$cxx" >/dev/null; then
  echo "fuzz: $cxx not found (Debian: apt install clang-19 libclang-rt-19-dev; scripts/test installs them)" >&2
  exit 1
fi
# -O1 -g without -DNDEBUG: the asserts of abp and the ones LLVM/MLIR headers inline into it
# (cast<>, getAs<>) are live, so a wrong cast is an abort the fuzzer sees, not silent UB.
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
# ASan and the uninstrumented LLVM/MLIR libraries must agree on allocator poisoning (see header).
flags+=" -include $src/tests/fuzz/uninstrumented_llvm.h"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$tree/CMakeCache.txt" ]]; then
  cmake -S "$src" -B "$tree" "${generator[@]}" -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DABP_ENABLE_TESTS=OFF -DABP_ENABLE_FUZZER=ON -DABP_TORCH2_PYTHON=OFF >/dev/null
fi
cmake --build "$tree" -j 2 --target abp-fuzz-compile

# Seeds: whole operator files, and each split-input case of the lit tests as its own input.
seeds="$tree/seeds"
rm -rf "$seeds"
rm -rf "$tree/artifacts"
mkdir -p "$seeds" "$tree/corpus" "$tree/artifacts"
n=0
while IFS= read -r -d '' file; do
  case "$file" in
    */tests/lit/*)
      awk -v prefix="$seeds/$(basename "$(dirname "$file")")-$(basename "$file" .mlir)-" '
        /^\/\/ -----$/ { part++; next }
        { print > (prefix part ".mlir") }' part=0 "$file" ;;
    *) cp "$file" "$seeds/ops-$(basename "$file")" ;;
  esac
  n=$((n + 1))
done < <(find "$src/ops" "$src/tests/lit" -name '*.mlir' -print0 | sort -z)
# The dictionary: every dialect-qualified op and attribute name and every keyword the seeds use,
# so mutations splice real syntax rather than random bytes.
dict="$tree/abp.dict"
cat "$seeds"/*.mlir | grep -ohE '#?(abp|arith|math|func)\.[a-z_]+|\b(forward|backward|residuals|params|borders|levels|bits|group|rows|tensor|index|f32|f16|bf16|i1|i8|i32|i64)\b' |
  sort -u | sed 's/.*/"&"/' > "$dict"
echo "fuzz: $n seed files ($(ls "$seeds" | wc -l) inputs), $(wc -l < "$dict") dictionary entries, ${seconds}s"

# LeakSanitizer stops the process's threads through ptrace. Where a sandbox forbids or emulates
# that (some CI containers; any run under strace or gdb), its first check dies with "LeakSanitizer
# has encountered a fatal error" instead of finding leaks, which would fail every run. Probe once
# on one operator; there, fuzz without leak checks and say so (crashes, asserts, UB and hangs are
# still checked).
leaks=1
probe=$(ASAN_OPTIONS="detect_leaks=1" "$tree/bin/abp-fuzz-compile" "$seeds"/ops-relu.mlir 2>&1 || true)
if grep -q "LeakSanitizer has encountered a fatal error" <<<"$probe"; then
  leaks=0
  echo "fuzz: LeakSanitizer cannot run in this environment (ptrace); fuzzing without leak checks"
fi
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=$leaks:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# The harness reaches emit: every operator of ops/ must compile through it (each file run once).
ABP_FUZZ_EXPECT_SUCCESS=1 "$tree/bin/abp-fuzz-compile" "$seeds"/ops-*.mlir 2>"$tree/replay.log" || {
  cat "$tree/replay.log" >&2
  echo "fuzz: an operator of ops/ does not compile through the harness" >&2
  exit 1
}
# A fixed seed (ABP_FUZZ_SEED, default 1) fixes the mutator's choices, not the run: coverage of
# pointer-keyed hash tables varies between processes, so the corpus grows differently each time
# (docs/bad-input.md). A finding is kept and printed below, so a red run reproduces from its
# artifact; longer or other-seed runs are for hand fuzzing.
fuzz_seed=${ABP_FUZZ_SEED:-1}
status=0
"$tree/bin/abp-fuzz-compile" "$tree/corpus" "$seeds" -dict="$dict" -max_total_time="$seconds" \
  -seed="$fuzz_seed" -detect_leaks="$leaks" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$tree/artifacts/" >"$tree/fuzz.log" 2>&1 || status=$?
if ((status != 0)); then
  # The whole log first, then what failed in a few lines, so the end of a CI log says it.
  cat "$tree/fuzz.log" >&2
  echo "fuzz: FAILED with status $status (seed $fuzz_seed); the finding:" >&2
  grep -m 8 -E '==[0-9]+==ERROR|runtime error:|ALARM:|out-of-memory|deadly signal|Assertion|SUMMARY:' \
    "$tree/fuzz.log" >&2 || tail -n 15 "$tree/fuzz.log" >&2
  for artifact in "$tree"/artifacts/*; do
    [[ -f "$artifact" ]] || continue
    echo "fuzz: reproducer $artifact (run: $tree/bin/abp-fuzz-compile $artifact):" >&2
    head -c 3000 "$artifact" >&2
    echo >&2
  done
  exit "$status"
fi
grep -E '^(Done|stat::)' "$tree/fuzz.log"

# Accepted is not enough: the emitted source must build. One host build and one NVRTC compile
# per distinct source (a fuzzed callee named @act.floor once gave C++ that did not compile).
built="$tree/built"
rm -rf "$built"
mkdir -p "$built"
declare -A seen=()
accepted=0
while IFS= read -r input; do
  ((${#seen[@]} < max_builds)) || break
  source=$("$abp_compile" "$input" --emit=cuda --display-path=fuzz.mlir 2>/dev/null) || continue
  accepted=$((accepted + 1))
  key=$(printf '%s' "$source" | sha256sum | cut -c1-16)
  [[ -z "${seen[$key]:-}" ]] || continue
  seen[$key]=1
  for emit in host ptx; do
    if ! "$abp_compile" "$input" --emit=$emit -o "$built/$key.$emit" >"$built/$key.$emit.log" 2>&1; then
      cat "$built/$key.$emit.log" >&2
      echo "fuzz: $input is accepted, but its generated source does not build (--emit=$emit):" >&2
      head -c 4000 "$input" >&2
      exit 1
    fi
  done
done < <(ls -t "$tree"/corpus/*)
echo "fuzz: $accepted accepted corpus inputs checked, ${#seen[@]} distinct sources built for the host and to PTX"
