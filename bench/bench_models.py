"""Saved activation bytes of real architectures before and after each abp.convert recipe.

For each model of bench/model_zoo.py (d 768, 2 layers, batch 2 x 128 tokens or 224^2 images) and
each of fp32 and bf16 autocast, one training step's saved bytes are counted with
abp.memory.report (each storage once; parameters and buffers left out; compress_saved's codes
counted): exact, "lowmembp" (MS norms + ReGELU2/ReSiLU2), "lowmembp" with FewBit 3-bit GELU/SiLU,
"sampled" (WTA-CRS, keep 0.3) and "all" (those stacked with compress_saved at 8 bits). The
*ceiling* is what the exact model's norms and GELU/SiLU activations saved: what LowMemoryBP can
remove at most. Each model is converted with ``example_inputs=`` (one batch), as docs/python.md
recommends: then norms that only linear layers read emit the autocast dtype under autocast.
Peak memory and step time need a GPU (bench/results: none run yet for this table).

    PYTHONPATH=bindings/python ABP_LIBRARY=build/lib/libabp.so python bench/bench_models.py [--out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

import abp
from abp import _recognise

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_zoo  # noqa: E402

RECIPES: Dict[str, Dict[str, Any]] = {
    "lowmembp": dict(recipe="lowmembp"),
    "fewbit3": dict(recipe="lowmembp", gelu="gelu_b3", silu="silu_b3"),
    "sampled": dict(recipe="sampled"),
    "all": dict(recipe="all"),
}

#: What the papers report on these architectures (activation memory or peak, as stated).
REPORTED = {
    "vit": "LowMemoryBP: -39 % activation memory (ViT-B)",
    "timm_vit": "LowMemoryBP: -39 % activation memory (ViT-B)",
    "llama": "LowMemoryBP: -29 % activation memory (LLaMA-7B)",
    "roberta": "FewBit: -13.8 % peak memory (RoBERTa-base, 3-bit GELU)",
}


def _loss(output: Any) -> torch.Tensor:
    y = output if isinstance(output, torch.Tensor) else output[0]
    return y.float().pow(2).mean()


def _measure(model: torch.nn.Module, x: torch.Tensor, autocast: bool) -> abp.memory.MemoryReport:
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        return abp.memory.report(model, (x,), loss_fn=_loss)


def run(names: List[str]) -> List[Dict[str, Any]]:
    rows = []
    for name in names:
        torch.manual_seed(0)
        model, make_input = model_zoo.build(name, "bench")
        model.train()
        x = make_input(0)
        kinds = {n: s for n, m in model.named_modules() if n and (s := _recognise.recognise(m)) is not None}
        parts = [n for n, s in kinds.items() if isinstance(s, _recognise.Norm)
                 or (isinstance(s, _recognise.Activation) and s.kind in ("gelu", "gelu_tanh", "silu"))]
        # With the example call, norms read only by linear layers emit the autocast dtype (docs/python.md).
        converted = {label: abp.convert(model, **spec, example_inputs=(x,))[0] for label, spec in RECIPES.items()}
        for autocast in (False, True):
            exact = _measure(model, x, autocast)
            row: Dict[str, Any] = {"model": name, "dtype": "bf16 autocast" if autocast else "fp32",
                                   "exact_bytes": exact.total_bytes,
                                   "ceiling_bytes": sum(exact.per_module.get(n, 0) for n in parts),
                                   "reported": REPORTED.get(name, "")}
            for label, m in converted.items():
                row[f"{label}_bytes"] = _measure(m, x, autocast).total_bytes
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _pct(before: int, after: int) -> str:
    return f"{100 * (before - after) / before:5.1f} %"


def _line(row: Dict[str, Any]) -> str:
    e = row["exact_bytes"]
    cells = [f"{row['model']:<9}", f"{row['dtype']:<13}", f"{e / 2**20:8.1f} MiB", f"ceiling -{_pct(e, e - row['ceiling_bytes'])}"]
    cells += [f"{label} -{_pct(e, row[f'{label}_bytes'])}" for label in RECIPES]
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(model_zoo.ARCHITECTURES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = run(args.models)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"device": "cpu", "date": datetime.date.today().isoformat(), "commit": commit,
              "torch": torch.__version__, "size": model_zoo.SIZES["bench"], "rows": rows}
    out = args.out or Path(__file__).resolve().parent / "results" / f"models-cpu-{result['date']}-{commit}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
