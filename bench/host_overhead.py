"""Per-call host overhead of every abp module against the torch module it replaces (#16).

Each pair runs forward plus backward on a tiny CPU tensor (so the kernels cost next to nothing
and what is timed is the host path: argument checks, marshalling, allocation, autograd),
interleaved in one process: rounds alternate abp and torch, each round times a batch of calls
in the thread's CPU time (time.thread_time: a shared or virtual machine's stolen time is not
counted), and the best rounds are compared (the least disturbed: the rounds' spread is noise,
not cost). The ratio is abp's time over torch's; the issue's target is at most 1.5. A recipe
row times one step of a small converted block against the original.

    python bench/host_overhead.py                 # the table
    python bench/host_overhead.py --json out.json --rounds 5 --calls 20   # CI's smoke size
    python bench/host_overhead.py --device cuda --profile "SampledLinear (wtacrs)"  # where abp's time goes

Numbers vary with the machine and its load; only the ratios, measured side by side in one run,
mean anything.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

import abp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import commit_id  # noqa: E402

ROWS, COLS = 4, 32  # tiny: the host path dominates
# Rows of the sampled layer's input and of the recipe blocks' batch: enough that WTA-CRS at keep 0.3
# keeps fewer rows than there are (19 of 64; of 4 rows it keeps all, and backward is the exact
# product with no plan made) and that compress_saved's min_numel (1024 elements) lets it code the
# block's activations (4x32 inputs are all kept as they are). Still small: the host path dominates.
ROWS_SAMPLED = 64
DEVICE = torch.device("cpu")  # --device cuda: the same rows on GPU tensors (host time of async launches)


#: (name, abp module factory, torch module factory, rows of the input both are timed on).
Pair = Tuple[str, Callable[[], torch.nn.Module], Callable[[], torch.nn.Module], int]


def _norms() -> List[Pair]:
    pairs: List[Pair] = [
        ("MSLayerNorm", lambda: abp.nn.MSLayerNorm(COLS), lambda: torch.nn.LayerNorm(COLS, elementwise_affine=False),
         ROWS),
        ("MSLayerNorm (affine)", lambda: _affine(abp.nn.MSLayerNorm(COLS, elementwise_affine=True)),
         lambda: _affine(torch.nn.LayerNorm(COLS)), ROWS)]
    if hasattr(torch.nn, "RMSNorm"):  # torch >= 2.4
        pairs.append(("MSRMSNorm", lambda: abp.nn.MSRMSNorm(COLS),
                      lambda: torch.nn.RMSNorm(COLS, eps=1e-6, elementwise_affine=False), ROWS))
        pairs.append(("MSRMSNorm (affine)", lambda: _affine(abp.nn.MSRMSNorm(COLS, elementwise_affine=True)),
                      lambda: _affine(torch.nn.RMSNorm(COLS, eps=1e-6)), ROWS))
    return pairs


def _linears() -> List[Pair]:
    """The sampled linear layer (WTA-CRS, keep 0.3) against the Linear it replaces, on an input of
    ROWS_SAMPLED rows, so that backward estimates dW from a plan of 19 rows."""
    return [("SampledLinear (wtacrs)", lambda: abp.nn.SampledLinear.from_linear(_linear()), _linear, ROWS_SAMPLED)]


def _linear() -> torch.nn.Linear:
    """A Linear with the same weight and bias each time, so both sides compute the same forward."""
    linear = torch.nn.Linear(COLS, COLS)
    with torch.no_grad():
        linear.weight.copy_(torch.linspace(-0.5, 0.5, COLS * COLS).reshape(COLS, COLS))
        linear.bias.copy_(torch.linspace(-0.25, 0.25, COLS))
    return linear


def _affine(norm: torch.nn.Module) -> torch.nn.Module:
    """The norm with the same non-trivial gamma and beta on both sides (as a trained model has)."""
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, COLS))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(torch.linspace(-0.25, 0.25, COLS))
    return norm


def pairs() -> List[Pair]:
    """(name, abp module factory, torch module factory, input rows) for every module of abp.nn with
    a torch counterpart: the activations (same name in torch.nn; ReGELU2 and ReSiLU2 replace GELU
    and SiLU), the memory-sharing norms and the sampled linear layer."""
    special = {"ReGELU2": torch.nn.GELU, "ReSiLU2": torch.nn.SiLU}
    out = []
    for name in abp.nn.__all__:
        mine = getattr(abp.nn, name)
        if not (isinstance(mine, type) and issubclass(mine, abp.nn.AbpActivation)):
            continue
        theirs = special.get(name) or getattr(torch.nn, name)
        args: Tuple[float, ...] = (0.5, 0.0) if name == "Threshold" else ()
        out.append((name, (lambda m=mine, a=args: m(*a)), (lambda t=theirs, a=args: t(*a)), ROWS))
    return out + _norms() + _linears()


def _step(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x.grad = None
        module(x).backward(g)
    return run


def _recipe_block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(COLS), torch.nn.Linear(COLS, 4 * COLS), torch.nn.GELU(),
                               torch.nn.Linear(4 * COLS, COLS)).to(DEVICE)


def recipes() -> List[Tuple[str, Callable[[], Callable[[], None]], Callable[[], Callable[[], None]]]]:
    """(name, abp step factory, exact step factory): one forward and backward of a small
    LayerNorm-Linear-GELU-Linear block, converted by a recipe (or under compress_saved) against
    the original, on a batch of ROWS_SAMPLED rows (where the sampled layers plan and compress_saved
    codes)."""
    x = torch.randn(ROWS_SAMPLED, COLS, device=DEVICE)

    # Gradients are dropped before each step, as an optimizer step would: accumulated without
    # end, they would grow like a diverging run's (and compress_saved's guard would say so).
    def exact() -> Callable[[], None]:
        block = _recipe_block()

        def run() -> None:
            block.zero_grad(set_to_none=True)
            block(x).sum().backward()
        return run

    def converted(recipe: str) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            block, _ = abp.convert(_recipe_block(), recipe=recipe, example_inputs=(x,))

            def run() -> None:
                block.zero_grad(set_to_none=True)
                block(x).sum().backward()
            return run
        return make

    def compressed() -> Callable[[], None]:
        block = _recipe_block()

        def run() -> None:
            block.zero_grad(set_to_none=True)
            with abp.compress_saved(bits=4):
                loss = block(x).sum()
            loss.backward()
        return run

    return [("recipe lowmembp", converted("lowmembp"), exact),
            ("recipe sampled", converted("sampled"), exact),
            ("recipe all", converted("all"), exact),
            ("compress_saved(bits=4)", compressed, exact)]


def floor() -> Callable[[], torch.nn.Module]:
    """A module computing what abp.nn.SiLU computes with the least host work Python allows: an
    autograd.Function whose forward allocates the output and the 3-bit codes and launches
    silu_b3's kernel through the compiled launcher, and whose backward does the same for the
    gradient; no checks, no manifest, no bookkeeping. Its row ("launch floor") is what any path
    through a Python autograd.Function costs at the least, next to torch's SiLU."""
    from abp import _launch, _lib

    op = _lib.kernel_library().operator("silu_b3")
    forward_kernel = _launch.binding(op, False, torch.float32).address
    backward_kernel = _launch.binding(op, True, torch.float32).address
    launch = _lib.launcher()

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            n = x.numel()
            y, codes = torch.empty_like(x), torch.empty((3 * n + 7) // 8, dtype=torch.uint8)
            launch(forward_kernel, -1, n, None, x, y, codes, n)
            ctx.save_for_backward(codes)
            return y

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            (codes,) = ctx.saved_tensors
            g = g.contiguous()
            dx = torch.empty_like(g)
            launch(backward_kernel, -1, g.numel(), None, codes, g, dx, g.numel())
            return dx

    class FloorSiLU(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Floor.apply(x)

    return FloorSiLU


def _time(run: Callable[[], None], calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        run()
    return (time.thread_time() - t0) / calls


def side_by_side(mine: Callable[[], None], theirs: Callable[[], None], rounds: int, calls: int) -> Tuple[float, float]:
    """Seconds per call of each in its best round, alternating rounds (after one warm-up round each)."""
    _time(mine, calls), _time(theirs, calls)
    a, b = [], []
    for _ in range(rounds):
        a.append(_time(mine, calls))
        b.append(_time(theirs, calls))
    return min(a), min(b)


def measure(rounds: int, calls: int) -> List[Dict[str, object]]:
    rows = []
    torch.manual_seed(0)
    for name, mine, theirs, rows_of_input in pairs():
        x = torch.randn(rows_of_input, COLS, device=DEVICE, requires_grad=True)
        g = torch.randn(rows_of_input, COLS, device=DEVICE)
        a, b = side_by_side(_step(mine().to(DEVICE), x, g), _step(theirs().to(DEVICE), x, g), rounds, calls)
        rows.append({"op": name, "abp_us": a * 1e6, "torch_us": b * 1e6, "ratio": a / b})
    if DEVICE.type == "cpu":  # the floor launches on the CPU path
        x = torch.randn(ROWS, COLS, requires_grad=True)
        g = torch.randn(ROWS, COLS)
        a, b = side_by_side(_step(floor()(), x, g), _step(torch.nn.SiLU(), x, g), rounds, calls)
        rows.append({"op": "launch floor (SiLU)", "abp_us": a * 1e6, "torch_us": b * 1e6, "ratio": a / b})
    for name, mine_step, theirs_step in recipes():
        a, b = side_by_side(mine_step(), theirs_step(), rounds, calls)
        rows.append({"op": name, "abp_us": a * 1e6, "torch_us": b * 1e6, "ratio": a / b})
    return rows


def abp_step(name: str) -> Callable[[], None]:
    """The abp side of the row named `name` (a module pair or a recipe), ready to call."""
    for pair_name, mine, _, rows_of_input in pairs():
        if pair_name == name:
            x = torch.randn(rows_of_input, COLS, device=DEVICE, requires_grad=True)
            return _step(mine().to(DEVICE), x, torch.randn(rows_of_input, COLS, device=DEVICE))
    for recipe_name, mine_step, _ in recipes():
        if recipe_name == name:
            return mine_step()
    known = [p[0] for p in pairs()] + [r[0] for r in recipes()]
    raise SystemExit(f"--profile: no row named {name!r}; the rows are {known}")


def profile(name: str, calls: int, top: int = 25) -> None:
    """Where the host time of one row's abp step goes: Python functions by their own time
    (cProfile), then torch's ops by their self CPU time (torch.profiler), over `calls` calls."""
    import cProfile
    import pstats

    run = abp_step(name)
    for _ in range(5):  # first calls compile, load and plan
        run()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    print(f"== {name}: Python functions by own time, {calls} calls")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    print(f"== {name}: torch ops by self CPU time, {calls} calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: host time, not kernel parallelism)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: host time of the same calls on GPU tensors")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--profile", action="append", default=[], metavar="ROW",
                        help="instead of the table, where the host time of this row's abp step goes (repeatable)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if args.profile:
        for name in args.profile:
            profile(name, args.calls)
        return
    rows = measure(args.rounds, args.calls)
    from abp import _plan_lane
    lane = _plan_lane.status()
    print(f"host overhead per call, forward + backward on {ROWS}x{COLS} {DEVICE.type.upper()} tensors "
          f"({ROWS_SAMPLED}x{COLS} for the sampled layer and the recipe blocks) "
          f"(torch {torch.__version__}, best of {args.rounds} rounds of {args.calls} calls, thread CPU time; "
          f"abp's {lane})")
    print(f"{'op':<24} {'torch us':>9} {'abp us':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['op']:<24} {r['torch_us']:>9.1f} {r['abp_us']:>9.1f} {r['ratio']:>6.2f}")
    ratios = [float(r["ratio"]) for r in rows if r["op"] != "launch floor (SiLU)"]  # the floor is a reference
    timed = [r for r in rows if r["op"] != "launch floor (SiLU)"]
    print(f"median ratio {statistics.median(ratios):.2f}, worst {max(ratios):.2f} "
          f"({timed[ratios.index(max(ratios))]['op']}); target <= 1.5")
    if args.json:
        args.json.write_text(json.dumps({
            "commit": commit_id(str(Path(__file__).resolve().parents[1])),
            "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "lane": lane, "device": DEVICE.type, "rounds": args.rounds, "calls": args.calls, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
