#!/usr/bin/env python3
"""Writes and checks the op library's FewBit tables (ops/fewbit/tables.json and the generated
blocks of ops/fewbit/*.mlir) with abp's global solver (bindings/python/abp/_bucket_solver.py,
docs/algorithms.md §2.2–2.5, which describes the method; a user's own derivative goes through
the same solver with abp.buckets.fit_buckets).

Usage::

    /usr/bin/python3 tools/fewbit_solver.py [--activations gelu,silu] [--bits 1,2,3,4]
        [--weights normal,uniform] [--out ops/fewbit/tables.json] [--write-ops] [--check]
        [--verbose]

``--write-ops`` also rewrites the block between ``// BEGIN GENERATED TABLES`` and
``// END GENERATED TABLES`` in each ops/fewbit/<act>.mlir (missing files are skipped with a note;
a file without both markers is an error). ``--check`` runs the self-checks (derivatives against
finite differences, quadrature, mirror invariance), solves, validates every table, and compares
the result with the files on disk instead of writing them (exit status 1 on any difference), like
``black --check``; numbers are compared to 1e-9 relative (+1e-10 absolute), since numpy's SIMD
exp/log can differ in the last ulp between CPUs. On one machine the output is byte-for-byte
deterministic.
"""

from __future__ import annotations

import os

# Single-threaded on purpose: the solver is small and shares machines with compile jobs.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Dict, List, Optional, Sequence, Tuple  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
# The solver is numpy only, loaded on its own (no torch, no built library needed).
sys.path.insert(0, str(REPO_ROOT / "bindings" / "python" / "abp"))
from _bucket_solver import (  # noqa: E402,F401 (re-exported for tools/regelu2_fit.py and tests)
    ACTIVATIONS, GRID_STEP, MAX_BITS, WEIGHTS, Activation, Table, activation, derivative, mlir_float,
    objective, optimal_levels, self_check, solve, solve_with_info, validate_table, weight)

DEFAULT_OUT = "ops/fewbit/tables.json"
OPS_DIR = "ops/fewbit"
REGENERATE_COMMAND = "/usr/bin/python3 tools/fewbit_solver.py --write-ops"
BEGIN_MARKER = "// BEGIN GENERATED TABLES"
END_MARKER = "// END GENERATED TABLES"


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def mlir_alias(act: str, weight_name: str, bits: int, table: Table) -> str:
    """`#<act>_<n|u><k> = #abp.buckets<borders = [...], levels = [...]>`."""
    b = ", ".join(mlir_float(x) for x in table.borders)
    lv = ", ".join(mlir_float(x) for x in table.levels)
    return f"#{act}_{weight_name[0]}{bits} = #abp.buckets<borders = [{b}], levels = [{lv}]>"


def generated_block(act: str, tables: Dict[str, Dict[int, Table]]) -> List[str]:
    """Lines between the markers: the regenerate comment, then n1..n4 and u1..u4."""
    lines = [f"// regenerate: {REGENERATE_COMMAND}"]
    for wn in ("normal", "uniform"):
        for bits in range(1, MAX_BITS + 1):
            lines.append(mlir_alias(act, wn, bits, tables[wn][bits]))
    return lines


def rewrite_ops_text(text: str, block: List[str], path: str,
                     begin: str = BEGIN_MARKER, end: str = END_MARKER) -> str:
    """Replace the lines strictly between the `begin`/`end` marker lines; ValueError without
    exactly one pair (tools/regelu2_fit.py passes its own markers)."""
    lines = text.split("\n")
    begins = [i for i, ln in enumerate(lines) if ln.strip() == begin]
    ends = [i for i, ln in enumerate(lines) if ln.strip() == end]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(f"{path}: expected one '{begin}' line followed by one "
                         f"'{end}' line, found {len(begins)} and {len(ends)}")
    return "\n".join(lines[: begins[0] + 1] + block + lines[ends[0]:])


