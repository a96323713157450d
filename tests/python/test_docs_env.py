"""docs/runtime.md's table of environment variables names every variable abp registers (the list
`abp-compile --print-env` prints from runtime/Env.cpp), and no other: a variable added to the
runtime without a line in the docs fails here."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _abp_compile() -> Path:
    candidates = [Path(os.environ[v]) / "bin" / "abp-compile" for v in ("ABP_BUILD_DIR",) if os.environ.get(v)]
    if os.environ.get("ABP_LIBRARY"):
        candidates.append(Path(os.environ["ABP_LIBRARY"]).resolve().parents[1] / "bin" / "abp-compile")
    candidates.append(ROOT / "build" / "bin" / "abp-compile")
    for path in candidates:
        if path.is_file():
            return path
    pytest.skip("abp-compile is not built (cmake --build)")


def test_the_runtime_docs_list_every_registered_variable() -> None:
    printed = subprocess.run([str(_abp_compile()), "--print-env"], capture_output=True, text=True,
                             env={"PATH": os.environ.get("PATH", "")}, timeout=60, check=True).stdout
    registered = re.findall(r"^(ABP_[A-Z0-9_]+)=", printed, flags=re.M)
    assert len(registered) >= 10
    docs = (ROOT / "docs" / "runtime.md").read_text()
    table = docs[docs.index("## Environment variables"):]
    table = table[:table.index("\n## ")]
    documented = re.findall(r"^\| `(ABP_[A-Z0-9_]+)` \|", table, flags=re.M)
    assert documented == registered
