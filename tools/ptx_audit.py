#!/usr/bin/env python3
"""Audits the generated kernels' PTX for what the roofline needs (issue #16 item 4), without a GPU.

For every kernel of every bundle in a kernel directory (NAME.json, as the build writes them) and
every dtype it is built for, this reads the bundle's PTX (NAME.ptx, or compiled first from the
operator file the manifest names with `--compile abp-compile`, NVRTC's path) and reports:

  * which global memory stream each load and store belongs to: the pointer argument its address
    is derived from (a forward dataflow over the entry's registers, to a fixed point across loop
    back edges; a loaded value is data, never an address of an argument);
  * for each argument the manifest calls dense, whether it is read (an output: written) with a
    128-bit access (`.v4` of 32-bit lanes, `.v2` of 64-bit ones): the generated loops move
    aligned, full chunks through 128-bit vectors and only a tail element by element;
  * static instruction counts: all of the entry's, and those of its fast path: the cheapest path
    through the control-flow graph from the first block that reads an input stream (with a
    128-bit access where there is one) to a block that writes an output, both ends included. That
    is one full chunk's work when every data-dependent branch (a tail, a NaN patch) goes its cheap
    way; in a row kernel it also holds the row's reductions once, so for short rows it is an upper
    bound. Per element: divided by the elements a thread handles per step (the manifest's chunk).

`--check` exits with status 1 when a dense stream has no 128-bit access, or a row kernel touches
local memory (the chunks a short row keeps across its sweeps must be registers; elementwise
kernels may, on a cold path such as a large-argument cosine's reduction). The counts are static
PTX instructions (ptxas may fuse or split some); compare them across commits and dtypes, not
against a GPU's issue rate. Usage:

  tools/ptx_audit.py KERNEL_DIR --ptx-dir DIR [--compile build/bin/abp-compile] [--arch sm_90]
                     [--check] [--table FILE]
"""
from __future__ import annotations

import argparse
import json
import heapq
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.M)
_PARAM = re.compile(r"\.param \.\w+ (\w+_param_(\d+))")
_REG = re.compile(r"%[a-z]+\d+")
_PREDICATE = re.compile(r"^@!?%p\d+\s+")
_LOCAL = re.compile(r"^(?:@!?%p\d+\s+)?(?:ld|st)\.local")
_LABEL = re.compile(r"^(\$?\w+):$")
_MEMORY = re.compile(r"^(?:@!?%p\d+\s+)?(ld|st)\.global(\.nc)?((?:\.v\d)?)\.(\w+)")
_WIDTHS = {"u8": 8, "s8": 8, "b8": 8, "u16": 16, "s16": 16, "b16": 16, "f16": 16, "bf16": 16,
           "u32": 32, "s32": 32, "b32": 32, "f32": 32, "u64": 64, "s64": 64, "b64": 64, "f64": 64}


@dataclass
class Access:
    kind: str  # "ld" or "st"
    bits: int  # bits moved by one instruction
    params: Set[int]  # the pointer arguments its address derives from
    block: int


@dataclass
class Entry:
    name: str
    params: int
    instructions: List[str] = field(default_factory=list)
    blocks: List[Tuple[Optional[str], List[int]]] = field(default_factory=list)  # (label, instruction indices)
    accesses: List[Access] = field(default_factory=list)


def _statements(body: str) -> List[str]:
    """The entry body as labels and instructions, one per item, comments and declarations dropped."""
    out = []
    for line in body.splitlines():
        line = line.split("//", 1)[0].strip()
        if not line or line.startswith(".") or line in ("{", "}"):
            continue
        out.append(line.rstrip(";").strip())
    return out


def _operands(instruction: str) -> Tuple[List[str], List[str]]:
    """(destination registers, source registers) of one instruction. PTX writes destinations first;
    stores, branches and barriers have none."""
    text = re.sub(r"^@!?%p\d+\s+", "", instruction)
    opcode, _, rest = text.partition(" ")
    regs = _REG.findall(rest)
    if opcode.startswith(("st.", "bra", "bar", "ret", "red.", "membar", "fence")):
        return [], regs
    if not regs:
        return [], []
    # `mov.b32 {%rs1, %rs2}, %r3` unpacks a vector: every register in the braces is written.
    if rest.lstrip().startswith("{"):
        head, _, tail = rest.partition("}")
        return _REG.findall(head), _REG.findall(tail)
    return regs[:1], regs[1:]


