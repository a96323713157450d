"""Which of compress_saved(bits=4)'s floors does the language model need? (measurement, CPU)

One width for every saved tensor raises fused attention's query and key and cross-entropy's
log-probabilities to 8 bits (abp._save_rules). Here the charlm task of real_tasks.py trains under
`compress_saved(bits=4)` with each floor turned off in turn (a knob of _save_rules, restored after
the run; this measures, it is not a setting to use):

  both       as shipped: query, key and log-probabilities at 8 bits
  qk-at-4    query and key at 4 bits, log-probabilities at 8
  lp-at-4    log-probabilities at 4 bits, query and key at 8

(every tensor at 4 bits, no floor: results/consistency-ablation-4bit-*.json). The controller at an
average of 2 bits stores query and key at 4 bits, which is where its gap to exact training comes
from (docs/compressed-training.md). Usage (torch 2.x lane): PYTHONPATH=bindings/python:bench
ABP_LIBRARY=... ABP_KERNEL_DIR=... python bench/floor_ablation.py [--seeds 5] [--variants ...]
[--out FILE]; results go to results/floor-ablation-cpu-<date>-<commit>.json.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any, Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from abp import _save_rules  # noqa: E402
import real_tasks  # noqa: E402
from timing import commit_id, write_results  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
#: Variant -> the _save_rules attribute set to NO_FLOORS for its runs.
VARIANTS: Dict[str, Any] = {"both": None, "qk-at-4": "_CONSISTENT_ATTENTION", "lp-at-4": "_LOG_SOFTMAX"}


def run(variant: str, seed: int) -> Dict[str, Any]:
    knob = VARIANTS[variant]
    saved = getattr(_save_rules, knob) if knob else None
    if knob:
        setattr(_save_rules, knob, _save_rules.NO_FLOORS)
    try:
        r = real_tasks.train("charlm", "compress-4", seed)
    finally:
        if knob:
            setattr(_save_rules, knob, saved)
    return {"seed": seed, "val_loss": r["val_loss"], "saved_bytes": r["saved_bytes"], "corpus": r["corpus"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results: Dict[str, Any] = {"device": "cpu", "date": datetime.date.today().isoformat(), "commit": commit_id(ROOT),
                               "torch": torch.__version__, "task": "charlm", "setting": "compress-4", "runs": {}}
    for variant in args.variants.split(","):
        rows = [run(variant, seed) for seed in range(args.seeds)]
        results["runs"][variant] = rows
        losses = [r["val_loss"] for r in rows]
        print(f"{variant:8s} mean {statistics.mean(losses):.4f}  " + " / ".join(f"{v:.3f}" for v in losses)
              + f"  saved {rows[0]['saved_bytes'] / 2**20:.2f} MiB", flush=True)
    write_results(results, ROOT, "floor-ablation-", args.out)


if __name__ == "__main__":
    main()
