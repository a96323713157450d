"""``abp.convert``: rewrite a model with the LowMemoryBP recipe (ALGORITHMS.md §4, §5).

One call replaces LayerNorm / RMSNorm modules by the memory-sharing norms (whose backward reads only
their output, which the next Linear keeps anyway) and folds their affine parameters into the
Linear layers that consume them, and replaces GELU / SiLU modules by ReGELU2 / ReSiLU2 (or other
abp activations). It never silently changes the model's function:

- every norm about to be replaced is first checked numerically (a float64 probe: does the module
  compute ``gamma * norm(x) + beta``?), so a look-alike (e.g. Gemma's ``(1 + w)`` RMSNorm) is refused;
- folding needs the norm's output to feed only Linear layers, each called once, with unshared
  weights (found with torch.fx); anything else (post-LN blocks, a norm feeding a residual add or a
  slice, tied weights, an untraceable model) leaves that norm alone and says why;
- the folded weights are computed in float64: ``W' = W diag(gamma)``, ``b' = b + W beta``.

In full fine-tuning the fold is a re-parameterisation: gamma is no longer trained separately.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import nn as abp_nn

__all__ = ["Change", "convert", "RECIPES"]

#: The recipes ``convert`` knows.
RECIPES: Tuple[str, ...] = ("lowmembp",)

_DEFAULTS: Dict[str, Any] = {"norms": True, "gelu": "regelu2", "silu": "resilu2"}


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


def _check_overrides(overrides: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:
        raise TypeError(
            f"convert: unknown override(s) {', '.join(unknown)}; valid keywords are {', '.join(_DEFAULTS)}"
        )
    options = dict(_DEFAULTS, **overrides)
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
# Graph analysis (torch.fx)
# ---------------------------------------------------------------------------------------------


class _Tracer(torch.fx.Tracer):
    """Keeps recognised norms (also custom RMSNorm classes) as leaves, so their calls are visible."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _norm_of(m) is not None or super().is_leaf_module(m, module_qualified_name)


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
    if len(calls) != 1:
        return None, f"it is called {len(calls)} times in the traced graph; folding needs exactly one call"
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


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def _fold_into(model: nn.Module, linear_name: str, norm: _Norm) -> str:
    """W' = W diag(gamma), b' = b + W beta, in float64; adds a bias when beta needs one."""
    linear = model.get_submodule(linear_name)
    assert isinstance(linear, nn.Linear)
    with torch.no_grad():
        w = linear.weight.detach().to(torch.float64)
        new_w = w * norm.weight.detach().to(torch.float64, copy=False).to(w.device)[None, :] if norm.weight is not None else w
        new_b: Optional[Tensor] = linear.bias.detach().to(torch.float64) if linear.bias is not None else None
        if norm.bias is not None and bool((norm.bias != 0).any()):
            shift = w @ norm.bias.detach().to(torch.float64).to(w.device)
            new_b = shift if new_b is None else new_b + shift
        target = linear
        if new_b is not None and linear.bias is None:
            target = nn.Linear(linear.in_features, linear.out_features, bias=True,
                               device=linear.weight.device, dtype=linear.weight.dtype)
            target.weight.requires_grad_(linear.weight.requires_grad)
            target.bias.requires_grad_(linear.weight.requires_grad)
            _set_module(model, linear_name, target)
        target.weight.copy_(new_w.to(target.weight.dtype))
        if new_b is not None:
            target.bias.copy_(new_b.to(target.bias.dtype))
    added = " (bias added for beta)" if target is not linear else ""
    return f"folded gamma{' and beta' if norm.bias is not None else ''} in float64{added}"


def _ms_norm(norm: _Norm) -> nn.Module:
    return abp_nn.MSLayerNorm(norm.shape, norm.eps) if norm.kind == "layer" else abp_nn.MSRMSNorm(norm.shape, norm.eps)


def convert(model: nn.Module, recipe: str = "lowmembp", *, inplace: bool = False, **overrides: Any) -> Tuple[nn.Module, List[Change]]:
    """Applies ``recipe`` to ``model``; returns (converted model, what was changed and refused).

    Overrides: ``norms=False`` keeps every norm; ``gelu=`` / ``silu=`` choose the replacement
    activation by abp operator name (``"regelu2"`` / ``"resilu2"`` by default, ``"gelu_b3"``,
    ``"silu_b2_uniform"``, ...) or switch it off with ``None``. With ``inplace=False`` (default)
    the model is deep-copied first.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    options = _check_overrides(overrides)
    if not inplace:
        model = copy.deepcopy(model)
    changes: List[Change] = []
    modules = dict(model.named_modules())

    if options["norms"]:
        norms = {name: n for name, m in modules.items() if name and (n := _norm_of(m)) is not None}
        graph: Optional[torch.fx.Graph] = None
        trace_error = ""
        if any(n.weight is not None or n.bias is not None for n in norms.values()):
            try:
                graph = _Tracer().trace(model)
            except Exception as e:  # data-dependent control flow, unsupported ops, ...
                trace_error = f"the model could not be traced by torch.fx ({type(e).__name__}: {e})"
        owners = _parameter_owners(model)
        for name, norm in norms.items():
            module = modules[name]
            mismatch = _probe_mismatch(module, norm)
            if mismatch is not None:
                changes.append(Change(name, "refused", f"{type(module).__name__} does not compute {norm.kind}norm: {mismatch}"))
                continue
            try:
                replacement = _ms_norm(norm)
            except (TypeError, ValueError) as e:
                changes.append(Change(name, "refused", f"no memory-sharing norm for it: {e}"))
                continue
            if norm.weight is None and norm.bias is None:
                _set_module(model, name, replacement)
                changes.append(Change(name, "replaced", f"{type(module).__name__} -> {type(replacement).__name__} (no affine)"))
                continue
            if graph is None:
                changes.append(Change(name, "refused", f"its affine parameters cannot be folded: {trace_error}"))
                continue
            targets, reason = _fold_targets(graph, name, norm, modules, owners)
            if targets is None:
                changes.append(Change(name, "refused", f"its affine parameters cannot be folded: {reason}"))
                continue
            for target in targets:
                changes.append(Change(target, "folded", f"{_fold_into(model, target, norm)} from `{name}`"))
            _set_module(model, name, replacement)
            changes.append(Change(name, "replaced", f"{type(module).__name__} -> {type(replacement).__name__} (affine folded into {', '.join(targets)})"))

    for kind, cls in (("gelu", nn.GELU), ("silu", nn.SiLU)):
        op_name = options[kind]
        if op_name is None:
            continue
        for name, module in list(model.named_modules()):
            if type(module) is not cls:
                continue
            if kind == "gelu" and getattr(module, "approximate", "none") != "none":
                changes.append(Change(name, "refused", f"GELU(approximate={module.approximate!r}) differs from the erf GELU that {op_name} computes"))
                continue
            replacement = _activation_module(kind, op_name)
            _set_module(model, name, replacement)
            changes.append(Change(name, "replaced", f"{cls.__name__} -> {type(replacement).__name__} ({op_name})"))
    return model, changes
