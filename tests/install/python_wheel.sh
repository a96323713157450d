#!/usr/bin/env bash
# Builds abp's wheel (`pip wheel .`, scikit-build-core from the pinned build venv), installs it the
# ways users do, and runs smoke_installed.py from outside the tree with no ABP_* variable:
#   1. `pip install` into a new venv over the system's torch (Debian's 1.13: no PYTHONPATH at all);
#   2. `pip install --target` a directory used by the torch 2.x lane's interpreter, if configured.
# Usage: python_wheel.sh <source dir> <work dir> <build-venv python> <torch 1.13 python> [<torch 2 python>]
set -euo pipefail
source=$1 work=$2 build_py=$3 system_py=$4 torch2_py=${5:-}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rm -rf "$work" && mkdir -p "$work"
run_logged() { local name=$1; shift; if ! "$@" >"$work/$name.log" 2>&1; then cat "$work/$name.log"; return 1; fi; }
run_logged wheel "$build_py" -m pip wheel --no-build-isolation --no-deps --no-input \
  --disable-pip-version-check -w "$work/dist" "$source"
wheel=("$work"/dist/abp-*.whl)
echo "built ${wheel[0]##*/}"

clean_env=(env -i HOME="$HOME" PATH=/usr/bin:/bin LANG=C.UTF-8)
cd "$work"

"$system_py" -m venv --system-site-packages "$work/venv"
run_logged install-venv "$work/venv/bin/python" -m pip install --no-index --no-deps \
  --disable-pip-version-check "${wheel[0]}"
"${clean_env[@]}" "$work/venv/bin/python" "$here/smoke_installed.py" "$source"

if [ -n "$torch2_py" ]; then
  run_logged install-target "$build_py" -m pip install --no-index --no-deps \
    --disable-pip-version-check --target "$work/site-torch2" "${wheel[0]}"
  "${clean_env[@]}" PYTHONPATH="$work/site-torch2" "$torch2_py" "$here/smoke_installed.py" "$source"
fi
