# common.sh — shared by scripts/demo and scripts/test: install what is missing, then build.
# Idempotent: a machine that already has everything runs no apt-get, an up-to-date torch 2.x venv
# no pip, and an up-to-date build tree makes the build step a no-op.
set -euo pipefail

ABP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ABP_BUILD="${ABP_BUILD_DIR:-$ABP_ROOT/build}"
# Debian's python3-torch and friends live in the system interpreter, not a pyenv one on PATH.
ABP_PYTHON=/usr/bin/python3
# The second test lane (scripts/test, ctest's pytest-torch2): a current torch 2.x with transformers,
# timm, peft and accelerate from PyPI, in a virtual environment outside the clone (~5.7 GB, made
# once by abp_torch2_venv from the pinned scripts/lib/torch2-requirements.txt).
ABP_VENV="${ABP_VENV:-$HOME/.cache/abp/venv-torch2}"
ABP_TORCH2_REQUIREMENTS="$ABP_ROOT/scripts/lib/torch2-requirements.txt"
# The install tests build the wheel with scikit-build-core from this small venv (pinned).
ABP_BUILD_VENV="${ABP_BUILD_VENV:-$HOME/.cache/abp/venv-build}"
ABP_BUILD_REQUIREMENTS="$ABP_ROOT/scripts/lib/build-requirements.txt"

# MLIR/LLVM pinned to 19: libmlir-19 and libmlir-22 conflict and apt would remove the other.
# mlir-19-tools is needed by MLIR's CMake config (mlir-tblgen, mlir-pdll) although
# libmlir-19-dev does not depend on it; llvm-19-tools brings FileCheck; lit ships with llvm-19-dev.
# clang-19 and its runtime (libFuzzer, ASan, UBSan) build the fuzz tree (ctest fuzz, tests/fuzz).
ABP_PACKAGES=(
  cmake ninja-build g++
  libmlir-19-dev mlir-19-tools llvm-19-dev llvm-19-tools
  libfmt-dev libgtest-dev nlohmann-json3-dev
  clang-19 libclang-rt-19-dev
  python3-dev python3-numpy python3-pytest python3-sklearn python3-torch python3-venv
  libtorch-dev pybind11-dev
)

abp_log() { printf '[abp] %s\n' "$*" >&2; }

abp_install_missing() {
  local missing=()
  for pkg in "${ABP_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  if ((${#missing[@]})); then
    abp_log "installing: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
  if [ ! -e /usr/local/cuda/include/nvrtc.h ]; then
    abp_log "error: the CUDA toolkit (NVRTC headers and library) is expected at /usr/local/cuda"
    exit 1
  fi
}

# A venv's stamp: its requirements file and the interpreter it is made from (a new Debian Python
# makes a new venv).
abp_venv_stamp() {
  { cat "$1"; "$ABP_PYTHON" -c 'import sys; print(sys.executable, sys.version)'; } |
    sha256sum | cut -d' ' -f1
}

# abp_venv DIR REQUIREMENTS "IMPORTS" WHAT: makes the venv DIR once from the pinned REQUIREMENTS
# (checked by importing IMPORTS). The stamp file is written last, after pip check: a venv without
# the current stamp (half-installed, interrupted, or made from an older requirements file) is
# removed and made again. A lock keeps two scripts from building it at once. Quick (no pip) when
# the stamp matches.
abp_venv() {
  local dir=$1 requirements=$2 imports=$3 what=$4
  local stamp_file="$dir/.abp-stamp" want
  want="$(abp_venv_stamp "$requirements")"
  if [ -x "$dir/bin/python" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  mkdir -p "$(dirname "$dir")"
  (
    flock 9
    # Another script may have finished it while this one waited for the lock.
    if [ -x "$dir/bin/python" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$want" ]; then
      exit 0
    fi
    if [ -e "$dir" ] && [ ! -f "$dir/pyvenv.cfg" ] && [ -n "$(ls -A "$dir")" ]; then
      abp_log "error: $dir exists and is not a virtual environment; not removing it"
      exit 1
    fi
    abp_log "making the $what venv $dir from $requirements"
    rm -rf "$dir"
    "$ABP_PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --no-input --disable-pip-version-check --progress-bar off \
      --no-deps --only-binary :all: -r "$requirements"
    "$dir/bin/python" -m pip check >/dev/null
    "$dir/bin/python" -c "import $imports"
    printf '%s\n' "$want" >"$stamp_file.tmp"
    mv "$stamp_file.tmp" "$stamp_file"
  ) 9>"$dir.lock"
}

# The torch 2.x lane (~5 GB from PyPI, once); sets ABP_TORCH2_PYTHON.
abp_torch2_venv() {
  abp_venv "$ABP_VENV" "$ABP_TORCH2_REQUIREMENTS" "torch, transformers, timm, peft, accelerate, numpy, pytest, matplotlib" \
    "torch 2.x (downloads ~5 GB)"
  export ABP_TORCH2_PYTHON="$ABP_VENV/bin/python"
}

# The wheel's build backend (scikit-build-core, a few hundred kB), for the install tests' and
# users' `pip wheel --no-build-isolation`; sets ABP_BUILD_PYTHON.
abp_build_venv() {
  abp_venv "$ABP_BUILD_VENV" "$ABP_BUILD_REQUIREMENTS" "scikit_build_core" "wheel build"
  export ABP_BUILD_PYTHON="$ABP_BUILD_VENV/bin/python"
}

abp_build() {
  local configure=()
  if [ ! -f "$ABP_BUILD/build.ninja" ]; then
    configure=(
      -DCMAKE_BUILD_TYPE=Release
      -DMLIR_DIR=/usr/lib/llvm-19/lib/cmake/mlir
      -DCUDAToolkit_ROOT=/usr/local/cuda
      -DPython3_EXECUTABLE="$ABP_PYTHON"
    )
  fi
  # The venvs' interpreters (abp_torch2_venv, abp_build_venv): configure again whenever the cache
  # does not hold one yet (a build tree configured before it existed, or with another venv).
  local var
  for var in ABP_TORCH2_PYTHON ABP_BUILD_PYTHON; do
    if [ -n "${!var:-}" ] && ! grep -qxF "$var:STRING=${!var}" "$ABP_BUILD/CMakeCache.txt" 2>/dev/null; then
      configure+=(-D"$var":STRING="${!var}")
    fi
  done
  if ((${#configure[@]})); then
    abp_log "configuring $ABP_BUILD"
    cmake -G Ninja -S "$ABP_ROOT" -B "$ABP_BUILD" "${configure[@]}" >/dev/null
  fi
  # Two cores: one build at a time, two jobs.
  cmake --build "$ABP_BUILD" -j 2
}

abp_env() {
  export PYTHONPATH="$ABP_ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
  export ABP_LIBRARY="$ABP_BUILD/lib/libabp.so"
  export ABP_KERNEL_DIR="$ABP_BUILD/kernels"
}
