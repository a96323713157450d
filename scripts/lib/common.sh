# common.sh — shared by scripts/demo and scripts/test: install what is missing, then build.
# Idempotent: a machine that already has everything runs no apt-get, and an up-to-date build
# tree makes the build step a no-op.
set -euo pipefail

ABP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ABP_BUILD="${ABP_BUILD_DIR:-$ABP_ROOT/build}"
# Debian's python3-torch and friends live in the system interpreter, not a pyenv one on PATH.
ABP_PYTHON=/usr/bin/python3

# MLIR/LLVM pinned to 19: libmlir-19 and libmlir-22 conflict and apt would remove the other.
# mlir-19-tools is needed by MLIR's CMake config (mlir-tblgen, mlir-pdll) although
# libmlir-19-dev does not depend on it; llvm-19-tools brings FileCheck; lit ships with llvm-19-dev.
ABP_PACKAGES=(
  cmake ninja-build g++
  libmlir-19-dev mlir-19-tools llvm-19-dev llvm-19-tools
  libfmt-dev libgtest-dev
  python3-dev python3-numpy python3-pytest python3-torch
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

abp_build() {
  if [ ! -f "$ABP_BUILD/build.ninja" ]; then
    abp_log "configuring $ABP_BUILD"
    cmake -G Ninja -S "$ABP_ROOT" -B "$ABP_BUILD" \
      -DCMAKE_BUILD_TYPE=Release \
      -DMLIR_DIR=/usr/lib/llvm-19/lib/cmake/mlir \
      -DCUDAToolkit_ROOT=/usr/local/cuda \
      -DPython3_EXECUTABLE="$ABP_PYTHON" >/dev/null
  fi
  # Two cores: one build at a time, two jobs.
  cmake --build "$ABP_BUILD" -j 2
}

abp_env() {
  export PYTHONPATH="$ABP_ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
  export ABP_LIBRARY="$ABP_BUILD/lib/libabp.so"
  export ABP_KERNEL_DIR="$ABP_BUILD/kernels"
}
