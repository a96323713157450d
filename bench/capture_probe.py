"""Which abp ops and recipes are capture-safe on a GPU (#16 item 3): for each, one forward and
backward step (1) under torch.cuda.set_sync_debug_mode("error"), which raises at the first
host-device synchronisation torch makes (the runtime's own calls are not seen), and (2) captured
in a CUDA graph and replayed, the replay's output and input gradient compared with an eager step
where the step is deterministic. Prints a table; --json writes the rows. Needs torch with CUDA.

    python bench/capture_probe.py [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import weakref
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

import abp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_overhead  # noqa: E402
from timing import commit_id  # noqa: E402

CUDA = torch.device("cuda")
ROWS, COLS = 64, host_overhead.COLS  # the norms of host_overhead.pairs() are that wide

Step = Callable[[torch.Tensor], torch.Tensor]  # x -> output (backward done inside)


def _module_step(module: torch.nn.Module, context: Optional[Callable[[], object]] = None) -> Step:
    def run(x: torch.Tensor) -> torch.Tensor:
        for p in module.parameters():
            p.grad = None
        with context() if context is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
            y = module(x)
            y.float().square().sum().backward()  # inside: a controller's step ends with its backward
        return y.detach()
    return run


#: What is not capture-safe: a controller's estimation step replays the model (bench/README.md).
#: tests/python/test_cuda_capture.py holds the rest, and tests/python/test_sync_free.py their host reads.
NOT_YET = frozenset({"CompressionController(avg_bits=2)"})

#: Tensor functions that read a tensor's values on the host: on a GPU each waits for the device
#: (a synchronisation, which also ends a CUDA graph capture with an error).
HOST_READS = frozenset({
    "__bool__", "__int__", "__float__", "__index__", "__complex__", "__format__", "item", "tolist", "numpy", "cpu",
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount", "equal", "allclose",
    "one_hot",
})


class HostReads(torch.overrides.TorchFunctionMode):
    """Records each call that reads tensor values on the host: HOST_READS, `.cpu()` whatever the
    tensor's device, `.to` the CPU from another device, indexing with a bool mask (get or set),
    one-argument `where`, repeat_interleave without output_size. What set_sync_debug_mode("error")
    would stop at on a GPU, seen on any device, so a CPU test can hold a step to it.

    A mode is switched off while its own handler runs, and `Tensor.backward` reaches the engine
    through it: backward is run here through the engine with this mode on, so that what backward
    calls (a custom Function's backward, a saved-tensor hook) is seen too. A key drawn on the host
    (torch.randint on the CPU, as abp draws its Philox keys) is host data: reading it is no sync.
    Not seen: what C++ reads internally (linalg's info checks), and copies from a GPU into a host
    tensor, which a CPU run cannot tell from a host copy."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: List[str] = []
        # id -> the key itself, while it lives (an id is reused once its tensor is freed).
        self._host_keys: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name == "backward" and target is not None:
            return self._backward(target, *args[1:], **kwargs)
        out = func(*args, **kwargs)
        if name == "randint" and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self._host_keys[id(out)] = out
        elif target is not None and self._host_keys.get(id(target)) is target:
            pass
        elif name in HOST_READS or _reads_values(name, args, kwargs, target):
            self.reads.append(name)
        return out

    def _backward(self, tensor: torch.Tensor, gradient: Optional[torch.Tensor] = None, retain_graph: Optional[bool] = None,
                  create_graph: bool = False, inputs: object = None) -> None:
        if gradient is None:
            gradient = torch.ones_like(tensor)
        keep = create_graph if retain_graph is None else retain_graph
        with self:  # back on for what the engine calls
            torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
                (tensor,), (gradient,), keep, create_graph, tuple(inputs or ()), True, True)


def _is_cpu(a: object) -> bool:
    return (isinstance(a, torch.device) and a.type == "cpu") or (isinstance(a, str) and a.startswith("cpu"))


def _reads_values(name: str, args: tuple, kwargs: dict, target: Optional[torch.Tensor]) -> bool:
    """The calls whose host read depends on their arguments."""
    if name == "repeat_interleave":
        return "output_size" not in kwargs
    if name == "to":
        return target is not None and target.device.type != "cpu" and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device")))
    if name in ("__getitem__", "__setitem__", "index_put_", "index"):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    if name == "where":
        return len(args) + len(kwargs) == 1  # where(condition): nonzero
    return False


def cases(device: torch.device = CUDA) -> List[Tuple[str, Callable[[], Step], bool]]:
    """(name, step factory, deterministic) on `device`; nothing touches it until a factory is called."""
    out: List[Tuple[str, Callable[[], Step], bool]] = []
    # Every abp.nn module, the sampled layer among them: its output and input gradient are exact
    # (only its weight gradient is drawn), so a replay of any of them equals eager.
    for name, mine, _, _ in host_overhead.pairs():
        out.append((name, lambda m=mine: _module_step(m().to(device)), True))

    def block() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.LayerNorm(COLS), torch.nn.Linear(COLS, 4 * COLS), torch.nn.GELU(),
                                   torch.nn.Linear(4 * COLS, COLS)).to(device)

    def converted(recipe: str) -> Step:
        example = (torch.randn(ROWS, COLS, device=device),)
        return _module_step(abp.convert(block(), recipe=recipe, example_inputs=example)[0])

    for recipe, det in (("lowmembp", True), ("sampled", False), ("all", False)):
        out.append((f"recipe {recipe}", lambda r=recipe: converted(r), det))
    out.append(("compress_saved(bits=4)", lambda: _module_step(block(), lambda: abp.compress_saved(bits=4)), False))

    def controlled() -> Step:
        model = block()
        controller = abp.CompressionController(model, avg_bits=2, interval=100, min_numel=1)
        return _module_step(model, lambda: controller)
    out.append(("CompressionController(avg_bits=2)", controlled, False))
    return out


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}" if str(e).strip() else type(e).__name__