def parse(ptx: str) -> List[Entry]:
    entries = []
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    for n, (start, name) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(ptx)
        text = ptx[start:end]
        closing = re.search(r"^}", text, re.M)  # the entry's body ends here (a .func may follow)
        text = text[: closing.end()] if closing else text
        header, _, body = text.partition(")")
        params = {int(m.group(2)): m.group(1) for m in _PARAM.finditer(header)}
        entry = Entry(name, len(params))
        entry.instructions = []
        label: Optional[str] = None
        current: List[int] = []
        for statement in _statements(body):
            m = _LABEL.match(statement)
            if m:
                if current or label is not None:
                    entry.blocks.append((label, current))
                label, current = m.group(1), []
                continue
            entry.instructions.append(statement)
            current.append(len(entry.instructions) - 1)
            if re.match(r"^(@!?%p\d+\s+)?(bra|ret)", statement):  # a branch ends its block
                entry.blocks.append((label, current))
                label, current = None, []
        if current or label is not None:
            entry.blocks.append((label, current))
        _taint(entry, {name_: index for index, name_ in params.items()})
        entries.append(entry)
    return entries


def _taint(entry: Entry, params: Dict[str, int]) -> None:
    """Which pointer arguments each register's value derives from, to a fixed point (loops carry
    addresses around back edges), then each global access's stream."""
    origin: Dict[str, Set[int]] = {}
    changed = True
    while changed:
        changed = False
        for instruction in entry.instructions:
            dests, sources = _operands(instruction)
            if not dests:
                continue
            found: Set[int] = set()
            m = re.search(r"\[(\w+_param_\d+)\]", instruction)
            if m and instruction.startswith("ld.param"):
                found.add(params[m.group(1)])
            for s in sources:
                found |= origin.get(s, set())
            if _PREDICATE.sub("", instruction).startswith("ld.global"):
                found = set()  # a loaded value is data, not an address derived from an argument
            for d in dests:
                if not found <= origin.get(d, set()):
                    origin[d] = origin.get(d, set()) | found
                    changed = True
    block_of = {i: b for b, (_, members) in enumerate(entry.blocks) for i in members}
    for i, instruction in enumerate(entry.instructions):
        m = _MEMORY.match(instruction)
        if not m:
            continue
        lanes = int(m.group(3)[2:]) if m.group(3) else 1
        address = instruction[instruction.index("[") + 1 : instruction.index("]")]
        streams: Set[int] = set()
        for reg in _REG.findall(address):
            streams |= origin.get(reg, set())
        entry.accesses.append(Access(m.group(1), lanes * _WIDTHS.get(m.group(4), 0), streams, block_of[i]))


def _successors(entry: Entry) -> List[List[int]]:
    """Each basic block's successors: its branch target, and the next block unless it ends in an
    unconditional branch or a return."""
    index = {label: b for b, (label, _) in enumerate(entry.blocks) if label}
    out: List[List[int]] = []
    for b, (_, members) in enumerate(entry.blocks):
        last = entry.instructions[members[-1]] if members else ""
        succ = []
        m = re.match(r"^(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$?\w+)", last)
        if m:
            succ.append(index[m.group(2)])
        conditional = bool(m and m.group(1))
        returns = re.match(r"^ret\b", last) is not None  # a predicated return may fall through
        if (not m or conditional) and not returns and b + 1 < len(entry.blocks):
            succ.append(b + 1)
        out.append(succ)
    return out


def fast_path_instructions(entry: Entry, reads: Set[int], writes: Set[int]) -> int:
    """Instructions on the cheapest path from the first block that reads an input stream (with a
    128-bit access if there is one) to a block that writes an output stream (likewise): what one
    full chunk costs when every data-dependent branch (a NaN patch, a tail) goes its cheap way.
    Both end blocks count. 0 if the kernel has no such pair."""

    def blocks(kind: str, streams: Set[int]) -> List[int]:
        hits = [a for a in entry.accesses if a.kind == kind and a.params & streams]
        wide = [a for a in hits if a.bits >= 128]
        return sorted({a.block for a in (wide or hits)})

    sources, sinks = blocks("ld", reads), set(blocks("st", writes))
    if not sources or not sinks:
        return 0
    succ = _successors(entry)
    cost = [len(members) for _, members in entry.blocks]
    start = sources[0]
    best = {start: cost[start]}
    frontier = [(cost[start], start)]
    while frontier:
        d, b = heapq.heappop(frontier)
        if b in sinks:
            return d
        if d > best.get(b, 1 << 60):
            continue
        for n in succ[b]:
            nd = d + cost[n]
            if nd < best.get(n, 1 << 60):
                best[n] = nd
                heapq.heappush(frontier, (nd, n))
    return 0


@dataclass
class Report:
    bundle: str
    kernel: str
    dtype: str
    symbol: str
    chunk: int
    dense: List[Tuple[int, str]]  # (argument index, role) of dense streams
    missing: List[Tuple[int, str]]  # dense streams without a 128-bit access
    total: int
    fast: int
    local: int = 0  # local-memory loads and stores (spills, run-time indexed arrays)
    rows: bool = False  # a row kernel: its kept chunks must be registers, never local memory


def _element_streams(args: List[dict], role: str) -> Set[int]:
    """The arguments of `role` that hold one value per element (dense or packed codes), or, for a
    kernel with none, every argument of that role (a gather's rows, a sketch)."""
    of_role = {i for i, a in enumerate(args) if a.get("role") == role}
    per_element = {i for i in of_role if args[i].get("layout") in ("dense", "packed")}
    return per_element or of_role


