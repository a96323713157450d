"""``abp.convert``: rewrite a model with the LowMemoryBP recipe (ALGORITHMS.md §4, §5), or make
chosen Linear layers sampled (recipe "sampled": WTA-CRS / CRS / sketches, §3, §8).

One call replaces LayerNorm / RMSNorm modules by the memory-sharing norms (whose backward reads only
their output, which the next Linear keeps anyway) and folds their affine parameters into the
Linear layers that consume them, and replaces GELU / SiLU modules by ReGELU2 / ReSiLU2 (or other
abp activations). It never silently changes the model's function:

- every norm about to be replaced is first checked numerically (a float64 probe: does the module
  compute ``gamma * norm(x) + beta``?), so a look-alike (e.g. Gemma's ``(1 + w)`` RMSNorm) is refused;
- folding needs the norm's output to feed only Linear layers, each called once, with unshared
  weights (found with torch.fx); anything else (post-LN blocks, a norm feeding a residual add or a
  slice, tied weights, an untraceable model) leaves that norm alone and says why;
- nothing is replaced or folded into that would lose behaviour: a module with hooks or
  parametrizations, a Linear subclass with its own forward, a norm whose parameters forward also
  reads directly;
- the folded weights are computed in float64: ``W' = W diag(gamma)``, ``b' = b + W beta``.

In full fine-tuning the fold is a re-parameterisation: gamma is no longer trained separately.

Recipe "sampled" replaces the plain ``nn.Linear`` modules whose qualified names match ``layers``
(fnmatch patterns; by default the attention-output and FFN projections of common transformer
families, with Q, K and V left exact as in the WTA-CRS paper) by ``abp.nn.SampledLinear`` sharing
their Parameters. Linears with their own forward, hooks or parametrizations are refused.
"""
from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import nn as abp_nn
from . import sampling

__all__ = ["Change", "convert", "RECIPES", "SAMPLED_LAYERS"]

#: The recipes ``convert`` knows.
RECIPES: Tuple[str, ...] = ("lowmembp", "sampled")

#: Recipe "sampled": the layers WTA-CRS samples (attention output and FFN; Q, K, V stay exact), by
#: the names of T5, BERT/RoBERTa, ViT (timm and HF), LLaMA-style models.
SAMPLED_LAYERS: Tuple[str, ...] = (
    "*SelfAttention.o", "*EncDecAttention.o", "*DenseReluDense.wi", "*DenseReluDense.wi_0",
    "*DenseReluDense.wi_1", "*DenseReluDense.wo",  # T5
    "*attention.output.dense", "*intermediate.dense", "*layer.*.output.dense",  # BERT, RoBERTa, HF ViT
    "*attn.proj", "*mlp.fc1", "*mlp.fc2",  # timm ViT
    "*self_attn.o_proj", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj",  # LLaMA, Mistral, Qwen
)

_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "lowmembp": {"norms": True, "gelu": "regelu2", "silu": "resilu2"},
    "sampled": {"method": "wtacrs", "keep": 0.3, "layers": SAMPLED_LAYERS},
}


@dataclass(frozen=True)
class Change:
    """One thing ``convert`` did or refused: ``action`` is "replaced", "folded" or "refused"."""

    module: str
    action: str
    detail: str


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def _activation_names(kind: str) -> Tuple[str, ...]:
    fixed = "regelu2" if kind == "gelu" else "resilu2"
    fewbit = tuple(f"{kind}_b{b}{w}" for b in (1, 2, 3, 4) for w in ("", "_uniform"))
    return (fixed,) + fewbit


def _activation_module(kind: str, name: str) -> nn.Module:
    if name == "regelu2":
        return abp_nn.ReGELU2()
    if name == "resilu2":
        return abp_nn.ReSiLU2()
    bits = int(name.split("_b")[1][0])
    weight = "uniform" if name.endswith("_uniform") else "normal"
    return abp_nn.GELU(bits=bits, weight=weight) if kind == "gelu" else abp_nn.SiLU(bits=bits, weight=weight)


