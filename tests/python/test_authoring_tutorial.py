"""docs/authoring.md runs: its Python blocks, in order, in one namespace (each asserts what the
text claims), so the tutorial cannot drift from what abp.author does."""
from __future__ import annotations

import re
from pathlib import Path

from abp_reference import compiler_or_skip

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "authoring.md"


def test_the_tutorial_runs() -> None:
    compiler_or_skip()
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), flags=re.S)
    assert len(blocks) >= 6  # the imports, four operators, the inspection
    namespace: dict = {"__name__": "authoring_tutorial"}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"{TUTORIAL}:block{number}", "exec"), namespace)