def audit_bundle(manifest: dict, ptx: str, bundle: str) -> List[Report]:
    entries = {e.name: e for e in parse(ptx)}
    reports = []
    for kernel in manifest.get("kernels", []):
        args = kernel.get("args", [])
        dense = [(i, a["role"]) for i, a in enumerate(args) if a.get("layout") == "dense"]
        for dtype, symbol in kernel.get("symbols", {}).items():
            entry = entries.get(symbol)
            if entry is None:
                raise SystemExit(f"{bundle}: kernel {symbol} is in the manifest but not in the PTX")
            missing = []
            for index, role in dense:
                kind = "st" if role == "out" else "ld"
                if not any(a.bits >= 128 and index in a.params and a.kind == kind for a in entry.accesses):
                    missing.append((index, role))
            reads, writes = _element_streams(args, "in"), _element_streams(args, "out")
            local = sum(1 for i in entry.instructions if _LOCAL.match(i))
            reports.append(Report(bundle, kernel["name"], dtype, symbol, int(kernel.get("chunk", 1)),
                                  dense, missing, len(entry.instructions),
                                  fast_path_instructions(entry, reads, writes), local,
                                  kernel.get("kind") == "rows"))
    return reports


def table(reports: Iterable[Report]) -> str:
    lines = ["| bundle | kernel | dtype | dense streams | 128-bit | instructions | fast path | per element | local |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        wide = "all" if not r.missing else "missing " + ", ".join(f"arg{i} ({role})" for i, role in r.missing)
        if not r.dense:
            wide = "-"
        per = f"{r.fast / r.chunk:.1f}" if r.fast else "-"
        lines.append(f"| {r.bundle} | {r.kernel} | {r.dtype} | {len(r.dense)} | {wide} | {r.total} | "
                     f"{r.fast or '-'} | {per} | {r.local} |")
    return "\n".join(lines) + "\n"


def compile_bundles(kernel_dir: Path, ptx_dir: Path, compiler: Path, source_root: Path, arch: str) -> None:
    """NAME.ptx for every bundle of kernel_dir, from the operator file its manifest names, through
    abp-compile's NVRTC path."""
    ptx_dir.mkdir(parents=True, exist_ok=True)
    for manifest_path in sorted(kernel_dir.glob("*.json")):
        manifest = json.loads(manifest_path.read_text())
        if "kernels" not in manifest or "file" not in manifest:
            continue
        source = Path(manifest["file"])
        source = source if source.is_absolute() else source_root / source
        out = ptx_dir / (manifest_path.stem + ".ptx")
        done = subprocess.run([str(compiler), "--emit=ptx", f"--arch={arch}", str(source), "-o", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{source}: abp-compile --emit=ptx failed:\n{done.stderr}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel_dir", type=Path, help="a directory of NAME.json bundles (build/kernels)")
    parser.add_argument("--ptx-dir", type=Path, required=True, help="where NAME.ptx is (or is written, with --compile)")
    parser.add_argument("--compile", type=Path, metavar="ABP_COMPILE",
                        help="compile each bundle's operator file to PTX first, with this abp-compile")
    parser.add_argument("--source-root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="what the manifests' operator paths are relative to (the repository)")
    parser.add_argument("--arch", default="sm_90", help="the GPU architecture to compile for (default sm_90)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a dense stream has no 128-bit access or a row kernel uses local memory")
    parser.add_argument("--table", type=Path, help="write the markdown table here")
    args = parser.parse_args(argv)
    if args.compile:
        compile_bundles(args.kernel_dir, args.ptx_dir, args.compile, args.source_root, args.arch)
    reports: List[Report] = []
    for manifest_path in sorted(args.kernel_dir.glob("*.json")):
        manifest = json.loads(manifest_path.read_text())
        if "kernels" not in manifest:
            continue
        ptx_path = args.ptx_dir / (manifest_path.stem + ".ptx")
        if not ptx_path.exists():
            raise SystemExit(f"{ptx_path}: no PTX for bundle {manifest_path.stem}")
        reports += audit_bundle(manifest, ptx_path.read_text(), manifest_path.stem)
    if not reports:
        raise SystemExit(f"{args.kernel_dir}: no kernel bundles (NAME.json with kernels) found")
    text = table(reports)
    if args.table:
        args.table.write_text(text)
    else:
        sys.stdout.write(text)
    bad = [r for r in reports if r.missing or (r.rows and r.local)]
    for r in bad:
        if r.missing:
            print(f"{r.bundle}: {r.symbol}: dense stream(s) without a 128-bit access: "
                  + ", ".join(f"argument {i} ({role})" for i, role in r.missing), file=sys.stderr)
        if r.rows and r.local:
            print(f"{r.bundle}: {r.symbol}: a row kernel with {r.local} local-memory accesses (its kept "
                  "chunks must stay in registers)", file=sys.stderr)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