def _check_overrides(recipe: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    defaults = _DEFAULTS[recipe]
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise TypeError(
            f"convert: unknown override(s) {', '.join(unknown)} for recipe {recipe!r}; valid keywords are "
            f"{', '.join(defaults)}"
        )
    options = dict(defaults, **overrides)
    if recipe == "sampled":
        sampling.check_method(options["method"])
        sampling.check_keep(options["keep"])
        layers = options["layers"]
        if isinstance(layers, str) or not isinstance(layers, Sequence) or not all(isinstance(p, str) for p in layers):
            raise TypeError(f"layers: expected a sequence of fnmatch patterns (str), got {layers!r}")
        return options
    if not isinstance(options["norms"], bool):
        raise TypeError(f"norms: expected True or False, got {options['norms']!r}")
    for kind in ("gelu", "silu"):
        value = options[kind]
        if value is None or value is False:
            options[kind] = None
            continue
        allowed = _activation_names(kind)
        if value not in allowed:
            raise ValueError(f"{kind}: expected one of {', '.join(allowed)} or None (off), got {value!r}")
    return options


# ---------------------------------------------------------------------------------------------
# Norm recognition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Norm:
    kind: str  # "layer" or "rms"
    shape: Tuple[int, ...]
    eps: float
    weight: Optional[Tensor]
    bias: Optional[Tensor]


def _norm_of(module: nn.Module) -> Optional[_Norm]:
    """What a LayerNorm / RMSNorm module claims to compute (None if it is not one).

    Parameters are read from ``_parameters``: while torch.fx traces, attribute access returns proxies.
    """
    weight = module._parameters.get("weight")
    if isinstance(module, nn.LayerNorm):
        return _Norm("layer", tuple(module.normalized_shape), float(module.eps), weight, module._parameters.get("bias"))
    rms_class = getattr(nn, "RMSNorm", None)
    if rms_class is not None and isinstance(module, rms_class):
        eps = module.eps
        if eps is None:
            eps = torch.finfo(weight.dtype if weight is not None else torch.get_default_dtype()).eps
        return _Norm("rms", tuple(module.normalized_shape), float(eps), weight, None)
    if type(module).__name__.endswith("RMSNorm"):
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        if isinstance(weight, nn.Parameter) and weight.dim() == 1 and isinstance(eps, (int, float)):
            return _Norm("rms", (weight.numel(),), float(eps), weight, None)
    return None


def _probe_mismatch(module: nn.Module, norm: _Norm) -> Optional[str]:
    """Runs a float64 copy of `module` on a random probe and compares it with gamma * norm(x) + beta."""
    probe_module = copy.deepcopy(module).to(torch.float64)
    x = torch.randn((3,) + norm.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x * 2 + 0.5
    x = x.to(next(probe_module.parameters(), torch.empty(0)).device)
    dims = tuple(range(-len(norm.shape), 0))
    if norm.kind == "layer":
        centred = x - x.mean(dims, keepdim=True)
        want = centred / torch.sqrt(centred.pow(2).mean(dims, keepdim=True) + norm.eps)
    else:
        want = x / torch.sqrt(x.pow(2).mean(dims, keepdim=True) + norm.eps)
    if norm.weight is not None:
        want = want * norm.weight.detach().to(torch.float64).reshape(norm.shape).to(x.device)
    if norm.bias is not None:
        want = want + norm.bias.detach().to(torch.float64).reshape(norm.shape).to(x.device)
    with torch.no_grad():
        try:
            got = probe_module(x)
        except Exception as e:  # a module that cannot even run in float64 is not the norm we know
            return f"running it on a float64 probe failed: {type(e).__name__}: {e}"
    if not isinstance(got, Tensor) or got.shape != want.shape:
        return "its output on a probe does not have the input's shape"
    # Modules that compute internally in float32 (LLaMA's RMSNorm) are accurate to ~1e-7.
    error = (got.to(torch.float64) - want).abs().max().item()
    scale = want.abs().max().item() + 1e-30
    if not error <= 1e-4 * scale:
        return f"probe mismatch: max |difference| {error:.3g} against gamma * {norm.kind}norm(x) + beta (scale {scale:.3g})"
    return None


# ---------------------------------------------------------------------------------------------
# Module checks: what a replacement or a fold would silently drop
# ---------------------------------------------------------------------------------------------


def _hooks_of(module: nn.Module) -> List[str]:
    """The kinds of hooks registered on `module` itself (they would not survive a replacement)."""
    kinds = [("forward pre-hooks", "_forward_pre_hooks"), ("forward hooks", "_forward_hooks"),
             ("backward hooks", "_backward_hooks"), ("backward pre-hooks", "_backward_pre_hooks")]
    return [label for label, attr in kinds if getattr(module, attr, None)]


def _norm_refusal(module: nn.Module) -> Optional[str]:
    """Why `module` must not be replaced even if it computes the norm (None if it may).

    A replacement has neither hooks nor parametrizations: dropping them would change what runs.
    """
    if parametrize.is_parametrized(module):
        return "its parameters are parametrized (torch.nn.utils.parametrize); the replacement has none"
    hooks = _hooks_of(module)
    if hooks:
        return f"it has {' and '.join(hooks)}, which the replacement would not carry"
    return None


def _linear_refusal(name: str, linear: nn.Linear) -> Optional[str]:
    """Why writing W' and b' into `linear` would not fold the norm into what it computes (None if it would).

    Folding writes ``linear.weight`` / ``linear.bias``; that is only the function ``F.linear(x, W', b')``
    if the module runs nn.Linear's forward on its input, and those parameters are what it multiplies by.
    """
    if parametrize.is_parametrized(linear):
        return f"Linear `{name}` has parametrized weights (torch.nn.utils.parametrize): its weight is computed, not stored"
    if type(linear).forward is not nn.Linear.forward or "forward" in vars(linear):
        return f"Linear `{name}` ({type(linear).__name__}) has its own forward; its weight alone may not be what it applies"
    if linear._forward_pre_hooks:
        return f"Linear `{name}` has forward pre-hooks (e.g. weight_norm), which may recompute its weight or change its input"
    for attr in ("weight", "bias"):
        if attr not in linear._parameters and getattr(linear, attr, None) is not None:
            return f"Linear `{name}` {attr} is not a Parameter of its own (a computed or registered-elsewhere tensor)"
    return None


# ---------------------------------------------------------------------------------------------
# Graph analysis (torch.fx)
# ---------------------------------------------------------------------------------------------


class _Tracer(torch.fx.Tracer):
    """Keeps recognised norms (also custom RMSNorm classes) and every Linear, subclasses included, as
    leaves: the fold is decided on module calls, and a Linear subclass must be seen as one to be judged."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, nn.Linear) or _norm_of(m) is not None or super().is_leaf_module(m, module_qualified_name)


def _describe_user(node: torch.fx.Node, modules: Dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"module `{node.target}` ({type(modules[str(node.target)]).__name__})"
    if node.op == "call_function":
        return f"`{getattr(node.target, '__name__', str(node.target))}` (call_function)"
    if node.op == "call_method":
        return f"`.{node.target}()` (call_method)"
    return f"the graph {node.op}"


def _reads_only_metadata(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getattr":
        return len(node.args) == 2 and node.args[1] in ("shape", "dtype", "device", "ndim")
    return node.op == "call_method" and node.target in ("size", "dim")


def _leaf_ancestor(graph: torch.fx.Graph, name: str) -> Optional[str]:
    """The module called as one opaque torch.fx leaf that contains submodule `name`, if any."""
    for node in graph.nodes:
        if node.op == "call_module" and name.startswith(f"{node.target}."):
            return str(node.target)
    return None


def _parameter_owners(model: nn.Module) -> Dict[int, List[str]]:
    """id(parameter) -> every qualified name it is registered under (shared weights have several)."""
    owners: Dict[int, List[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{prefix}.{name}" if prefix else name)
    return owners


def _fold_targets(
    graph: torch.fx.Graph, name: str, norm: _Norm, modules: Dict[str, nn.Module], owners: Dict[int, List[str]]
) -> Tuple[Optional[List[str]], str]:
    """The Linear layers to fold norm `name` into, or None and the reason it cannot be folded."""
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == name]
    if not calls:
        leaf = _leaf_ancestor(graph, name)
        if leaf is not None:
            return None, (f"it runs inside `{leaf}` ({type(modules[leaf]).__name__}), which torch.fx keeps as one "
                          "opaque call, so its consumers cannot be seen")
        return None, "it is not called in the traced forward"
    if len(calls) != 1:
        return None, f"it is called {len(calls)} times in the traced graph; folding needs exactly one call"
    reads = [str(n.target) for n in graph.nodes if n.op == "get_attr" and str(n.target).startswith(f"{name}.")]
    if reads:
        return None, f"forward also reads `{reads[0]}` directly, which the replacement does not have"
    if len(norm.shape) != 1:
        return None, f"normalized_shape {norm.shape} spans several dimensions; a Linear consumes only the last"
    users = list(calls[0].users)
    if not users:
        return None, "its output is unused"
    targets: List[str] = []
    for user in users:
        if _reads_only_metadata(user):
            continue  # h.shape, h.size(): the fold keeps the output's shape, dtype and device
        module = modules.get(str(user.target)) if user.op == "call_module" else None
        if not isinstance(module, nn.Linear):
            return None, f"its output feeds {_describe_user(user, modules)}, not only Linear layers"
        if len(user.args) != 1 or user.kwargs or user.args[0] is not calls[0]:
            return None, f"Linear `{user.target}` takes more than the norm's output"
        linear_calls = [n for n in graph.nodes if n.op == "call_module" and n.target == user.target]
        if len(linear_calls) != 1:
            return None, f"Linear `{user.target}` is called {len(linear_calls)} times; folding would change its other calls"
        refusal = _linear_refusal(str(user.target), module)
        if refusal is not None:
            return None, refusal
        if module.in_features != norm.shape[0]:
            return None, f"Linear `{user.target}` has in_features {module.in_features}, not {norm.shape[0]}"
        for p in (module.weight, module.bias):
            if p is not None and len(owners.get(id(p), [])) > 1:
                others = [o for o in owners[id(p)] if not o.startswith(f"{user.target}.")]
                return None, f"Linear `{user.target}` shares its parameters with {', '.join(others) or 'another module'}"
        if str(user.target) not in targets:
            targets.append(str(user.target))
    return targets, ""


# ---------------------------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------------------------


def _paths(model: nn.Module) -> Dict[int, List[str]]:
    """id(module) -> every qualified name it is registered under (a shared module has several)."""
    paths: Dict[int, List[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
    return paths


def _replace(model: nn.Module, paths: List[str], new: nn.Module) -> None:
    """Puts `new` at every path of one module, so a module registered twice is not left half-converted."""
    for name in paths:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)


def _also_at(paths: List[str]) -> str:
    return f" (also registered as {', '.join(f'`{p}`' for p in paths[1:])})" if len(paths) > 1 else ""


def _fold_into(linear: nn.Linear, norm: _Norm) -> str:
    """W' = W diag(gamma), b' = b + W beta, in float64 and cast back; adds a bias when beta needs one.

    The Linear keeps its Parameter objects (an optimizer holding them stays valid); a missing bias is
    registered on the same module, trainable like its weight.
    """
    with torch.no_grad():
        w = linear.weight.detach().to(torch.float64)
        new_w = w
        if norm.weight is not None:
            new_w = w * norm.weight.detach().to(device=w.device, dtype=torch.float64)[None, :]
        new_b: Optional[Tensor] = linear.bias.detach().to(torch.float64) if linear.bias is not None else None
        if norm.bias is not None and bool((norm.bias != 0).any()):
            shift = w @ norm.bias.detach().to(device=w.device, dtype=torch.float64)
            new_b = shift if new_b is None else new_b + shift
        added = new_b is not None and linear.bias is None
        if added:
            bias = torch.empty(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)
            linear.register_parameter("bias", nn.Parameter(bias, requires_grad=linear.weight.requires_grad))
        linear.weight.copy_(new_w.to(linear.weight.dtype))
        if new_b is not None:
            linear.bias.copy_(new_b.to(linear.bias.dtype))
    parts = "gamma and beta" if norm.bias is not None else "gamma"
    return f"folded {parts} in float64{' (bias added for beta)' if added else ''}"


def _ms_norm(norm: _Norm) -> nn.Module:
    return abp_nn.MSLayerNorm(norm.shape, norm.eps) if norm.kind == "layer" else abp_nn.MSRMSNorm(norm.shape, norm.eps)


def _trace(model: nn.Module) -> Tuple[Optional[torch.fx.Graph], str]:
    """The model's torch.fx graph (recognised norms as leaves), or None and why it failed."""
    try:
        return _Tracer().trace(model), ""
    except Exception as e:  # data-dependent control flow, unsupported ops, ...
        return None, f"the model could not be traced by torch.fx ({type(e).__name__}: {e})"


def _convert_norm(
    model: nn.Module, name: str, norm: _Norm, graph: Optional[torch.fx.Graph], trace_error: str,
    modules: Dict[str, nn.Module], owners: Dict[int, List[str]], paths: List[str],
) -> List[Change]:
    """Replaces one recognised norm (folding its affine parameters) or says why not."""
    module = modules[name]
    kind = type(module).__name__

    def refused(reason: str) -> List[Change]:
        return [Change(name, "refused", reason)]

    refusal = _norm_refusal(module)  # before the probe, which would run the module's hooks
    if refusal is not None:
        return refused(f"{kind} not replaced: {refusal}")
    mismatch = _probe_mismatch(module, norm)
    if mismatch is not None:
        return refused(f"{kind} does not compute {norm.kind}norm: {mismatch}")
    try:
        replacement = _ms_norm(norm)
    except (TypeError, ValueError) as e:
        return refused(f"no memory-sharing norm for it: {e}")
    new_kind = type(replacement).__name__
    if norm.weight is None and norm.bias is None:
        _replace(model, paths, replacement)
        return [Change(name, "replaced", f"{kind} -> {new_kind} (no affine){_also_at(paths)}")]
    if graph is None:
        return refused(f"its affine parameters cannot be folded: {trace_error}")
    targets, reason = _fold_targets(graph, name, norm, modules, owners)
    if targets is None:
        return refused(f"its affine parameters cannot be folded: {reason}")
    changes = [Change(t, "folded", f"{_fold_into(modules[t], norm)} from `{name}`") for t in targets]  # type: ignore[arg-type]
    _replace(model, paths, replacement)
    changes.append(Change(name, "replaced", f"{kind} -> {new_kind} (affine folded into {', '.join(targets)}){_also_at(paths)}"))
    return changes


def _convert_norms(model: nn.Module) -> List[Change]:
    modules = dict(model.named_modules())
    norms = {name: n for name, m in modules.items() if name and (n := _norm_of(m)) is not None}
    graph: Optional[torch.fx.Graph] = None
    trace_error = ""
    if any(n.weight is not None or n.bias is not None for n in norms.values()):
        graph, trace_error = _trace(model)
    owners = _parameter_owners(model)
    paths = _paths(model)
    changes: List[Change] = []
    for name, norm in norms.items():
        changes += _convert_norm(model, name, norm, graph, trace_error, modules, owners, paths[id(modules[name])])
    return changes


def _convert_activations(model: nn.Module, kind: str, op_name: str) -> List[Change]:
    """Replaces every ``nn.GELU`` (erf form) or ``nn.SiLU`` by the abp module for `op_name`.

    Only the exact torch classes: a subclass may compute something else.
    """
    cls = nn.GELU if kind == "gelu" else nn.SiLU
    paths = _paths(model)
    changes: List[Change] = []
    for name, module in list(model.named_modules()):
        if type(module) is not cls:
            continue
        if kind == "gelu" and getattr(module, "approximate", "none") != "none":
            changes.append(Change(name, "refused", f"GELU(approximate={module.approximate!r}) differs from the erf GELU that {op_name} computes"))
            continue
        if _hooks_of(module):
            changes.append(Change(name, "refused", f"{cls.__name__} not replaced: it has {' and '.join(_hooks_of(module))}, which the replacement would not carry"))
            continue
        replacement = _activation_module(kind, op_name)
        _replace(model, paths[id(module)], replacement)
        changes.append(Change(name, "replaced", f"{cls.__name__} -> {type(replacement).__name__} ({op_name}){_also_at(paths[id(module)])}"))
    return changes


def _convert_sampled(model: nn.Module, method: str, keep: float, layers: Sequence[str]) -> List[Change]:
    """Replaces each plain nn.Linear whose qualified name matches a pattern of `layers` by a
    SampledLinear sharing its Parameters."""
    paths = _paths(model)
    changes: List[Change] = []
    done = set()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or id(module) in done or not any(fnmatch.fnmatchcase(name, p) for p in layers):
            continue
        if isinstance(module, abp_nn.SampledLinear):
            continue
        why = _linear_refusal(name, module) or (
            f"Linear `{name}` has {' and '.join(_hooks_of(module))}, which the replacement would not carry"
            if _hooks_of(module) else None)
        if why is not None:
            changes.append(Change(name, "refused", why))
            continue
        done.add(id(module))
        replacement = abp_nn.SampledLinear.from_linear(module, method=method, keep=keep)
        _replace(model, paths[id(module)], replacement)
        changes.append(Change(name, "replaced", f"Linear -> SampledLinear (method={method!r}, keep={keep}){_also_at(paths[id(module)])}"))
    return changes


def convert(model: nn.Module, recipe: str = "lowmembp", *, inplace: bool = False, **overrides: Any) -> Tuple[nn.Module, List[Change]]:
    """Applies ``recipe`` to ``model``; returns (converted model, what was changed and refused).

    Recipe "lowmembp" overrides: ``norms=False`` keeps every norm; ``gelu=`` / ``silu=`` choose
    the replacement activation by abp operator name (``"regelu2"`` / ``"resilu2"`` by default,
    ``"gelu_b3"``, ``"silu_b2_uniform"``, ...) or switch it off with ``None``.
    Recipe "sampled" overrides: ``method=`` ("wtacrs", "crs", "uniform", "gaussian", "rademacher"),
    ``keep=`` (0.3) and ``layers=`` (fnmatch patterns of module names; SAMPLED_LAYERS by default,
    e.g. ``["*.lora_A*"]`` for the LoRA setup of the WTA-CRS paper).
    With ``inplace=False`` (default) the model is deep-copied first, so the original stays usable
    as a baseline.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected True or False, got {inplace!r}")
    options = _check_overrides(recipe, overrides)
    if not inplace:
        try:
            model = copy.deepcopy(model)
        except Exception as e:  # e.g. old-style weight_norm keeps a non-leaf weight tensor
            raise RuntimeError(f"model: could not be deep-copied ({type(e).__name__}: {e}); "
                               "pass inplace=True to convert it in place") from e
    changes: List[Change] = []
    if recipe == "sampled":
        return model, _convert_sampled(model, options["method"], options["keep"], options["layers"])
    if options["norms"]:
        changes += _convert_norms(model)
    for kind in ("gelu", "silu"):
        if options[kind] is not None:
            changes += _convert_activations(model, kind, options[kind])
    return model, changes
