"""Typed records of the operator manifests (docs/manifest.md), parsed from abp_library_operators_json."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = [
    "KernelArg",
    "KernelRecord",
    "Direction",
    "Residual",
    "Table",
    "Operator",
    "parse_operators",
    "parse_ref",
    "packed_bytes",
]

_REF = re.compile(r"^(input|param|residual|grad|result|total|colsum)(0|[1-9][0-9]{0,5})$")


def parse_ref(ref: str) -> Tuple[str, int]:
    """Splits a manifest reference ("residual1") into its kind and index (("residual", 1))."""
    m = _REF.match(ref)
    if m is None:
        raise ValueError(f"manifest reference {ref!r} is not inputN, paramN, residualN, gradN, resultN, totalN "
                         "or colsumN")
    return m.group(1), int(m.group(2))


def packed_bytes(bits: int, n: int) -> int:
    """Bytes of n packed codes of `bits` bits each: ceil(bits * n / 8) (docs/algorithms.md §2.6)."""
    return (bits * n + 7) // 8


@dataclass(frozen=True)
class KernelArg:
    """One kernel argument: role in/out/scalar/count/scratch; layout dense/packed/rows/cols/
    gathered/total for in/out; `type` of a scalar (f32/i64) or of a rows input holding row indices (i32);
    `by`: the argument holding a gathered input's row indices; `values`: a total kernel's scratch
    size, in compute-type values."""

    role: str
    layout: Optional[str] = None
    bits: Optional[int] = None
    type: Optional[str] = None
    by: Optional[int] = None
    values: Optional[int] = None


@dataclass(frozen=True)
class KernelRecord:
    """One generated kernel (all dtype specialisations) and its calling convention."""

    name: str
    symbols: Mapping[str, str]
    block: int
    chunk: int
    args: Tuple[KernelArg, ...]
    # or "rows": args end in (rows, cols) instead of the count; or "total": reduces one value per
    # element over the whole launch into its one output, with a scratch before the count
    kind: str = "elementwise"
    warp_max_cols: int = 0
    @property
    def inputs(self) -> Tuple[KernelArg, ...]:
        """The `in` and `scalar` arguments, in order (what a direction's `args` feed)."""
        return tuple(a for a in self.args if a.role in ("in", "scalar"))

    @property
    def outputs(self) -> Tuple[KernelArg, ...]:
        """The `out` arguments, in order (`result0`, `result1`, ...)."""
        return tuple(a for a in self.args if a.role == "out")


@dataclass(frozen=True)
class Direction:
    """A direction (forward or backward): the kernel, where its inputs come from, what it produces;
    before it, its total kernels (kernel, args), whose results are total0, total1, ...; after it,
    the row-wide values summed over the rows (a per-column input's gradient), colsum0, ..."""

    kernel: Optional[str]
    args: Tuple[str, ...]
    produces: Tuple[str, ...]
    totals: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    col_sums: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Residual:
    """What forward saves: `codes` (packed, `bits` per element), `tensor` (dense), `rows` (one
    value per row), `cols` (a per-column input saved as it is: one value per column), `shared`
    (forward output `output` itself: no memory of its own), `scalar` (f32) or `total` (a
    whole-tensor reduction: one compute-dtype value on the device, a 0-d tensor)."""

    kind: str
    bits: Optional[int] = None
    output: Optional[int] = None


@dataclass(frozen=True)
class Table:
    """A bucket scheme: inner borders t_0 < ... and levels L_0 ... (fp32 values, as the kernels use them)."""

    borders: Tuple[float, ...]
    levels: Tuple[float, ...]


@dataclass(frozen=True)
class Operator:
    """One manifest operator plus the records of the kernels it launches."""

    name: str
    inputs: int
    outputs: int
    params: Tuple[str, ...]
    residuals: Tuple[Residual, ...]
    saved_bits_per_element: float
    tables: Tuple[Table, ...]
    forward: Optional[Direction]
    backward: Optional[Direction]
    kernels: Mapping[str, KernelRecord]
    raw: Mapping[str, Any] = field(compare=False, repr=False)
    saved_bits_per_row: float = 0.0
    row_wise: bool = False  # launches row kernels: inputs are rows along their last dimension
    no_grad: Tuple[int, ...] = ()  # tensor inputs without a gradient (row indices, weights)
    # The launch bindings of this operator (abp._launch.binding), resolved once per direction
    # and dtype; they live with the record, so an operator compiled again gets its own.
    bindings: Dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    # The launch dtypes (manifest names) every kernel of the operator supports. Computed once,
    # at construction: a plain attribute, which torch.compile traces through (abp.functional
    # reads it on every call; a cached_property would break the graph).
    dtypes: Tuple[str, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        names: Optional[set] = None
        for record in self.kernels.values():
            names = set(record.symbols) if names is None else names & set(record.symbols)
        order = ("f32", "f16", "bf16", "f64")
        object.__setattr__(self, "dtypes", tuple(d for d in order if names is None or d in names))

    @cached_property
    def input_args(self) -> Tuple[Optional[KernelArg], ...]:
        """Per tensor input, the forward kernel argument reading it (its layout says how the
        input is shaped: dense, one value per row, or rows gathered by index), or None when the
        forward kernel does not read it (it is only saved, or there is no kernel)."""
        specs: List[Optional[KernelArg]] = [None] * self.inputs
        record = self.kernel(self.forward) if self.forward is not None else None
        if record is not None and self.forward is not None:
            for ref, spec in zip(self.forward.args, record.inputs):
                kind, index = parse_ref(ref)
                if kind == "input":
                    specs[index] = spec
        return tuple(specs)

    @cached_property
    def output_layouts(self) -> Tuple[str, ...]:
        """Per output, "dense" (shaped like the dense inputs) or "rows" (one value per row, in
        the compute dtype)."""
        record = self.kernel(self.forward) if self.forward is not None else None
        layouts = []
        for ref in (self.forward.produces[: self.outputs] if self.forward is not None else ()):
            kind, index = parse_ref(ref)
            spec = record.outputs[index] if kind == "result" and record is not None else None
            layouts.append("rows" if spec is not None and spec.layout == "rows" else "dense")
        return tuple(layouts)

    @property
    def gradient_inputs(self) -> Tuple[int, ...]:
        """The tensor inputs that get a gradient, in the order backward produces them."""
        return tuple(i for i in range(self.inputs) if i not in self.no_grad)

    def kernel(self, direction: Direction) -> Optional[KernelRecord]:
        """The kernel record of a direction (None if it launches none)."""
        return self.kernels[direction.kernel] if direction.kernel is not None else None


def _kernel_arg(raw: Mapping[str, Any]) -> KernelArg:
    return KernelArg(
        role=raw["role"], layout=raw.get("layout"), bits=raw.get("bits"), type=raw.get("type"), by=raw.get("by"),
        values=raw.get("values"),
    )


def _kernel(raw: Mapping[str, Any]) -> KernelRecord:
    return KernelRecord(
        name=raw["name"],
        symbols=dict(raw["symbols"]),
        block=int(raw["block"]),
        chunk=int(raw["chunk"]),
        args=tuple(_kernel_arg(a) for a in raw["args"]),
        kind=str(raw.get("kind", "elementwise")),
        warp_max_cols=int(raw.get("warp_max_cols", 0)),
    )


def _direction(raw: Optional[Mapping[str, Any]]) -> Optional[Direction]:
    if raw is None:
        return None
    return Direction(
        kernel=raw.get("kernel"),
        args=tuple(raw.get("args", ())),
        produces=tuple(raw["produces"]),
        totals=tuple((t["kernel"], tuple(t["args"])) for t in raw.get("totals", ())),
        col_sums=tuple(raw.get("col_sums", ())),
    )


def _operator(raw: Mapping[str, Any]) -> Operator:
    kernels = {k["name"]: _kernel(k) for k in raw.get("kernels", [])}
    op = Operator(
        name=raw["name"],
        inputs=int(raw["inputs"]),
        outputs=int(raw["outputs"]),
        params=tuple(raw.get("params", [])),
        residuals=tuple(
            Residual(kind=r["kind"], bits=r.get("bits"), output=r.get("output")) for r in raw.get("residuals", [])
        ),
        saved_bits_per_element=float(raw.get("saved_bits_per_element", 0)),
        saved_bits_per_row=float(raw.get("saved_bits_per_row", 0)),
        row_wise=bool(raw.get("row_wise", False)),
        no_grad=tuple(int(i) for i in raw.get("no_grad", ())),
        tables=tuple(
            Table(borders=tuple(float(b) for b in t["borders"]), levels=tuple(float(v) for v in t["levels"]))
            for t in raw.get("tables", [])
        ),
        forward=_direction(raw.get("forward")),
        backward=_direction(raw.get("backward")),
        kernels=kernels,
        raw=raw,
    )
    for direction in (op.forward, op.backward):
        if direction is None:
            continue
        for name in [direction.kernel] + [kernel for kernel, _ in direction.totals]:
            if name is not None and name not in kernels:
                raise ValueError(f"operator {op.name}: kernel {name!r} has no record in the manifest")
    return op


def parse_operators(text: str) -> Dict[str, Operator]:
    """Parses the JSON array of abp_library_operators_json into operators by name."""
    items: List[Mapping[str, Any]] = json.loads(text)
    return {raw["name"]: _operator(raw) for raw in items}