def _json_object(members: List[Tuple[str, str]], indent: int) -> str:
    """A JSON object with one member per line; values are already-serialised JSON."""
    pad = " " * (indent + 2)
    body = ",\n".join(f"{pad}{json.dumps(k)}: {v}" for k, v in members)
    return "{\n" + body + "\n" + " " * indent + "}"


def tables_json(tables: Dict[str, Dict[str, Dict[int, Table]]], generated_by: str) -> str:
    """The tables file: one table per line, floats as repr (round-trip)."""
    used = [wn for wn in WEIGHTS if any(wn in per_weight for per_weight in tables.values())]
    weights = [(wn, json.dumps({"w": WEIGHTS[wn].description,
                                "domain": [WEIGHTS[wn].lo, WEIGHTS[wn].hi]})) for wn in used]

    def per_bits(p: Dict[int, Table]) -> str:
        return _json_object([(str(b), json.dumps({"borders": list(p[b].borders),
                                                  "levels": list(p[b].levels), "J": p[b].J}))
                             for b in sorted(p)], 6)

    acts = [(act, _json_object([(wn, per_bits(pb)) for wn, pb in per_weight.items()], 4))
            for act, per_weight in tables.items()]
    return _json_object([("generated_by", json.dumps(generated_by)),
                         ("grid_step", json.dumps(GRID_STEP)),
                         ("weights", _json_object(weights, 2)),
                         ("tables", _json_object(acts, 2))], 0) + "\n"


_NUMBER = re.compile(r"-?\d+\.\d*(?:[eE][-+]?\d+)?|-?\d+(?:[eE][-+]?\d+)?")


def equivalent(a: str, b: str, rtol: float = 1e-9, atol: float = 1e-10) -> bool:
    """Whether two generated texts agree: identical apart from numbers, and numbers within
    atol + rtol·max(|x|, |y|). numpy's SIMD exp/log may differ in the last ulp between CPUs,
    which moves borders by ~1e-12; a real change of the algorithm moves them by far more."""
    if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
        return False
    xs = [float(v) for v in _NUMBER.findall(a)]
    ys = [float(v) for v in _NUMBER.findall(b)]
    return all(abs(x - y) <= atol + rtol * max(abs(x), abs(y)) for x, y in zip(xs, ys))


def _csv(value: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {bad or value!r}; expected a "
                                         f"comma-separated subset of {','.join(allowed)}")
    return [v for v in allowed if v in items]  # canonical order


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = list(ACTIVATIONS)
    p.add_argument("--activations", default=",".join(names),
                   type=lambda s: _csv(s, names, "activations"))
    p.add_argument("--bits", default="1,2,3,4",
                   type=lambda s: [int(b) for b in _csv(s, [str(i) for i in range(1, MAX_BITS + 1)],
                                                        "bits")])
    p.add_argument("--weights", default="normal,uniform",
                   type=lambda s: _csv(s, list(WEIGHTS), "weights"))
    p.add_argument("--out", default=None, help=f"tables file (default {DEFAULT_OUT} in the repo)")
    p.add_argument("--write-ops", action="store_true",
                   help=f"rewrite the generated block of each {OPS_DIR}/<act>.mlir")
    p.add_argument("--check", action="store_true",
                   help="self-check, solve, validate and compare with the files on disk; "
                        "writes nothing")
    p.add_argument("--verbose", action="store_true", help="per-table diagnostics on stderr")
    return p.parse_args(argv)  # string defaults go through `type` too


def _command(args: argparse.Namespace) -> str:
    """The canonical command reproducing the tables file (non-default options only)."""
    cmd = ["/usr/bin/python3", "tools/fewbit_solver.py"]
    if args.activations != list(ACTIVATIONS):
        cmd += ["--activations", ",".join(args.activations)]
    if args.bits != list(range(1, MAX_BITS + 1)):
        cmd += ["--bits", ",".join(str(b) for b in args.bits)]
    if args.weights != list(WEIGHTS):
        cmd += ["--weights", ",".join(args.weights)]
    if args.out is not None:
        cmd += ["--out", args.out]
    return " ".join(cmd)