def probe(name: str, make: Callable[[], Step], deterministic: bool) -> Dict[str, object]:
    row: Dict[str, object] = {"op": name}
    torch.manual_seed(0)
    x = torch.randn(ROWS, COLS, device=CUDA, requires_grad=True)
    try:
        step = make()
        for _ in range(3):  # compiles, warms the caches and any lazily made state
            x.grad = None
            step(x)
        torch.cuda.synchronize()
        x.grad = None
        eager_y = step(x).clone()
        eager_dx = x.grad.clone()
    except Exception as e:  # noqa: BLE001 - a probe reports every failure
        row.update(sync_free=None, captured=None, error=_first_line(e))
        return row
    torch.cuda.set_sync_debug_mode("error")
    try:
        x.grad = None
        with HostReads() as reads:
            step(x)
        row["sync_free"] = True
        row["host_reads"] = reads.reads
    except Exception as e:  # noqa: BLE001
        row["sync_free"] = False
        row["sync"] = _first_line(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                x.grad = None
                step(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        x.grad = None
        with torch.cuda.graph(graph):
            y = step(x)
        graph.replay()
        torch.cuda.synchronize()
        row["captured"] = True
        if deterministic:
            row["replay_equals_eager"] = bool(torch.equal(y, eager_y) and torch.equal(x.grad, eager_dx))
    except Exception as e:  # noqa: BLE001
        row["captured"] = False
        row["capture_error"] = _first_line(e)
        torch.cuda.synchronize()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("capture_probe: needs torch with CUDA and a GPU")
    rows = [probe(*c) for c in cases()]
    for r in rows:
        print(f"{r['op']:<36} sync-free {str(r.get('sync_free')):<5} captured {str(r.get('captured')):<5} "
              f"replay=eager {str(r.get('replay_equals_eager', '-')):<5} "
              f"{r.get('error') or r.get('sync') or ''} {r.get('capture_error', '')}")
    if args.json:
        args.json.write_text(json.dumps({
            "commit": commit_id(str(Path(__file__).resolve().parents[1])), "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
