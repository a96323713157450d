"""Two small real training tasks whose data ships with what scripts/test installs (no downloads).

* **digits**: scikit-learn's 1,797 8x8 handwritten digits (the CSV inside Debian's
  python3-sklearn, read with numpy: the torch 2.x venv need not import scikit-learn), as 16
  patches of 2x2 pixels, classified by a pre-LN transformer (2 blocks, d 64, 4 heads,
  torch.nn.MultiheadAttention, GELU MLP). A fixed split: 1,437 to train, 360 to test.
  **digits-vit**: the same data and size with timm's ViT, which adds a class token (a row of
  another scale than the patches' rows in every saved activation). **digits-cnn**: the same data
  as 8x8 images, classified by a plain CNN (12 Conv-BatchNorm-SiLU layers without residual paths,
  width 16, pooled into a Linear head): the layout where the 2-bit activations compound their
  derivative error. **digits-cnn-relu**: the same CNN with ReLU, whose backward reads its output
  for the sign (compression keeps that sign exactly, a bit per element). **digits-cnn-hardswish**:
  the same CNN with Hardswish (MobileNetV3's activation), which convert gives FewBit's k-bit
  derivative (`other_activations`, 3 bits by default).
* **charlm**: a byte-level language model of the Python standard library's own source (the
  interpreter's ``*.py`` files in sorted order; the first 600 kB to train, the next 60 kB to
  validate), with a LLaMA-style model (2 blocks, d 64, RMSNorm, rotary positions, causal
  scaled-dot-product attention, SwiGLU MLP).

`train(task, setting, seed, ...)` trains one model and returns its final metrics, the saved
activation bytes of a step (as stored), the mean step time, the gradient norm trace and, with
`eval_every`, the metric's curve. A setting is a name (`SETTINGS`: exact training or a way to
compress what autograd saves; `RECIPES`: abp's other recipes), a `Recipe` (an `abp.convert`
recipe and/or a context around each step), or a callable giving the model a context factory.
bench/bench_compressed_training.py runs the compression comparison, examples/parity_demo.py
every recipe against exact training; tests/python/test_compressed_training.py a CI-sized one.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import math
import platform
import statistics
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import abp

# Debian's python3-sklearn (scripts/lib/common.sh installs it); any importable scikit-learn first.
_DEBIAN_SKLEARN = Path("/usr/lib/python3/dist-packages/sklearn")


def _sklearn_data(name: str) -> Path:
    spec = importlib.util.find_spec("sklearn")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    for root in roots + [_DEBIAN_SKLEARN]:
        path = root / "datasets" / "data" / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name}: scikit-learn's data file was not found (install python3-sklearn)")


def digits() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): x as (N, 16, 4) patches scaled to [-1, 1]."""
    with gzip.open(_sklearn_data("digits.csv.gz"), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :64]).reshape(-1, 8, 8) / 16.0
    x = (x - 0.5) / 0.5
    x = x.reshape(-1, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(-1, 16, 4)  # 2x2 patches, row-major
    y = torch.from_numpy(table[:, 64]).long()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    return x[train], y[train], x[test], y[test]


def python_source(train_bytes: int = 600_000, val_bytes: int = 60_000,
                  stdlib: Optional[Path] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The standard library's source as bytes: (train, validation), uint8 → int64 tensors: its
    *.py files in name order. The text is the running Python's unless `stdlib` names another
    directory (to train on the same text on another machine): another version gives another
    corpus (other loss levels), so `corpus_id()` names it in every result."""
    stdlib = Path(stdlib) if stdlib is not None else Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= train_bytes + val_bytes:
            break
    text = np.frombuffer(b"".join(chunks)[: train_bytes + val_bytes], dtype=np.uint8)
    if len(text) < train_bytes + val_bytes:
        raise RuntimeError(f"{stdlib}: fewer than {train_bytes + val_bytes} bytes of Python source")
    data = torch.from_numpy(text.astype(np.int64))
    return data[:train_bytes], data[train_bytes:]


def corpus_id(train: torch.Tensor, val: torch.Tensor, stdlib: Optional[Path] = None) -> str:
    """Which text python_source(stdlib=stdlib) gave (`train`, `val`): whose it is and its SHA-256 prefix."""
    digest = hashlib.sha256(torch.cat((train, val)).to(torch.uint8).numpy().tobytes()).hexdigest()
    return f"{stdlib or f'python {platform.python_version()} stdlib'}, sha256 {digest[:12]}"


# ---------------------------------------------------------------------------------------------
# Models.


class PatchTransformer(nn.Module):
    """A pre-LN ViT-style classifier of digit patches; `p` > 0 adds dropout (attention, its
    output and the MLP's), which on torch 2 also moves attention off the fused CPU kernel."""

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, p: float = 0.0) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
            self.drop1 = nn.Dropout(p) if p else nn.Identity()
            self.ln2 = nn.LayerNorm(d)
            mlp = [nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)]
            self.mlp = nn.Sequential(*mlp, nn.Dropout(p)) if p else nn.Sequential(*mlp)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.drop1(self.attn(h, h, h, need_weights=False)[0])
            return x + self.mlp(self.ln2(x))

    def __init__(self, d: int = 64, heads: int = 4, blocks: int = 2, p: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.02)
        self.blocks = nn.ModuleList([self.Block(d, heads, p) for _ in range(blocks)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).mean(dim=1))


class TimmViT(nn.Module):
    """timm's ViT (its patch embedding, class token, attention and MLP) on the digit patches, the
    same size as PatchTransformer: a model users train, and one with a row unlike the others (the
    class token's) in every activation it saves. Needs timm."""

    def __init__(self, d: int = 64, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        import timm  # the torch 2.x lane has it; the 1.13 lane does not run this task

        self.vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=2, in_chans=1,
                                     embed_dim=d, depth=blocks, num_heads=heads, num_classes=10)
        self.Block = type(self.vit.blocks[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (N, 16, 4) row-major 2x2 patches back to (N, 1, 8, 8) images (digits' reshape, inverted).
        images = x.reshape(-1, 4, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(-1, 1, 8, 8)
        return self.vit(images)


class ConvLayer(nn.Sequential):
    """Conv 3x3 - BatchNorm - activation (SiLU, or `act`), a CNN's layer."""

    def __init__(self, cin: int, cout: int, act: Callable[[], nn.Module] = nn.SiLU) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), act())


class DigitsCNN(nn.Module):
    """A plain CNN on the digits as 8x8 images: `depth` ConvLayers in a chain (no residual path,
    as in EfficientNet's and MobileNet's stems), global average pooling, a Linear head."""

    def __init__(self, width: int = 16, depth: int = 12, act: Callable[[], nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.body = nn.Sequential(*[ConvLayer(1 if i == 0 else width, width, act) for i in range(depth)])
        self.head = nn.Linear(width, 10)
        self.Block = ConvLayer
        #: What recipe "sampled" samples: the head (the only Linear; no layer stands where abp._roles
        #: looks, in attention-output or feed-forward position).
        self.SAMPLED = ("head",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = x.reshape(-1, 4, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(-1, 1, 8, 8)  # as TimmViT
        return self.head(self.body(images).mean((2, 3)))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2: the fused kernels
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    n = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class TinyLlama(nn.Module):
    """A LLaMA-style byte-level language model."""

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.attn_norm = RMSNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.mlp_norm = RMSNorm(d)
            self.gate, self.up = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 3 * d, bias=False)
            self.down = nn.Linear(3 * d, d, bias=False)
            self.act = nn.SiLU()

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, n, d = x.shape
            h = self.attn_norm(x)
            q, k, v = (p(h).view(b, n, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = _causal_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
            x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
            h = self.mlp_norm(x)
            return x + self.down(self.act(self.gate(h)) * self.up(h))

    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, blocks: int = 2, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([self.Block(d, heads) for _ in range(blocks)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(context).float(), freq)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, self.cos[:n], self.sin[:n])
        return self.head(self.norm(h))


# ---------------------------------------------------------------------------------------------
# Settings: how a model trains (what happens to the saved activations and the backward pass).

#: compress_saved and the controller, by name: exact, compress_saved at a width, or the adaptive
#: controller at an average width. A suffix turns a mechanism off to show what it prevents:
#: "-no-rules" (compress_saved's op rules), "-no-recompute" (recomputing what cheap ops derive
#: from stored tensors, fused attention's output and logsumexp included).
#: The digits tasks' models.
_DIGITS_MODELS: Dict[str, Callable[[], nn.Module]] = {
    "digits": PatchTransformer, "digits-vit": TimmViT, "digits-cnn": DigitsCNN,
    "digits-cnn-relu": functools.partial(DigitsCNN, act=nn.ReLU),
    "digits-cnn-hardswish": functools.partial(DigitsCNN, act=nn.Hardswish),
}

#: Every task `train` knows.
TASKS: Tuple[str, ...] = (*_DIGITS_MODELS, "charlm")

SETTINGS = ("exact", "compress-8", "compress-4", "compress-2", "compress-4-no-recompute", "compress-2-no-recompute",
            "controller-4", "controller-2", "controller-2-no-recompute")


@dataclasses.dataclass
class Task:
    """What a setting may use of the task being trained: its name, the model's block class, a
    batch's loss under the model, fresh training batches drawn apart from the training order
    (their own generator, so a setting that draws some leaves the training data as it was), and a
    small input of held-out data: abp.convert's example call (it finds the sampled layers by role
    and counts what each replacement saves)."""

    name: str
    block_type: type
    loss: Callable[[Any], torch.Tensor]
    draw: Callable[[], Any]
    example: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A way to train. `convert`: abp.convert's recipe and its options ({"recipe": ..., ...}),
    applied in place before the optimizer is built, with the task's example call (recipe "sampled"'s
    ``layers=`` is the model's SAMPLED where it names them, else found by role); `context`: given
    the model and the Task, a factory of the context manager
    that wraps each step's forward and backward (its time counts in the step time). Either, both
    or neither (exact training). A factory may have ``before_step()``, run before each step's
    context (timed, but outside the saved-bytes count: VCAS's calibration), and ``summary()``,
    whose result train adds to its own."""

    name: str
    label: str
    convert: Optional[Mapping[str, Any]] = None
    context: Optional[Callable[[nn.Module, Task], Callable[[], Any]]] = None


#: A setting: a name of SETTINGS or RECIPES (or "compress-<bits>", "controller-<avg bits>",
#: "sampled-<keep>"), a Recipe, or a callable giving the model a context factory for each step.
Setting = Union[str, Recipe, Callable[[nn.Module], Callable[[], Any]]]


def _vcas(model: nn.Module, task: Task) -> Callable[[], Any]:
    """VCAS (abp.vcas.Controller with its default variance budgets, calibrated on 2 fresh batches
    every 20 steps instead of 100: the default would calibrate 3 times in digits' 276 steps, and
    sampling starts only after calibrations lower the ratios from 1)."""
    controller = abp.vcas.Controller(model, task.block_type, cal_var_freq=20)

    def calibrate() -> None:
        if controller.due():
            controller.calibrate(task.loss, [task.draw() for _ in range(controller.cal_var_m)])

    @contextlib.contextmanager
    def step() -> Any:
        yield
        controller.step()

    def summary() -> Dict[str, Any]:
        return {"activation_ratios": controller.activation_ratios, "flops_ratio": controller.flops_ratio(),
                "weight_ratio_mean": statistics.mean(controller.weight_ratios.values())}

    step.before_step = calibrate  # type: ignore[attr-defined]
    step.summary = summary  # type: ignore[attr-defined]
    return step


def _controller(avg: float, recompute: bool) -> Callable[[nn.Module, Task], Callable[[], Any]]:
    def context(model: nn.Module, task: Task) -> Callable[[], Any]:
        # Without recompute a 2-bit budget is met only with 1-bit codes (fused attention's query
        # and key take 8 bits): what CompressionController refuses without allow_low_bits.
        low = avg < 2 or (avg < 4 and not recompute)
        controller = abp.CompressionController(model, avg_bits=avg, interval=100, allow_low_bits=low,
                                               min_bits=1 if low else 2, recompute=recompute)

        def step() -> Any:
            return controller

        def summary() -> Dict[str, Any]:
            widths = collections.Counter(controller.bits.values())
            return {"average_bits": controller.average_bits(), "tensors_per_width": dict(sorted(widths.items()))}

        step.summary = summary  # type: ignore[attr-defined]
        return step
    return context


def _compress(bits: int, rules: bool, recompute: bool) -> Callable[[nn.Module, Task], Callable[[], Any]]:
    return lambda model, task: lambda: abp.compress_saved(bits=bits, op_rules=rules, allow_low_bits=True,
                                                          recompute=recompute)


#: abp's recipes beside SETTINGS, by name.
RECIPES: Dict[str, Recipe] = {r.name: r for r in (
    Recipe("lowmembp", "convert lowmembp (MS norms, ReGELU2 / ReSiLU2; 3-bit FewBit in CNN layers)", {"recipe": "lowmembp"}),
    Recipe("lowmembp-2bit", "convert lowmembp with the 2-bit ReGELU2 / ReSiLU2 everywhere",
           {"recipe": "lowmembp", "gelu": "regelu2", "silu": "resilu2"}),
    Recipe("fewbit-3", "FewBit 3-bit GELU / SiLU (norms exact)",
           {"recipe": "lowmembp", "norms": False, "gelu": "gelu_b3", "silu": "silu_b3"}),
    Recipe("sampled-0.3", "WTA-CRS keep 0.3 (convert sampled)", {"recipe": "sampled", "keep": 0.3}),
    Recipe("vcas", "VCAS (abp.vcas.Controller, calibrated every 20 steps)", context=_vcas),
    Recipe("all", "convert all (lowmembp + sampled 0.3 + compress 8 bits, each kept where it saves)", {"recipe": "all"}),
)}


def recipe(setting: Union[str, Recipe]) -> Recipe:
    """The Recipe a setting's name stands for."""
    if isinstance(setting, Recipe):
        return setting
    if setting in RECIPES:
        return RECIPES[setting]
    try:
        kind, _, rest = setting.partition("-")
        if setting == "exact":
            return Recipe("exact", "exact")
        number, _, flags = rest.partition("-")
        off = {flag for flag in ("no-rules", "no-recompute") if f"-{flag}" in f"-{flags}"}
        if flags and f"-{flags}" != "".join(f"-{flag}" for flag in ("no-rules", "no-recompute") if flag in off):
            raise ValueError(flags)
        options = "".join(f", {name}=False" for name, flag in (("op_rules", "no-rules"), ("recompute", "no-recompute"))
                          if flag in off)
        if kind == "controller" and "no-rules" not in off:
            avg = float(number)
            return Recipe(setting, f"CompressionController(avg_bits={avg:g}{options})",
                          context=_controller(avg, "no-recompute" not in off))
        if kind == "compress":
            bits = int(number)
            label = f"compress_saved(bits={bits}{options})"
            return Recipe(setting, label + (" [allow_low_bits]" if bits < 4 else ""),
                          context=_compress(bits, "no-rules" not in off, "no-recompute" not in off))
        if kind == "sampled":
            return Recipe(setting, f"WTA-CRS keep {float(rest):g} (convert sampled)", {"recipe": "sampled", "keep": float(rest)})
    except ValueError:
        pass
    raise ValueError(f"setting: expected one of {', '.join(SETTINGS + tuple(RECIPES))} (or compress-<bits>, "
                     f"controller-<avg bits>, sampled-<keep>), got {setting!r}")


def _prepare(setting: Setting, model: nn.Module, task: Task) -> Tuple[str, Callable[[], Any]]:
    """Converts `model` in place as the setting says; returns its name and its step context factory."""
    if callable(setting) and not isinstance(setting, Recipe):
        return "custom", setting(model)
    r = recipe(setting)
    if r.convert is not None:
        options = dict(r.convert)
        name = options.pop("recipe")
        if ("sampled" in ([name] if isinstance(name, str) else name) or name == "all") and hasattr(model, "SAMPLED"):
            options.setdefault("layers", model.SAMPLED)
        options.setdefault("example_inputs", task.example)
        _, changes = abp.convert(model, name, inplace=True, **options)
        # A CNN's channel norms are refused by design (lowmembp replaces LayerNorm and RMSNorm only).
        refused = [c for c in changes if c.action == "refused" and not isinstance(
            model.get_submodule(c.module), (nn.modules.batchnorm._NormBase, nn.GroupNorm))]
        if refused or not changes:
            raise RuntimeError(f"{r.name}: convert refused {refused or 'everything'}")
    return r.name, r.context(model, task) if r.context is not None else contextlib.nullcontext


def _grad_norm(model: nn.Module) -> float:
    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.norm(torch.stack(norms)))


def train(task: str, setting: Setting, seed: int, *, steps: Optional[int] = None, log_every: int = 10,
          eval_every: Optional[int] = None, device: Union[str, torch.device] = "cpu",
          stdlib: Optional[Path] = None) -> Dict[str, Any]:
    """Trains `task` (one of TASKS: "digits", "digits-vit", the digits CNNs, "charlm") under `setting`
    (a name of SETTINGS or RECIPES, a Recipe, or a callable giving the model a context factory for each step) from `seed`; returns
    its metrics. With `eval_every`, result["curve"] holds [steps done, metric] at 0, every
    `eval_every` steps and at the end (evaluation draws no random numbers: the run is unchanged).

    digits: AdamW lr 1e-3, batch 64, `steps` (default 12 epochs = 276 steps); metric test accuracy.
    digits-vit, digits-cnn(-relu, -hardswish): the same with timm's ViT (TimmViT) or a plain CNN
    (DigitsCNN, with SiLU, ReLU or Hardswish) instead of PatchTransformer.
    charlm: AdamW lr 3e-3, batch 32 of 64 bytes, `steps` (default 600); metric validation loss
    (nats per byte) over 64 fixed windows.

    `stdlib`: charlm's corpus directory (python_source). `device` holds the model and the data;
    batches are drawn on the CPU (the same batches on any device), and a CUDA step's time is
    taken after the device has finished it.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(1000 + seed)  # batches
    extra = torch.Generator().manual_seed(2000 + seed)  # batches a setting draws (Task.draw)
    if task in _DIGITS_MODELS:
        xtr, ytr, xte, yte = (t.to(device) for t in digits())
        model: nn.Module = _DIGITS_MODELS[task]().to(device)
        lr, batch, total = 1e-3, 64, steps if steps is not None else 276

        def batches() -> Any:
            while True:
                order = torch.randperm(len(ytr), generator=gen)
                for i in range(0, len(ytr) - batch + 1, batch):
                    idx = order[i:i + batch].to(device)
                    yield xtr[idx], ytr[idx]

        def draw() -> Any:
            idx = torch.randperm(len(ytr), generator=extra)[:batch].to(device)
            return xtr[idx], ytr[idx]

        def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out, y)

        def evaluate() -> Dict[str, float]:
            with torch.no_grad():
                return {"test_accuracy": float((model(xte).argmax(1) == yte).float().mean())}
    elif task == "charlm":
        text = python_source(stdlib=stdlib)
        corpus = corpus_id(*text, stdlib)
        train_text, val_text = (t.to(device) for t in text)
        context, batch = 64, 32
        model = TinyLlama(context=context).to(device)
        lr, total = 3e-3, steps if steps is not None else 600

        def windows(g: torch.Generator) -> Any:
            starts = torch.randint(0, len(train_text) - context - 1, (batch,), generator=g)
            window = torch.stack([train_text[s:s + context + 1] for s in starts.tolist()])
            return window[:, :-1], window[:, 1:]

        def batches() -> Any:
            while True:
                yield windows(gen)

        def draw() -> Any:
            return windows(extra)

        def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        starts = torch.linspace(0, len(val_text) - context - 2, 64).long().tolist()
        val = torch.stack([val_text[s:s + context + 1] for s in starts])

        def evaluate() -> Dict[str, float]:
            with torch.no_grad():
                return {"val_loss": float(loss_of(model(val[:, :-1]), val[:, 1:]))}
    else:
        raise ValueError(f"task: expected one of {', '.join(map(repr, TASKS))}, got {task!r}")

    example = xte[:8] if task != "charlm" else val[:4, :-1]
    spec = Task(task, model.Block, lambda b: loss_of(model(b[0]), b[1]), draw, example)
    name, context_of = _prepare(setting, model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = batches()
    curve: List[List[float]] = []

    def evaluate_at(done: int) -> None:
        if eval_every and (done % eval_every == 0 or done == total):
            model.eval()
            curve.append([done, *evaluate().values()])
            model.train()

    model.train()
    evaluate_at(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", abp.DivergenceWarning)
        losses, trace, seconds, saved_bytes = _loop(model, opt, data, loss_of, context_of, total, log_every, evaluate_at)
    alarms = [str(w.message) for w in caught if issubclass(w.category, abp.DivergenceWarning)]
    model.eval()
    result: Dict[str, Any] = {"task": task, "setting": name, "seed": seed, "steps": total}
    if task == "charlm":
        result["corpus"] = corpus
    result.update(evaluate())
    tail = losses[-max(1, total // 10):]
    result["train_loss_tail"] = sum(tail) / len(tail)
    result["saved_bytes"] = saved_bytes
    result["step_ms"] = 1000 * seconds / total
    result["grad_norm_trace"] = trace
    result["grad_norm_max"] = max(g for _, g in trace)
    result["divergence_warning"] = alarms[0] if alarms else None
    if eval_every:
        result["curve"] = curve
    if hasattr(context_of, "summary"):
        result["setting_summary"] = context_of.summary()
    return result


def _loop(model: nn.Module, opt: torch.optim.Optimizer, data: Any, loss_of: Callable[..., torch.Tensor],
          context_of: Callable[[], Any], total: int, log_every: int,
          after_step: Callable[[int], None] = lambda done: None) -> Tuple[List[float], List[List[float]], float, int]:
    """The training steps: (losses, gradient-norm trace, seconds in the step context (forward and
    backward) and the context factory's before_step, saved bytes of the last step: what its
    context saw saved, so a controller's estimate on that step would count too; interval=100
    never falls on the default runs' last step). `after_step(steps done)` runs after each
    optimizer step, outside the timed part."""
    trace: List[List[float]] = []
    seconds = 0.0
    saved_bytes = 0
    losses: List[float] = []
    before_step = getattr(context_of, "before_step", None)
    for step in range(total):
        x, y = next(data)
        last = step == total - 1
        # The last step counts what autograd keeps (abp.memory's accounting: compressed codes
        # as stored, each storage once, parameters and buffers left out).
        counter = abp.memory.SavedTensorsCounter() if last else contextlib.nullcontext()
        start = time.perf_counter()
        if before_step is not None:
            before_step()
        with counter, context_of():
            loss = loss_of(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        if loss.is_cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        if step % log_every == 0 or last:
            trace.append([step, _grad_norm(model)])
        if last:
            saved_bytes = counter.activation_bytes(model)
        opt.step()
        losses.append(float(loss.detach()))
        after_step(step + 1)
    return losses, trace, seconds, saved_bytes