def _is_full(args: argparse.Namespace) -> bool:
    return (args.activations == list(ACTIVATIONS) and args.bits == list(range(1, MAX_BITS + 1))
            and args.weights == list(WEIGHTS))


def _tables_up_to_date(path: Path, text: str, tables: Dict[str, Dict[str, Dict[int, Table]]],
                       full: bool) -> bool:
    """--check for the tables file: the whole text when every table was solved, else only the
    solved entries (an existing full file checked for a subset)."""
    if not path.exists():
        return False
    old = path.read_text()
    if full:
        return equivalent(old, text)
    try:
        entries = json.loads(old)["tables"]
        for act, per_weight in tables.items():
            for wn, per_bits in per_weight.items():
                for bits, tb in per_bits.items():
                    new = {"borders": list(tb.borders), "levels": list(tb.levels), "J": tb.J}
                    if not equivalent(json.dumps(entries[act][wn][str(bits)]), json.dumps(new)):
                        return False
    except (KeyError, TypeError, ValueError):
        return False
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    args = _parse_args(argv)
    out_path = Path(args.out) if args.out is not None else REPO_ROOT / DEFAULT_OUT
    full = _is_full(args)
    if args.write_ops and (args.bits != list(range(1, MAX_BITS + 1))
                           or args.weights != list(WEIGHTS)):
        print("error: --write-ops needs all bits and both weights (the ops reference n1..n4 and "
              "u1..u4)", file=sys.stderr)
        return 2
    if not full and args.out is None and not args.check:
        print(f"error: {DEFAULT_OUT} holds every table; writing a subset needs --out",
              file=sys.stderr)
        return 2
    failures: List[str] = []
    start = time.perf_counter()
    if args.check:
        failures += self_check(args.activations, args.weights)
    tables: Dict[str, Dict[str, Dict[int, Table]]] = {}
    for act in args.activations:
        t_act = time.perf_counter()
        tables[act] = {}
        for wn in args.weights:
            tables[act][wn] = {}
            for bits in args.bits:
                table, info = solve_with_info(act, bits, wn)
                tables[act][wn][bits] = table
                if args.check:
                    failures += validate_table(act, wn, table)
                if args.verbose:
                    print(f"  {act:10s} {wn:7s} {bits}-bit J={table.J:.9g} "
                          f"(DP {info.J_dp:.9g}, -{(1 - table.J / info.J_dp) * 100:.3g}%) "
                          f"cycles={info.cycles} sweeps={info.sweeps} "
                          f"collided={info.collisions} pinned={list(info.pinned)} "
                          f"mirrored={info.mirrored} kept_dp={info.kept_dp}", file=sys.stderr)
        print(f"{act}: {time.perf_counter() - t_act:.1f} s", file=sys.stderr)
    text = tables_json(tables, _command(args))
    ops: List[Tuple[Path, str]] = []
    if args.write_ops:
        for act in args.activations:
            path = REPO_ROOT / OPS_DIR / f"{act}.mlir"
            if not path.exists():
                print(f"note: {path} does not exist, skipped", file=sys.stderr)
                continue
            try:
                new = rewrite_ops_text(path.read_text(), generated_block(act, tables[act]),
                                       str(path))
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            ops.append((path, new))
    regen = REGENERATE_COMMAND if args.write_ops else _command(args)
    if args.check:
        if not _tables_up_to_date(out_path, text, tables, full):
            failures.append(f"{out_path} is not up to date (regenerate with {regen})")
        for path, content in ops:
            if not equivalent(path.read_text(), content):
                failures.append(f"{path} is not up to date (regenerate with {regen})")
    else:
        for path, content in [(out_path, text)] + ops:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(content)
            os.replace(tmp, path)
    print(f"total: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
