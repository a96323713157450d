"""``abp.convert``: rewrite a model with abp's recipes, recognising its parts by what they compute.

Recipes (``recipe=`` one name, a list of them, or ``"all"``):

- ``"lowmembp"`` (docs/algorithms.md §4, §5): every LayerNorm / RMSNorm becomes a memory-sharing norm whose
  backward reads only its output (the storage the next layer keeps anyway) and one value per row;
  every GELU (erf or tanh form) and SiLU becomes ReGELU2 / ReSiLU2 (2-bit codes) or a FewBit k-bit
  activation (``gelu="gelu_b3"``); by default one on a path no residual add bypasses (a CNN's layers,
  where the 2-bit derivative's error compounds with depth) becomes the 3-bit FewBit form; LeakyReLU
  becomes abp's exact 1-bit LeakyReLU.
- ``"sampled"`` (§3, §8): the linear layers whose qualified names match ``layers`` (by default the
  attention-output and FFN projections) estimate dW from sampled token rows; a matched wrapper that
  is not itself a linear map (a peft LoRA layer) has its trainable linear maps sampled instead.
- ``"compress"`` (§6): ``compress_saved(bits=...)`` around the model's forward, for what is left.

Parts are found by running them, not by their class (abp._recognise): a leaf module is a GELU,
a SiLU, a LayerNorm or RMSNorm (Gemma's ``1 + w`` and fp32 upcasts included), or a linear map
(``x W^T + b`` or transformers' Conv1D ``x W + b``) if a numerical probe says so. Norms keep their
parameters (the same Parameter objects, under ``weight`` / ``bias``): the backward recovers the
normalised value from the output as ``(y - beta) / gamma`` (abp._affine_norm), so post-LN models
(BERT) convert too and a converted model's state_dict loads into the original. ``fold=True``
instead folds gamma and beta into the linear layers that alone read a norm's output (the
LowMemoryBP paper's form, a re-parameterisation); which layers read it is found by running the
model once on ``example_inputs`` / ``example_kwargs`` (abp._structure), so no model is refused
for being untraceable.

Nothing is changed that would silently change the model's function: a module with hooks or
parametrizations, a norm whose gamma has zeros, a Linear subclass with its own forward (for a
fold) is refused with the reason in the returned ``Change`` list.
"""
from __future__ import annotations

import copy
import difflib
import fnmatch
import functools
import numbers
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from . import (_compiled_saves, _composition, _custom_ops, _dataflow, _derived, _recognise, _stale_optimizer, _structure,
               autograd, compress, sampling, vcas)
from . import nn as abp_nn
from ._recognise import Activation, LinearMap, Norm, Unknown
from ._roles import idle_blocks as _idle_blocks, sampled_linear_maps as _roles_of

__all__ = ["Change", "CompressSavedHooks", "convert", "RECIPES", "SAMPLED_LAYERS"]

#: The recipes ``convert`` knows; ``"all"`` is all of them.
RECIPES: Tuple[str, ...] = ("lowmembp", "sampled", "compress")

#: Recipe "sampled" without a call to run (no example_inputs, no ``model.dummy_inputs``): the layers
#: WTA-CRS samples (attention output and FFN; Q, K, V stay exact), by the names of T5, BERT/RoBERTa,
#: ViT (timm and HF), GPT-2, LLaMA-style models. With a call, they are found by what they compute
#: (abp._roles), whatever their names.
SAMPLED_LAYERS: Tuple[str, ...] = (
    "*SelfAttention.o", "*EncDecAttention.o", "*DenseReluDense.wi", "*DenseReluDense.wi_0",
    "*DenseReluDense.wi_1", "*DenseReluDense.wo",  # T5
    "*attention.output.dense", "*intermediate.dense", "*layer.*.output.dense",  # BERT, RoBERTa, HF ViT
    "*attn.proj", "*mlp.fc1", "*mlp.fc2",  # timm ViT, HF ViT in transformers >= 5 (with *attention.o_proj)
    "*attn.c_proj", "*mlp.c_fc", "*mlp.c_proj",  # GPT-2 (transformers' Conv1D)
    "*self_attn.o_proj", "*mlp.gate_proj", "*mlp.up_proj", "*mlp.down_proj",  # LLaMA, Mistral, Qwen
    "*attention.o_proj",  # HF ViT in transformers >= 5
)

_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "lowmembp": {"norms": True, "fold": False, "gelu": "regelu2", "silu": "resilu2", "leaky_relu": True,
                 "other_activations": 3},
    "sampled": {"method": "wtacrs", "keep": 0.3, "layers": None},  # None: found by role (abp._roles)
    # 8 bits: the width that trains like exact on real data (docs/compressed-training.md); 4 bits
    # comes within 1 %; 1-2 bits need allow_low_bits=True.
    "compress": {"bits": 8, "group_size": 256, "allow_low_bits": False},
}


#: convert's own keywords (beside the recipes' options).
_CONVERT_KEYWORDS: Tuple[str, ...] = ("inplace", "example_inputs", "example_kwargs")


@dataclass(frozen=True)
class Change:
    """One thing ``convert`` did or refused: ``action`` is "replaced", "folded", "wrapped", "refused" or
    "kept" (replaced, then put back because the model stored more with it: abp._composition)."""

    module: str
    action: str
    detail: str


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def _activation_names(kind: str) -> Tuple[str, ...]:
    fixed = "regelu2" if kind == "gelu" else "resilu2"
    fewbit = tuple(f"{kind}_b{b}{w}" for b in (1, 2, 3, 4) for w in ("", "_uniform"))
    return (fixed,) + fewbit


#: Piecewise-linear activations whose derivative one bit per element gives exactly (where torch's
#: backward reads their input): always replaced, as nothing is approximated.
_EXACT_ONE_BIT: Dict[str, Callable[[], nn.Module]] = {"relu6": abp_nn.ReLU6, "hardsigmoid": abp_nn.Hardsigmoid}


#: The other smooth activations FewBit has tables for, at the parameters recognition checked
#: (abp._recognise): their replacement keeps ``other_activations`` bits per element of the input.
_FEWBIT_MODULES: Dict[str, Callable[..., nn.Module]] = {
    "hardswish": abp_nn.Hardswish, "mish": abp_nn.Mish, "elu": abp_nn.ELU, "selu": abp_nn.SELU,
    "softplus": abp_nn.Softplus, "logsigmoid": abp_nn.LogSigmoid, "softsign": abp_nn.Softsign,
    "tanhshrink": abp_nn.Tanhshrink,
}

#: Activations convert keeps, and why: torch's backward reads only their output, which the ops
#: after them keep anyway.
_GATE_KEPT = ("torch's backward reads only its output, which the ops after it usually keep too (a gate's product "
              "does); abp.nn.{}(bits=...) stores k-bit codes of its input instead, for where nothing else keeps the output")
_KEPT_ACTIVATIONS: Dict[str, str] = {
    "relu": "its backward reads only its output, which the next layer saves anyway",
    "sigmoid": _GATE_KEPT.format("Sigmoid"),
    "tanh": _GATE_KEPT.format("Tanh"),
}

#: Activations whose in-place form's backward reads its result (torch saves nothing more than what
#: the next layer keeps): a replacement could only add its codes (timm's ResNets with an ELU stored
#: 3 % more converted than not).
_RESULT_IN_PLACE = frozenset({"leaky_relu", "elu", "selu"})

#: The options whose default replacement is a 2-bit form (ReGELU2, ReSiLU2), whose derivative error
#: compounds on a path no residual add bypasses (_compounding_path).
_TWO_BIT_OPTIONS = ("gelu", "silu")

#: Activation kinds whose replacement approximates the derivative, by the option that chooses it.
_OPTION_OF_KIND = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu",
                   **{kind: "other_activations" for kind in _FEWBIT_MODULES}}

#: The activation options a caller may set, which convert then leaves as set (never put back).
_ACTIVATION_OPTIONS = _TWO_BIT_OPTIONS + ("other_activations",)


def _option_of(spec: Any) -> Optional[str]:
    """The option ("gelu", "silu" or "other_activations") that chooses the replacement of an
    activation of this kind; None for anything else (the ReLU family's and Hardsigmoid's exact
    replacements have none)."""
    return _OPTION_OF_KIND.get(spec.kind) if isinstance(spec, Activation) else None


def _activation_module(kind: str, name: str, approximate: str = "none") -> nn.Module:
    """The abp module for option value `name` ("regelu2", "gelu_b3", ...) on a GELU of form `approximate`."""
    if name == "regelu2":
        return abp_nn.ReGELU2(approximate=approximate) if approximate != "none" else abp_nn.ReGELU2()
    if name == "resilu2":
        return abp_nn.ReSiLU2()
    bits = int(name.split("_b")[1][0])
    weight = "uniform" if name.endswith("_uniform") else "normal"
    if kind == "gelu":
        return abp_nn.GELU(approximate=approximate, bits=bits, weight=weight)
    return abp_nn.SiLU(bits=bits, weight=weight)


#: The methods' own names (their papers' and libraries'), normalised (lower case, letters and
#: digits only), and how to ask abp for each: an unknown recipe that names one is told.
_METHOD_NAMES: Dict[str, str] = {
    "fewbit": "FewBit's k-bit activation derivatives are recipe='lowmembp' with gelu='gelu_b3', silu='silu_b3' "
              "(other_activations=3 is its default; norms=False for the activations alone)",
    "lowmemorybp": "LowMemoryBP (ReGELU2, ReSiLU2, memory-sharing norms) is recipe='lowmembp'",
    "regelu2": "ReGELU2 and ReSiLU2 are recipe='lowmembp'",
    "resilu2": "ReGELU2 and ReSiLU2 are recipe='lowmembp'",
    "gact": "GACT's compressed saved tensors are recipe='compress' (or abp.CompressionController for adaptive bits)",
    "actnn": "ActNN's compressed saved tensors are recipe='compress' (or abp.CompressionController for adaptive bits)",
    "wtacrs": "WTA-CRS is recipe='sampled' (method='wtacrs', keep=0.3)",
    "crs": "column-row sampling is recipe='sampled' with method='crs'",
    "randomizedlinear": "RandomizedLinear is recipe='sampled' with method='gaussian' or 'rademacher'",
    "vcas": "VCAS is not a convert recipe: build abp.vcas.Controller(model, ...) on the model",
}


def _method_hint(name: str) -> str:
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    hint = _METHOD_NAMES.get(key)
    return f"; {hint}" if hint else ""


def _recipes(recipe: Union[str, Sequence[str]]) -> Tuple[str, ...]:
    names = [recipe] if isinstance(recipe, str) else recipe
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        what = "a non-empty list" if isinstance(names, (list, tuple)) and not names else "a list"
        raise TypeError(f"recipe: expected a recipe name or {what} of them, got {recipe!r}")
    out: List[str] = []
    for n in names:
        expanded = RECIPES if n == "all" else (n,)
        for e in expanded:
            if e not in RECIPES:
                near = difflib.get_close_matches(n.lower(), (*RECIPES, "all"), n=1)
                hint = _method_hint(n)
                raise ValueError(f"recipe: expected one of {', '.join(RECIPES)} or 'all', got {n!r}"
                                 + (hint or (f"; did you mean {near[0]!r}?" if near else "")))
            if e not in out:
                out.append(e)
    return tuple(r for r in RECIPES if r in out)


def _check_overrides(recipes: Tuple[str, ...], overrides: Dict[str, Any]) -> Dict[str, Any]:
    defaults: Dict[str, Any] = {}
    for r in recipes:
        defaults.update(_DEFAULTS[r])
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        known = list(defaults) + list(_CONVERT_KEYWORDS)
        near = [m for u in unknown for m in difflib.get_close_matches(u, known, n=1)]
        raise TypeError(
            f"convert: unknown override(s) {', '.join(unknown)} for recipe(s) {', '.join(recipes)}; valid keywords are "
            f"{', '.join(defaults)} (recipe options) and {', '.join(_CONVERT_KEYWORDS)}"
            + (f"; did you mean {', '.join(near)}?" if near else "")
        )
    options = dict(defaults, **overrides)
    if "sampled" in recipes:
        sampling.check_method(options["method"])
        sampling.check_keep(options["keep"])
        layers = options["layers"]
        if layers is not None and (isinstance(layers, str) or not isinstance(layers, Sequence)
                                   or not all(isinstance(p, str) for p in layers)):
            raise TypeError(f"layers: expected a sequence of fnmatch patterns (str), or None to find the layers by "
                            f"what they compute, got {layers!r}")
    if "compress" in recipes:  # compress_saved checks its own arguments, naming them
        compress.compress_saved(bits=options["bits"], group_size=options["group_size"],
                                allow_low_bits=options["allow_low_bits"])
    if "lowmembp" in recipes:
        for flag in ("norms", "fold", "leaky_relu"):
            if not isinstance(options[flag], bool):
                raise TypeError(f"{flag}: expected True or False, got {options[flag]!r}")
        for kind in ("gelu", "silu"):
            value = options[kind]
            if value is None or value is False:
                options[kind] = None
                continue
            allowed = _activation_names(kind)
            if not isinstance(value, str):
                raise TypeError(f"{kind}: expected one of {', '.join(allowed)} (a str) or None (off), got "
                                f"{type(value).__name__} {value!r}")
            if value not in allowed:
                raise ValueError(f"{kind}: expected one of {', '.join(allowed)} or None (off), got {value!r}")
        bits = options["other_activations"]
        if bits is False:
            options["other_activations"] = None
        elif bits is not None:
            if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= bits <= 4:
                raise ValueError(f"other_activations: expected the bits of the FewBit derivative (1, 2, 3 or 4) or None "
                                 f"(off), got {bits!r}")
            options["other_activations"] = int(bits)  # a numpy integer too
    return options


# ---------------------------------------------------------------------------------------------
# Module checks: what a replacement or a fold would silently drop
# ---------------------------------------------------------------------------------------------


def _hooks_of(module: nn.Module) -> List[str]:
    """The kinds of hooks registered on `module` itself (they would not survive a replacement)."""
    kinds = [("forward pre-hooks", "_forward_pre_hooks"), ("forward hooks", "_forward_hooks"),
             ("backward hooks", "_backward_hooks"), ("backward pre-hooks", "_backward_pre_hooks")]
    return [label for label, attr in kinds if getattr(module, attr, None)]


def _hooks_phrase(module: nn.Module) -> str:
    """"<kinds of hooks>, which the replacement would not carry", naming abp's own hooks' owner
    (an `abp_owner` attribute on the hook): a CompressionController hooks every submodule."""
    owners = {getattr(hook, "abp_owner", None) for attr in ("_forward_pre_hooks", "_forward_hooks")
              for hook in getattr(module, attr, {}).values()} - {None}
    note = "".join(f"; they are an {owner}'s: build it on the model abp.convert returns, after converting"
                   for owner in sorted(owners))
    return f"{' and '.join(_hooks_of(module))}, which the replacement would not carry{note}"


def _replacement_refusal(module: nn.Module) -> Optional[str]:
    """Why `module` must not be replaced or folded into (None if it may).

    A replacement has neither hooks nor parametrizations: dropping them would change what runs.
    """
    if parametrize.is_parametrized(module):
        return "its parameters are parametrized (torch.nn.utils.parametrize); the replacement has none"
    if _hooks_of(module):
        return f"it has {_hooks_phrase(module)}"
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
# Rewriting
# ---------------------------------------------------------------------------------------------


def _parameter_owners(model: nn.Module) -> Dict[int, List[str]]:
    """id(parameter) -> every qualified name it is registered under (shared weights have several)."""
    owners: Dict[int, List[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append(f"{prefix}.{name}" if prefix else name)
    return owners


def _paths(model: nn.Module) -> Dict[int, List[str]]:
    """id(module) -> every qualified name it is registered under (a shared module has several)."""
    paths: Dict[int, List[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
    return paths


def _also_at(paths: List[str]) -> str:
    return f" (also registered as {', '.join(f'`{p}`' for p in paths[1:])})" if len(paths) > 1 else ""




def _fold_into(module: nn.Module, spec: LinearMap, gamma: Optional[Tensor], beta: Optional[Tensor],
               beta_trainable: bool = False) -> str:
    """W' = W diag(gamma), b' = b + W beta (for x W + b layouts: rows scaled), in float64 and cast back.

    The layer keeps its Parameter objects (with ``inplace=True``, an optimizer holding them stays
    valid); a missing bias is registered on the same module, trainable like its weight, and the
    change detail says it is new. It is added for a trainable beta even where beta is 0 now (a
    LayerNorm's initial value): the folded model must be able to learn the shift beta could.
    """
    weight = getattr(module, spec.weight)
    bias = getattr(module, spec.bias) if spec.bias is not None else None
    with torch.no_grad():
        w = weight.detach().to(torch.float64)
        w_out_in = w.t() if spec.transposed else w
        new = w_out_in
        if gamma is not None:
            new = w_out_in * gamma.to(device=w.device, dtype=torch.float64)[None, :]
        new_b: Optional[Tensor] = bias.detach().to(torch.float64) if bias is not None else None
        if beta is not None and (beta_trainable or beta.device.type == "meta" or bool((beta != 0).any())):
            shift = w_out_in @ beta.to(device=w.device, dtype=torch.float64)
            new_b = shift if new_b is None else new_b + shift
        added = new_b is not None and bias is None
        if added:
            fresh = torch.empty(spec.out_features, dtype=weight.dtype, device=weight.device)
            module.register_parameter("bias", nn.Parameter(fresh, requires_grad=weight.requires_grad))
            bias = module.bias
        weight.copy_((new.t() if spec.transposed else new).to(weight.dtype))
        if new_b is not None:
            bias.copy_(new_b.to(bias.dtype))
    parts = "gamma and beta" if beta is not None else "gamma"
    note = (" (bias added for beta: a new Parameter, not in an optimizer or DDP wrapper built before, and not one the"
            " original class can load)") if added else ""
    return f"folded {parts} in float64{note}"


# ---------------------------------------------------------------------------------------------
# Recipe "lowmembp": norms
# ---------------------------------------------------------------------------------------------


def _gamma_beta(module: nn.Module, spec: Norm) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    gamma = getattr(module, spec.weight).detach() + spec.weight_offset if spec.weight is not None else None
    beta = getattr(module, spec.bias).detach() if spec.bias is not None else None
    return gamma, beta


def _fold_targets(
    name: str, norm: Norm, structure: _structure.Structure, modules: Dict[str, nn.Module],
    recognised: Dict[int, Any], owners: Dict[int, List[str]],
) -> Tuple[Optional[List[str]], str]:
    """The linear layers to fold norm `name` into, or None and why it cannot be folded."""
    norm_params = list(modules[name].parameters(recurse=False))
    calls = structure.calls.get(name, 0)
    if calls != 1:
        return None, (f"it ran {calls} times in the example call; folding needs exactly one call" if calls
                      else "it did not run in the example call")
    foreign = structure.foreign_parameter_uses.get(name)
    if foreign:
        return None, f"its parameters are also used outside it ({foreign[0]})"
    read = structure.foreign_parameter_reads.get(name)
    if read:  # a fold removes them: the read would fail
        return None, f"its parameters are also read outside it ({read[0]}); folding removes them"
    uses = structure.uses.get(name, [])
    if not uses:
        return None, "its output is unused"
    targets: List[str] = []
    for use in uses:
        if use.module is None:
            return None, f"its output also feeds {use.describe(modules)}, not only linear layers"
        target = modules[use.module]
        spec = recognised.get(id(target))
        if not isinstance(spec, LinearMap):
            return None, f"its output feeds {use.describe(modules)}, which is not a linear map"
        if structure.calls.get(use.module, 0) != 1:
            return None, f"`{use.module}` ran {structure.calls.get(use.module, 0)} times; folding would change its other calls"
        if len(structure.inputs.get(use.module, [])) != 1:
            return None, f"`{use.module}` takes more than the norm's output"
        elsewhere = structure.foreign_parameter_uses.get(use.module)
        if elsewhere:
            return None, f"`{use.module}`'s parameters are also used outside it ({elsewhere[0]}); folding would change that use"
        refusal = _linear_refusal(use.module, target) if isinstance(target, nn.Linear) else _replacement_refusal(target)
        if refusal is not None:
            return None, refusal
        trains = {p.requires_grad for p in norm_params}
        if trains != {getattr(target, spec.weight).requires_grad} and trains:
            return None, (f"`{use.module}` is {'frozen' if not getattr(target, spec.weight).requires_grad else 'trainable'} "
                          f"while the norm's parameters are not: folding would change what trains")
        if len(norm.shape) != 1 or spec.in_features != norm.shape[0]:
            return None, f"`{use.module}` has in_features {spec.in_features}; the norm's shape is {norm.shape}"
        for pname in (spec.weight, spec.bias):
            p = getattr(target, pname) if pname is not None else None
            if p is not None and len(owners.get(id(p), [])) > 1:
                others = [o for o in owners[id(p)] if not o.startswith(f"{use.module}.")]
                return None, f"`{use.module}` shares its parameters with {', '.join(others) or 'another module'}"
        targets.append(use.module)
    return targets, ""


def _ms_norm(spec: Norm, affine: bool, autocast_output: bool) -> nn.Module:
    cls = abp_nn.MSLayerNorm if spec.kind == "layer" else abp_nn.MSRMSNorm
    return cls(spec.shape, spec.eps, elementwise_affine=affine and spec.weight is not None,
               bias=affine and spec.bias is not None, weight_offset=spec.weight_offset if affine else 0.0,
               device="meta", autocast_output=autocast_output)


def _convert_norm(
    model: nn.Module, name: str, module: nn.Module, spec: Norm, fold: bool, structure: Optional[_structure.Structure],
    modules: Dict[str, nn.Module], recognised: Dict[int, Any], owners: Dict[int, List[str]], paths: List[str],
) -> List[Change]:
    kind = type(module).__name__
    label = ("LayerNorm" if spec.kind == "layer" else "RMSNorm") + (" (1 + weight)" if spec.weight_offset else "")

    def refused(reason: str) -> List[Change]:
        return [Change(name, "refused", f"{kind} ({label}) not replaced: {reason}")]

    refusal = _replacement_refusal(module)
    if refusal is not None:
        return refused(refusal)
    if spec.weight is None and spec.bias is not None:
        return refused("it has a bias but no weight, which the memory-sharing norms do not take")
    gamma, beta = _gamma_beta(module, spec)
    try:
        abp_nn.MSLayerNorm(spec.shape, spec.eps)  # checks eps as the kernels take it
    except (TypeError, ValueError) as e:
        return refused(f"no memory-sharing norm for it: {e}")
    in_place = structure.modified.get(name) if structure is not None else None
    if in_place:
        return refused(f"its output is modified in place ({in_place[0]}), and the memory-sharing backward reads it")
    after = _next_in_sequential(model, name)
    if after is not None and getattr(after[1], "inplace", False) is True:
        return refused(f"the next module `{after[0]}` ({type(after[1]).__name__}) works in place on its output, which the "
                       "memory-sharing backward reads (set its inplace=False to convert this norm)")
    # Under autocast the output may be emitted in the autocast dtype only where linear layers alone
    # read it (they would cast it anyway); elsewhere (a residual stream) it keeps its dtype.
    linear_only = structure is not None and bool(structure.uses.get(name)) and all(
        u.module is not None and isinstance(recognised.get(id(modules[u.module])), LinearMap) for u in structure.uses[name])
    targets: Optional[List[str]] = None
    why_not = ""
    if fold and (gamma is not None or beta is not None):
        assert structure is not None
        targets, why_not = _fold_targets(name, spec, structure, modules, recognised, owners)
    if targets is not None:
        beta_trainable = spec.bias is not None and getattr(module, spec.bias).requires_grad
        changes = [Change(t, "folded", f"{_fold_into(modules[t], recognised[id(modules[t])], gamma, beta, beta_trainable)} "
                          f"from `{name}`") for t in targets]
        folded = _ms_norm(spec, affine=False, autocast_output=True)
        _composition.put(model, paths, folded)
        changes.append(Change(name, "replaced", f"{kind} -> {type(folded).__name__} ({label}, eps={spec.eps:g}, affine folded "
                              f"into {', '.join(targets)}){_also_at(paths)}"))
        return changes
    if gamma is not None and gamma.device.type != "meta" and bool((gamma == 0).any()):
        return refused(f"gamma is 0 at {int((gamma == 0).sum())} feature(s); backward recovers the normalised value as (y - beta) / gamma")
    replacement = _ms_norm(spec, affine=True, autocast_output=linear_only)
    renamed = []
    if spec.weight is not None:
        replacement.weight = getattr(module, spec.weight)
        if spec.weight != "weight":
            renamed.append(f"{spec.weight} -> weight")
    if spec.bias is not None:
        replacement.bias = getattr(module, spec.bias)
        if spec.bias != "bias":
            renamed.append(f"{spec.bias} -> bias")
    replacement.train(module.training)
    _composition.put(model, paths, replacement)
    detail = f"{kind} -> {type(replacement).__name__} ({label}, eps={spec.eps:g}"
    detail += ", affine kept: backward recovers the normalised value from the output)" if gamma is not None or beta is not None else ")"
    if gamma is not None and gamma.device.type == "meta":
        detail += ("; gamma is on the meta device, so convert could not check it for zeros (where gamma is 0 once "
                   "loaded, that feature's gradients are lost)")
    if renamed:
        detail += f"; parameters renamed {', '.join(renamed)}"
    if fold and why_not:
        detail += f"; not folded: {why_not}"
    if not linear_only:
        if structure is None:
            why = " (pass example_inputs= to let norms read only by linear layers emit the autocast dtype)"
        else:
            other = [u for u in structure.uses.get(name, [])
                     if u.module is None or not isinstance(recognised.get(id(modules[u.module])), LinearMap)]
            why = f" (its output also feeds {other[0].describe(modules)})" if other else " (it did not run in the example call)"
        detail += "; keeps its dtype under autocast" + why
    return [Change(name, "replaced", detail + _also_at(paths))]


def _next_in_sequential(model: nn.Module, name: str) -> Optional[Tuple[str, nn.Module]]:
    """(name, module) after `name` in its parent, when the parent is an nn.Sequential."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if not isinstance(parent, nn.Sequential):
        return None
    keys = list(parent._modules)
    at = keys.index(attr) if attr in keys else -1
    if at < 0 or at + 1 >= len(keys):
        return None
    nxt = keys[at + 1]
    return (f"{parent_name}.{nxt}" if parent_name else nxt), parent._modules[nxt]  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Recipe "lowmembp": activations
# ---------------------------------------------------------------------------------------------


# Where the 2-bit activations' derivative error compounds with depth: on a path of layers the
# gradient must all pass through, as in CNNs (bench/activation_chains.py: through 12
# Conv-BatchNorm-SiLU, Conv-GroupNorm-SiLU or Conv-SiLU layers, ReSiLU2's first-layer gradient error
# is 3.4, 3.6 and 72; the 3-bit FewBit SiLU's 0.24, 0.24 and 0.48), not in the residual branches of
# transformers (0.54 through 12 blocks, LowMemoryBP's own setting). There the default becomes the
# 3-bit form; so it does in a CNN's residual branches, whose Conv-BatchNorm-activation layers
# compound it within the branch (timm's EfficientNet-B0 and a SiLU ResNet-18 at initialisation,
# whole-gradient error 4.7 and 0.80 with those at 2 bits, 0.30 and 0.22 at 3 bits). Read from the
# example call's dataflow (abp._dataflow), or without one from the module tree.
_CNN_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.modules.conv._ConvNd)
_CNN_FUNCTIONS = frozenset({"batch_norm", "group_norm", "instance_norm", "conv1d", "conv2d", "conv3d",
                            "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


def _compounding_path(model: nn.Module, name: str, modules: Dict[str, nn.Module],
                      dataflow: Optional[_dataflow.Dataflow], activations: Set[int], normalized: Set[int]) -> Optional[str]:
    """Why activation `name` is on a path where the 2-bit error compounds, or None; `activations`:
    what the modules that may get the 2-bit form made in the example call (`Dataflow.outputs`),
    `normalized`: what the norm modules made.

    From the example call where the activation ran in it: a call of it that no residual add
    bypasses (an add closing a branch that holds no other of `activations` before or after it),
    or a convolution or channel norm making its input. Else from the module tree: the module it belongs to holds a
    convolution or channel norm (timm's BatchNormAct2d, torchvision's Conv2dNormActivation, a
    ResNet block, transformers' convolution-normalization-activation layers), where a
    transformer's MLP holds linear layers only."""
    bypassed = dataflow.bypassed(name, activations, normalized) if dataflow is not None else None
    if bypassed is not None:
        assert dataflow is not None
        if not bypassed:
            return ("on a path no residual add bypasses in the example call (as in a CNN's layers, or a branch "
                    "normalised before its add)")
        producer = next((p for p in dataflow.producers(name) if p in _CNN_FUNCTIONS), None)
        return f"fed by `{producer}` in the example call, a CNN layer" if producer is not None else None
    parent_name = name.rpartition(".")[0]
    parent = modules[parent_name] if parent_name else model
    layer = next((m for m in parent.modules() if isinstance(m, _CNN_LAYERS)), None)
    if layer is None:
        return None
    source = "it did not run in the example call, so" if dataflow is not None else "without an example call"
    return (f"in `{parent_name or type(model).__name__}`, a block with a {type(layer).__name__} (a CNN layer; {source} "
            "convert reads the module tree)")


def _convert_activation(model: nn.Module, name: str, module: nn.Module, spec: Any, options: Dict[str, Any], paths: List[str],
                        refusal: Optional[str] = None, chain: Optional[str] = None, idle: bool = False) -> List[Change]:
    """Replaces one activation as the options say; `refusal`: why none may be replaced here;
    `chain`: why its 2-bit form's error would compound, where the caller left the choice to convert;
    `idle`: the example call did not call it (the model computes that activation some other way,
    or on another path), which the change then says."""
    kind = type(module).__name__
    if isinstance(spec, Unknown):
        return [Change(name, "refused", f"{kind} not replaced: {spec.reason}")]
    assert isinstance(spec, Activation)
    if spec.kind in _KEPT_ACTIVATIONS:
        label = _recognise.ACTIVATION_NAMES[spec.kind]
        return [Change(name, "refused", f"{kind} ({label}) kept: {_KEPT_ACTIVATIONS[spec.kind]}")]
    if spec.kind in _RESULT_IN_PLACE and getattr(module, "inplace", False) is True:
        label = _recognise.ACTIVATION_NAMES[spec.kind]
        return [Change(name, "refused", f"{kind} ({label}) kept: in place, torch's backward reads its result, which the "
                                        "layer after it usually keeps too; a replacement would store its codes beside it")]
    if spec.kind == "leaky_relu":
        if not options["leaky_relu"]:
            return []
        replacement: nn.Module = abp_nn.LeakyReLU(spec.slope)
        what = f"LeakyReLU(negative_slope={spec.slope:g}), exact 1-bit"
    elif spec.kind in _EXACT_ONE_BIT:
        # torch saves their input for backward; one bit says which piece it was on, exactly.
        replacement, what = _EXACT_ONE_BIT[spec.kind](), "exact 1-bit"
    elif _option_of(spec) == "other_activations":
        bits = options["other_activations"]
        if bits is None:
            return []
        replacement, what = _FEWBIT_MODULES[spec.kind](bits=bits), f"FewBit {bits}-bit"
    else:
        family = _option_of(spec)
        assert family is not None
        choice = options[family]
        if choice is None:
            return []
        why = ""
        if chain is not None and choice == _DEFAULTS["lowmembp"][family]:
            choice = f"{family}_b3"
            why = (f": {chain}, where the 2-bit {'ReSiLU2' if family == 'silu' else 'ReGELU2'}'s derivative "
                   f"error compounds with depth; {family}={_DEFAULTS['lowmembp'][family]!r} forces it")
        approximate = "tanh" if spec.kind == "gelu_tanh" else "none"
        replacement = _activation_module(family, choice, approximate)
        what = f"{choice}" + (", tanh form" if approximate == "tanh" else "") + why
    if refusal is not None:
        return [Change(name, "refused", f"{kind} not replaced: {refusal}")]
    if _hooks_of(module):
        return [Change(name, "refused", f"{kind} not replaced: it has {_hooks_phrase(module)}")]
    replacement.train(module.training)
    # An in-place original writes its input, which the model may read again (`y = act(h); y + h`).
    replacement.inplace = getattr(module, "inplace", False) is True
    _composition.put(model, paths, replacement)
    # First, where a report cut to a line still shows it: the model computes this activation some
    # other way (transformers' Mamba mixers call ACT2FN afresh) or on another path.
    idle_note = "did not run in the example call, so the replacement may change nothing: " if idle else ""
    return [Change(name, "replaced",
                   f"{idle_note}{kind} ({spec.kind}) -> {type(replacement).__name__} ({what}){_also_at(paths)}")]


# ---------------------------------------------------------------------------------------------
# Recipe "sampled"
# ---------------------------------------------------------------------------------------------


def _sample_one(model: nn.Module, name: str, module: nn.Module, spec: LinearMap, method: str, keep: float, paths: List[str]) -> Change:
    # What the module computes was recognised (a subclass's own forward was probed), so only what a
    # replacement would drop matters: hooks, parametrizations, parameters that are not its own.
    why = next((f"`{name}`.{p} is not a Parameter of its own (a computed or registered-elsewhere tensor)"
                for p in (spec.weight, spec.bias) if p is not None and p not in module._parameters), None)
    if why is None and _hooks_of(module):
        why = f"`{name}` has {_hooks_phrase(module)}"
    if why is None and parametrize.is_parametrized(module):
        why = f"`{name}` has parametrized weights"
    if why is None and (spec.weight != "weight" or spec.bias not in (None, "bias")):
        why = f"`{name}` keeps its parameters as {spec.weight}/{spec.bias}, not weight/bias"
    if why is None and not getattr(module, spec.weight).requires_grad:
        why = f"`{name}` is frozen (its weight needs no gradient): nothing to sample"
    if why is not None:
        return Change(name, "refused", why)
    if spec.transposed:
        replacement: nn.Module = abp_nn.SampledConv1D.from_conv1d(module, method=method, keep=keep)
    else:
        replacement = abp_nn.SampledLinear.from_linear(module, method=method, keep=keep)
    _composition.put(model, paths, replacement)
    return Change(name, "replaced", f"{type(module).__name__} -> {type(replacement).__name__} (method={method!r}, "
                  f"keep={keep}){_also_at(paths)}")


def _convert_sampled_by_role(model: nn.Module, options: Dict[str, Any], recognised: Dict[int, Any],
                             roles: Dict[str, str], source: str, idle: List[str]) -> List[Change]:
    """Samples the trainable linear maps abp._roles chose (found in the call `source` names); says
    which blocks holding linear maps that call never ran (`idle`), whose maps stay exact."""
    modules = dict(model.named_modules())
    paths = _paths(model)
    changes: List[Change] = []
    frozen = 0
    for name in roles:
        module = modules[name]
        if parametrize.is_parametrized(module):
            changes.append(Change(name, "refused", f"`{name}` has parametrized weights (torch.nn.utils.parametrize): "
                                  "what it computes is not its own"))
            continue
        spec = recognised[id(module)]
        if type(module).__module__.startswith("abp."):
            continue
        if not getattr(module, spec.weight).requires_grad:
            frozen += 1  # a LoRA base layer: nothing to sample, and one line per layer would drown the report
            continue
        changes.append(_sample_one(model, name, module, spec, options["method"], options["keep"], paths[id(module)]))
    if frozen:
        changes.append(Change("", "refused", f"recipe sampled: {frozen} frozen linear map(s) in attention-output or "
                              "feed-forward position kept (their weight needs no gradient: nothing to sample)"))
    if idle:
        shown = ", ".join(f"`{b}`" for b in idle[:3]) + (f" and {len(idle) - 3} more" if len(idle) > 3 else "")
        changes.append(Change("", "refused", f"recipe sampled: {source} did not run {len(idle)} block(s) holding "
                              f"linear maps ({shown}), whose roles it therefore cannot tell: they stay exact; give "
                              "an example that runs them (every input the model takes, e.g. its images as well) "
                              "or layers=[...]"))
    if not roles:
        done = sum(isinstance(m, (abp_nn.SampledLinear, abp_nn.SampledConv1D)) for m in modules.values())
        # Sampled by an earlier convert: abp's layers are no linear maps the call could choose.
        changes.append(Change("", "refused", f"recipe sampled: nothing left to sample; {done} linear map(s) are sampled "
                              "already (an earlier convert's), which convert leaves as they are" if done else
                              f"recipe sampled: {source} ran no linear map in attention-output or "
                              "feed-forward position (abp._roles); pass layers=[...] to choose them by name"))
    return changes


def _convert_sampled(model: nn.Module, options: Dict[str, Any], recognised: Dict[int, Any],
                     roles: Optional[Tuple[Dict[str, str], str]]) -> List[Change]:
    """Samples the linear maps found by role when a call ran (``roles``: chosen maps, which call);
    otherwise each linear map whose qualified name matches a pattern of ``layers`` (SAMPLED_LAYERS
    when None); a matched module that is no linear map itself (a LoRA wrapper) has its trainable
    linear maps sampled."""
    if options["layers"] is None and roles is not None:
        return _convert_sampled_by_role(model, options, recognised, *roles)
    method, keep = options["method"], options["keep"]
    layers = SAMPLED_LAYERS if options["layers"] is None else options["layers"]
    paths = _paths(model)
    changes: List[Change] = []
    done = set()
    for name, module in list(model.named_modules()):
        if not name or id(module) in done or not any(fnmatch.fnmatchcase(name, p) for p in layers):
            continue
        done.add(id(module))
        if type(module).__module__.startswith("abp."):
            continue  # already abp's (a SampledLinear, an MS norm, an activation)
        spec = recognised.get(id(module))
        if isinstance(spec, LinearMap):
            changes.append(_sample_one(model, name, module, spec, method, keep, paths[id(module)]))
            continue
        if _recognise.is_leaf(module):
            changes.append(Change(name, "refused", f"{type(module).__name__} matches layers= but does not compute a linear map"))
            continue
        inner = [(f"{name}.{n}", m) for n, m in module.named_modules() if n and isinstance(recognised.get(id(m)), LinearMap)]
        trainable = [(n, m) for n, m in inner if getattr(m, recognised[id(m)].weight).requires_grad]
        if not trainable:
            changes.append(Change(name, "refused", f"{type(module).__name__} matches layers= but holds no trainable linear map"))
        for sub_name, sub in trainable:
            if id(sub) not in done and not isinstance(sub, abp_nn.SAMPLED_LAYERS):
                done.add(id(sub))
                changes.append(_sample_one(model, sub_name, sub, recognised[id(sub)], method, keep, paths[id(sub)]))
    if not done and layers:
        changes.append(Change("", "refused", "recipe sampled: no module name matched layers= (SAMPLED_LAYERS knows T5, "
                              "BERT/RoBERTa, ViT, timm, GPT-2 and LLaMA-style names); pass example_inputs= (one call "
                              "the model accepts) to find the attention-output and FFN projections by what they "
                              "compute, or layers=[...] with their names, e.g. ['*.fc1', '*.fc2', '*.out_proj']"))
    return changes


# ---------------------------------------------------------------------------------------------
# Recipe "compress"
# ---------------------------------------------------------------------------------------------


def _open_block(hooks: "CompressSavedHooks") -> None:
    hooks._enter()


def _open_block_for_graphs(hooks: "CompressSavedHooks") -> None:
    hooks._enter(recompute=False)


def _close_block(hooks: "CompressSavedHooks") -> None:
    hooks._leave()


_BlockFunction = Callable[["CompressSavedHooks"], None]
_BLOCK_FUNCTIONS: Optional[Tuple[_BlockFunction, _BlockFunction, _BlockFunction]] = None


def _block_functions() -> Tuple[_BlockFunction, _BlockFunction, _BlockFunction]:
    """(_open_block, _open_block_for_graphs, _close_block), made to run eagerly even inside a
    model torch.compile traces (a graph break at each): the block must be open when the rest of
    the forward is compiled, for AOTAutograd to inline its hooks into that graph
    (abp._compiled_saves); traced instead, the block would be dropped. Resolved when a recipe
    first makes its hooks (eagerly, before any trace), not at import: it loads torch._dynamo,
    which `import abp` should not."""
    global _BLOCK_FUNCTIONS
    if _BLOCK_FUNCTIONS is None:
        functions = (_open_block, _open_block_for_graphs, _close_block)
        if _compiled_saves.available():
            functions = tuple(torch._dynamo.disable(f) for f in functions)  # type: ignore[assignment]
        _BLOCK_FUNCTIONS = functions  # type: ignore[assignment]
    return _BLOCK_FUNCTIONS  # type: ignore[return-value]


_IS_EXPORTING: Optional[Callable[[], bool]] = getattr(getattr(torch, "compiler", None), "is_exporting", None)


def _exporting() -> bool:
    """True while torch.export traces (torch versions that say so)."""
    return _IS_EXPORTING is not None and bool(_IS_EXPORTING())


class CompressSavedHooks:
    """Runs a module's forward inside ``compress_saved``: a forward pre-hook and hook pair.

    Hooks rather than a replaced forward: a forward already set on the instance (accelerate's
    dispatch hooks, a user's wrapper) keeps running, the state_dict is unchanged, and the model
    still deep-copies and pickles (a copy gets its own pair). The hook runs even when forward
    raises (``always_call``, torch >= 2.0), so no block is left open. torch 1.13 has no
    ``always_call``: there ``wrap`` puts the forward inside a try/finally instead.
    """

    def __init__(self, bits: int, group_size: int, allow_low_bits: bool = False) -> None:
        self.bits = bits
        self.group_size = group_size
        self.allow_low_bits = allow_low_bits
        # The blocks open now, per thread (DataParallel's replicas share these hooks).
        self._open: Dict[int, List[Optional[compress.compress_saved]]] = {}
        _block_functions()  # resolved now, eagerly: enter and leave may run inside a trace

    def __getstate__(self) -> Dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "allow_low_bits": self.allow_low_bits, "_open": {}}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        _block_functions()  # as __init__: a model unpickled in a new process may be compiled next

    def enter(self, module: nn.Module, args: Any) -> None:
        # Traced by torch.compile (the check runs at trace time; the graph break calls the
        # function it chose): the compiled graphs recompute on their own (the partitioner), so
        # the block opens without its recorder, a torch function mode that dynamo would trace
        # through for nothing, and mis-traces under FSDP2 (torch 2.15, per-layer fully_shard: a
        # tensor's .device read as its shape).
        functions = _block_functions()
        (functions[1] if _derived._compiling() else functions[0])(self)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        _block_functions()[2](self)

    def _enter(self, recompute: bool = True) -> None:
        opened = self._open.setdefault(threading.get_ident(), [])
        if opened:
            self._close_interrupted(opened)
        if _exporting() or (_custom_ops._tracing_mode() and not _derived._compiling()) \
                or torch._C._get_tracing_state() is not None:
            # torch.export and make_fx trace the model's function with tensors that hold no data, and
            # torch.jit.trace records its ops: the block's own work is no part of the model's
            # function, so no block (None keeps enter and leave paired).
            if torch._C._get_tracing_state() is not None:
                compress._warn_once("jit-trace", "abp: torch.jit.trace records this model without its compress_saved "
                                    "block (the recipe's hooks are Python): the traced module computes the same "
                                    "values, but trains without compression")
            opened.append(None)
            return
        if not torch.is_grad_enabled():
            # Nothing is saved with grad off (evaluation, a teacher under no_grad inside another
            # model's compress_saved block): no block, so none nests in another's.
            opened.append(None)
            return
        if _derived._compiling():
            # Traced by torch.compile on a torch whose AOTAutograd does not take saved-tensor hooks
            # (2.4 and before: _block_functions could not keep the block out of the trace). The
            # graph saves without it; traced, the block's own Python failed under inductor.
            compress._warn_once("compiled-uncompressed", f"abp: torch {torch.__version__} cannot compress what a "
                                "torch.compile'd graph saves (its AOTAutograd takes no saved-tensor hooks): the "
                                "compress recipe compresses nothing in compiled graphs, the rest of the model trains "
                                "as converted (docs/install.md, \"Which torch\")")
            opened.append(None)
            return
        block = compress.compress_saved(bits=self.bits, group_size=self.group_size, allow_low_bits=self.allow_low_bits,
                                        recompute=recompute)
        block.__enter__()
        opened.append(block)

    def _leave(self) -> None:
        opened = self._open.get(threading.get_ident())
        if opened:
            block = opened.pop()
            if block is not None:
                block.__exit__(None, None, None)

    @staticmethod
    def _close_interrupted(opened: List[Optional[compress.compress_saved]]) -> None:
        """Closes the blocks a forward left open: the hook that closes them runs when forward raises
        an Exception, not a BaseException (KeyboardInterrupt, a Ctrl-C in a notebook), so such a
        forward leaves its block open. Its saved-tensor hooks stayed on this thread's stack, and
        what was saved meanwhile outside this model was compressed too: the warning says so."""
        while opened:
            block = opened.pop()
            if block is not None:
                block.__exit__(None, None, None)
        warnings.warn("abp: convert's compress recipe: this model's last forward did not finish (interrupted, as by "
                      "KeyboardInterrupt), so its compress_saved block stayed open until this call, which closed it; "
                      "tensors other code saved in this thread since then were compressed too",
                      RuntimeWarning, stacklevel=4)

    def wrap(self, forward: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """torch < 2.0: ``forward(module, *args, **kwargs)`` inside one block, closed whatever happens."""
        self.enter(module, args)
        try:
            return forward(module, *args, **kwargs)
        finally:
            self.leave(module, args, None)


def _compress_hooks_of(model: nn.Module) -> Optional[CompressSavedHooks]:
    """The recipe's hooks an earlier convert put on `model` (a pre-hook, or on torch < 2.0 the
    forward it wrapped), or None."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, CompressSavedHooks):
            return owner
    forward = vars(model).get("forward")
    owner = getattr(forward.func, "__self__", None) if isinstance(forward, functools.partial) else None
    return owner if isinstance(owner, CompressSavedHooks) else None


def recipe_block_in(model: nn.Module) -> Optional[Tuple[str, CompressSavedHooks]]:
    """(qualified name, hooks) of the first module of `model` ("" for itself) whose forward an
    earlier convert put inside a compress_saved block (recipe compress or all), or None."""
    for name, module in model.named_modules():
        hooks = _compress_hooks_of(module)
        if hooks is not None:
            return name, hooks
    return None


def _convert_compress(model: nn.Module, options: Dict[str, Any]) -> List[Change]:
    """Runs the model's forward inside ``compress_saved``: every saved tensor that abp's recipes left
    as it was (codes and per-row values are not floating or too small) is stored as group codes."""
    found = recipe_block_in(model)
    if found is not None:
        name, earlier = found
        which = "the model already runs" if not name else f"its submodule {name!r} already runs"
        return [Change("", "refused", f"recipe compress: {which} inside compress_saved(bits={earlier.bits}, "
                       f"group_size={earlier.group_size}) from an earlier convert (blocks do not nest); kept as it was. "
                       "For other settings, convert the unconverted model")]
    hooks = CompressSavedHooks(options["bits"], options["group_size"], options["allow_low_bits"])
    try:
        model.register_forward_hook(hooks.leave, always_call=True)  # type: ignore[call-arg]
        model.register_forward_pre_hook(hooks.enter)
        how = "forward hooks"
    except TypeError:  # torch < 2.0: no always_call; the forward itself runs in a try/finally
        if "forward" in vars(model):
            raise ValueError("recipe compress: this model has a forward of its own instance (a wrapper); on torch < 2.0 "
                             "convert cannot keep it, use `with abp.compress_saved(...)` around the forward instead")
        model.forward = functools.partial(hooks.wrap, type(model).forward, model)  # type: ignore[assignment]
        how = "forward wrapped"
    # torch.jit.script asks each module to prepare itself: this one says why it cannot be scripted.
    model.__prepare_scriptable__ = autograd.RefuseScripting()  # type: ignore[method-assign]
    return [Change("", "wrapped", f"forward runs inside compress_saved(bits={options['bits']}, group_size={options['group_size']}) "
                   f"({how})")]


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------


def _keep_what_saves(model: nn.Module, changes: List[Change], before: Dict[str, nn.Module],
                     options: Dict[str, Any], chosen: Set[str], recognised: Dict[int, Any],
                     call: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]) -> List[Change]:
    """Puts back what stores more than it saves (abp._composition), counted on the example call
    (else the model's dummy_inputs call; with neither, every replacement stays): where the model
    runs inside compress_saved (recipe compress, now or from an earlier convert) every
    replacement abp chose, else recipe sampled's layers found by role. What the caller named
    (``layers=``, ``gelu=``, ``silu=``) stays."""
    # The model runs inside compress_saved by this convert or an earlier one.
    hooks = _compress_hooks_of(model)
    compressing = hooks is not None
    candidates: List[_composition.Candidate] = []
    for c in changes:
        if c.action != "replaced" or c.module not in before:
            continue
        original, new = before[c.module], model.get_submodule(c.module)
        sampled = isinstance(new, abp_nn.SAMPLED_LAYERS)
        spec = recognised.get(id(original))
        named = (options["layers"] is not None) if sampled else \
            _option_of(spec) in chosen
        if named or not (sampled or compressing):
            continue
        paths = tuple(p for p, m in before.items() if m is original)
        candidates.append(_composition.Candidate(c.module, paths, original, new, "sampled" if sampled else "lowmembp"))
    if not candidates:
        return changes
    explicit = call is not None
    call = call if explicit else _dummy_call(model)
    names = " and ".join(sorted({c.recipe for c in candidates}))
    if call is None:
        if not compressing:  # recipe sampled alone: its layers were chosen by name
            return changes
        return changes + [Change("", "refused", f"recipe {names}: no call to count what each replacement saves on (no "
                                 "example_inputs/example_kwargs, no dummy_inputs): every replacement stays, though some "
                                 "may store more than they save; pass example_inputs= to keep only what saves")]
    # Sampling costs the most accuracy: its groups are tried first.
    candidates.sort(key=lambda c: c.recipe != "sampled")
    reverted, error = _composition.keep_what_saves(model, candidates, lambda: _composition.saved_bytes_of_call(model, call))
    source = "example" if explicit else "dummy_inputs"
    if error is not None:
        changes = changes + [Change("", "refused", f"recipe {names}: the {source} call with gradients, in training mode, "
                                    f"failed ({type(error).__name__}: {error}), so what each replacement saves was not "
                                    "counted and the replacements not yet decided stay; pass an example the model can "
                                    "train on (e.g. a batch of two or more for BatchNorm)")]
    under = f" under compress_saved(bits={hooks.bits})" if hooks is not None else ""
    why: Dict[str, str] = {}
    # One decision per group of modules at one pattern (blocks.*.mlp.act): each member's change says so.
    members: Dict[Any, int] = {}
    for b in reverted:
        members[b.candidate.group()] = members.get(b.candidate.group(), 0) + 1
    for b in reverted:
        c = b.candidate
        kept = f"{type(c.original).__name__} kept as it was: "
        count = members[c.group()]
        where = c.pattern if count == 1 else f"{c.pattern} (one decision for these {count} modules)"
        why[c.name] = kept + (
            f"the {source} call saves {b.without_bytes} bytes for backward{under} without {type(c.new).__name__} at "
            f"{where}, {b.with_bytes} with it (recipe {c.recipe} puts back a replacement that stores more than it "
            "saves)" if b.like is None else
            f"the {source} call did not run {c.pattern}; {type(c.new).__name__} was put back where it ran, at {b.like}")
    return [Change(c.module, "kept", why[c.module]) if c.action == "replaced" and c.module in why else c for c in changes]


def _recognise_all(model: nn.Module) -> Dict[int, Any]:
    """id(module) -> what each leaf module computes (abp's own modules are left out, and so are
    parametrized modules and their parametrization modules: what they compute is not their own)."""
    found: Dict[int, Any] = {}
    skip = {id(m) for p in model.modules() if parametrize.is_parametrized(p) for m in p.parametrizations.modules()}
    for module in model.modules():
        if id(module) in found or id(module) in skip or type(module).__module__.startswith("abp."):
            continue
        spec = _recognise.recognise(module)
        if spec is not None:
            found[id(module)] = spec
    return found


def _example_call(example_inputs: Any, example_kwargs: Any) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    if example_inputs is None and example_kwargs is None:
        return None
    if isinstance(example_inputs, Tensor):
        args: Tuple[Any, ...] = (example_inputs,)
    elif example_inputs is None:
        args = ()
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    else:
        hint = "; pass keyword arguments as example_kwargs=" if isinstance(example_inputs, Mapping) else ""
        raise TypeError(f"example_inputs: expected a tensor or a tuple of positional arguments, got "
                        f"{type(example_inputs).__name__}{hint}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs: expected a dict (a mapping) of keyword arguments, got {type(example_kwargs).__name__}")
    return args, dict(example_kwargs or {})


def _dummy_call(model: nn.Module) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """The call a model carries for itself (transformers' ``model.dummy_inputs``: a dict of tensors),
    on the device of its parameters; None where it has none."""
    try:
        dummy = getattr(model, "dummy_inputs", None)
    except Exception:  # a property that fails for this configuration
        return None
    if not isinstance(dummy, Mapping) or not dummy or not all(isinstance(v, Tensor) for v in dummy.values()):
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        return None
    return (), {k: v.to(device) for k, v in dummy.items()}


def _record(model: nn.Module, call: Tuple[Tuple[Any, ...], Dict[str, Any]], watch: List[str]) -> _structure.Structure:
    try:
        structure = _structure.record(model, call[0], call[1], watch)
    except Exception as e:
        raise RuntimeError(f"example_inputs/example_kwargs: the example call failed ({type(e).__name__}: {e})") from e
    if watch and any(m.training for m in model.modules()):
        # In-place writes to a watched output that the model makes in training only (a router's
        # noise, SwitchTransformers'): one more call in the model's own modes finds them. A
        # failure or a warning of that call (a checkpointing branch without gradients) is its own.
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trained = _structure.record(model, call[0], call[1], watch, as_trained=True)
        except Exception:
            return structure
        for name, where in trained.modified.items():
            known = structure.modified.setdefault(name, [])
            known.extend(w for w in where if w not in known)
    return structure


def _norm_names(model: nn.Module, recognised: Dict[int, Any]) -> List[str]:
    return [n for n, m in model.named_modules() if n and isinstance(recognised.get(id(m)), Norm)]


def _roles(model: nn.Module, recognised: Dict[int, Any], structure: Optional[_structure.Structure]
           ) -> Optional[Tuple[Dict[str, str], str, List[str]]]:
    """For recipe "sampled" with layers=None: the linear maps to sample, found from the example call's
    `structure`, or from the model's own dummy call, that call, and the blocks holding linear maps
    it never ran; None where neither ran (names are used then)."""
    source = "the example call"
    if structure is None:
        call = _dummy_call(model)
        if call is None:
            return None
        try:
            structure = _structure.record(model, call[0], call[1], [])
        except Exception:  # the model's dummy call does not fit this configuration: fall back to names
            return None
        source = "the model's dummy_inputs call"
    chosen = _roles_of(model, structure, recognised)
    return chosen, source, _idle_blocks(model, structure, recognised, chosen)


def _convert_lowmembp(
    model: nn.Module, options: Dict[str, Any], recognised: Dict[int, Any], call: Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]],
    structure: Optional[_structure.Structure], chosen: Set[str],
) -> List[Change]:
    """`chosen`: the activation options (_ACTIVATION_OPTIONS) the caller set, which convert then leaves as set."""
    modules = dict(model.named_modules())
    paths = _paths(model)
    owners = _parameter_owners(model)
    norms = {n: m for n, m in modules.items() if n and isinstance(recognised.get(id(m)), Norm)}
    affine = any(recognised[id(m)].weight is not None or recognised[id(m)].bias is not None for m in norms.values())
    if options["norms"] and options["fold"] and affine and call is None:
        raise ValueError("fold=True: pass example_inputs= (a tensor or a tuple of positional arguments) and/or "
                         "example_kwargs= (a dict): one call the model accepts, run once to see which layers read "
                         "each norm's output")
    changes: List[Change] = []
    dataflow = _dataflow.Dataflow(structure, {id(b) for b in model.buffers()}) if structure is not None else None
    # Computed once: every activation's bypass test counts them in its branch.
    replaceable = dataflow.outputs([n for n, m in modules.items()
                                    if n and _option_of(recognised.get(id(m))) in _TWO_BIT_OPTIONS]) if dataflow else set()
    normalized = dataflow.outputs([n for n, m in modules.items() if n and isinstance(recognised.get(id(m)), Norm)]) \
        if dataflow else set()
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    # The generated activations have float32, float16 and bfloat16 kernels (the norms run float64
    # too): a float64 model would fail at its first forward.
    activations_refused = "the model's parameters are float64, which abp's activation kernels do not take " \
        "(float32, float16 and bfloat16; the norms take float64 too)" if floating == {torch.float64} else None
    for name, module in modules.items():
        if name and parametrize.is_parametrized(module):
            inner = ", ".join(module.parametrizations.keys())
            changes.append(Change(name, "refused", f"{type(module).__name__} not converted: its parameters ({inner}) are "
                                  "parametrized (torch.nn.utils.parametrize); what it computes is not its own"))
            continue
        spec = recognised.get(id(module))
        if not name or spec is None:
            continue
        if isinstance(spec, Norm) and options["norms"]:
            changes += _convert_norm(model, name, module, spec, options["fold"], structure, modules, recognised,
                                     owners, paths[id(module)])
        elif isinstance(spec, (Activation, Unknown)):
            automatic = _option_of(spec) in _TWO_BIT_OPTIONS and _option_of(spec) not in chosen
            chain = _compounding_path(model, name, modules, dataflow, replaceable, normalized) if automatic else None
            idle = dataflow is not None and not any(dataflow.calls.get(p) for p in paths[id(module)])
            changes += _convert_activation(model, name, module, spec, options, paths[id(module)], activations_refused, chain,
                                           idle)
    return changes


def _compiled_module(model: nn.Module) -> Optional[nn.Module]:
    """The module torch.compile(model) wraps (an OptimizedModule's), or None for any other module."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module) and hasattr(model, "dynamo_ctx"):
        return inner
    return None


def _dynamo_context(compiled_call: Callable[..., Any]) -> Optional[Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """The torch.compile context (its backend, mode and options) that made `compiled_call`, the
    function nn.Module.compile() stores, from the wrapper's closure; None where this torch keeps it
    elsewhere."""
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:
        return None
    for cell in getattr(compiled_call, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


def _compiled_in_place(model: nn.Module) -> Dict[str, Callable[..., Any]]:
    """The modules of `model` (itself included, as "") compiled in place by their own .compile()
    (torch >= 2.2; per layer, as torch advises for large models), by name: their compiled calls."""
    return {name: call for name, module in model.named_modules()
            if (call := getattr(module, "_compiled_call_impl", None)) is not None}


def _convert_compiled_in_place(model: nn.Module, compiled: Dict[str, Callable[..., Any]], recipe: Any, inplace: bool,
                               example_inputs: Any, example_kwargs: Any,
                               overrides: Dict[str, Any]) -> Tuple[nn.Module, List[Change]]:
    """convert of a model with modules compiled by their own .compile(): converted with every
    compiled call set aside (the example and the probes run eagerly, as for torch.compile's
    wrapper), which are then put back, or, on a copy (deepcopy drops them), made again for the
    module of the same name by the same context. A call made with compile(disable=True) is the
    module's own: nothing to make again. A context this torch hides is replaced by .compile()'s
    defaults, with a warning; a module that convert replaced is not compiled again (its
    replacement is abp's)."""
    modules = dict(model.named_modules())
    for name in compiled:
        modules[name]._compiled_call_impl = None
    try:
        converted, changes = convert(model, recipe, inplace=inplace, example_inputs=example_inputs,
                                     example_kwargs=example_kwargs, **overrides)
    finally:
        for name, call in compiled.items():
            modules[name]._compiled_call_impl = call
    if converted is model:
        return converted, changes
    copies = dict(converted.named_modules())
    hidden = []
    for name, call in compiled.items():
        copy_of = copies.get(name)
        if copy_of is None or type(copy_of) is not type(modules[name]) or getattr(call, "__self__", None) is modules[name]:
            continue
        context = _dynamo_context(call)
        if context is not None:
            copy_of._compiled_call_impl = context(copy_of._call_impl)
        else:
            hidden.append(name or type(model).__name__)
            copy_of.compile()
    if hidden:
        warnings.warn(f"abp.convert: {', '.join(hidden)} was compiled with .compile(), whose options this torch does not "
                      "expose; the converted copy is compiled with .compile()'s defaults (call .compile(...) on it "
                      "again for others)", stacklevel=3)
    return converted, changes


def convert(
    model: nn.Module, recipe: Union[str, Sequence[str]] = "lowmembp", *, inplace: bool = False,
    example_inputs: Any = None, example_kwargs: Optional[Dict[str, Any]] = None, **overrides: Any,
) -> Tuple[nn.Module, List[Change]]:
    """Applies ``recipe`` (a name, a list of names, or "all") to ``model``; returns (converted model,
    what was changed and refused).

    Recipe "lowmembp" overrides: ``norms=False`` keeps every norm; ``fold=True`` folds norm affines
    into the linear layers that alone read their output (needs ``example_inputs`` and/or
    ``example_kwargs``, one call the model accepts); ``gelu=`` / ``silu=`` choose the replacement by
    abp operator name (``"regelu2"`` / ``"resilu2"`` by default, ``"gelu_b3"`` / ``"silu_b3"`` by default
    on a path no residual add bypasses, ``"silu_b2_uniform"``, ...; a value given
    applies everywhere; the GELU's erf or tanh form is the module's own) or switch it off with ``None``;
    ``other_activations=`` (3) the bits of the FewBit derivative of Hardswish, Mish, ELU/CELU, SELU,
    Softplus, LogSigmoid, Softsign and Tanhshrink (1-4, or None to keep them);
    ``leaky_relu=False`` keeps LeakyReLUs.
    Recipe "sampled" overrides: ``method=`` ("wtacrs", "crs", "uniform", "gaussian", "rademacher"),
    ``keep=`` (0.3) and ``layers=`` (None: the attention-output and feed-forward projections, found
    from one call of the model — the example, else ``model.dummy_inputs`` — or by SAMPLED_LAYERS
    when none can run; or fnmatch patterns of module names, e.g. ``["*.lora_A*"]``).
    Recipe "compress" overrides: ``bits=`` (8), ``group_size=`` (256) and ``allow_low_bits=`` (False:
    ``bits`` 1 or 2 raise ValueError) of ``compress_saved``.
    With ``inplace=False`` (default) the model is deep-copied first, so the original stays usable
    as a baseline. A ``torch.compile``'d model is converted through the module it wraps (the example
    runs eagerly) and comes back compiled the same way; so do modules compiled in place by their own
    ``.compile()`` (the model, or each of its layers).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    inner = _compiled_module(model)
    if inner is not None:
        # torch.compile's wrapper: its module is converted (the example runs eagerly: traced, each
        # probe would compile the model again), and the result is compiled as the model was.
        converted, changes = convert(inner, recipe, inplace=inplace, example_inputs=example_inputs,
                                     example_kwargs=example_kwargs, **overrides)
        return (model if converted is inner else type(model)(converted, model.dynamo_ctx)), changes
    compiled = _compiled_in_place(model)
    if compiled:
        return _convert_compiled_in_place(model, compiled, recipe, inplace, example_inputs, example_kwargs, overrides)
    recipes = _recipes(recipe)
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace: expected True or False, got {inplace!r}")
    options = _check_overrides(recipes, overrides)
    call = _example_call(example_inputs, example_kwargs)
    if vcas.Controller.attached(model) is not None:
        # Its samplers are the model's Linears: a copy would take a copy of the controller, which
        # nobody calibrates (the caller's calibrates the original), and recipe sampled finds no
        # Linear to sample. Built after convert, it samples what convert left.
        raise RuntimeError("model: has an abp.vcas.Controller (its samplers replace the blocks' Linears); convert "
                           "first, then build the controller on the model convert returns (or call the "
                           "controller's remove() before converting)")
    # Under torch.inference_mode the copy's parameters would be inference tensors, which no
    # training can use (nor convert's count of saved bytes).
    with torch.inference_mode(False):
        if not inplace:
            try:
                original, model = model, copy.deepcopy(model)
            except Exception as e:  # e.g. old-style weight_norm keeps a non-leaf weight tensor
                raise RuntimeError(f"model: could not be deep-copied ({type(e).__name__}: {e}); "
                                   "pass inplace=True to convert it in place") from e
            _stale_optimizer.note_copied(original)  # an optimizer built before would step the original
        with _structure.own_rng(model):  # probes may draw (a Dropout in training mode)
            recognised = _recognise_all(model) if ("lowmembp" in recipes or "sampled" in recipes) else {}
        # One recorded call serves the folds and the sampled layers' roles; it runs on the model as the
        # caller gave it, before any module is replaced.
        norms = _norm_names(model, recognised) if "lowmembp" in recipes and options["norms"] else []
        by_role = "sampled" in recipes and options["layers"] is None
        # The call also shows which activations no residual add bypasses (_compounding_path).
        structure = _record(model, call, norms) if call is not None and (norms or by_role or "lowmembp" in recipes) else None
        roles = _roles(model, recognised, structure) if by_role else None
        before = dict(model.named_modules(remove_duplicate=False))
        changes: List[Change] = []
        chosen = {k for k in _ACTIVATION_OPTIONS if k in overrides}
        if "lowmembp" in recipes:
            changes += _convert_lowmembp(model, options, recognised, call, structure, chosen)
        if "sampled" in recipes:
            changes += _convert_sampled(model, options, recognised, roles)
        if "compress" in recipes:
            changes += _convert_compress(model, options)
        changes = _keep_what_saves(model, changes, before, options, chosen, recognised, call)
        if not any(True for _ in model.children()) and {"lowmembp", "sampled"} & set(recipes):
            # Replacements take the place of a module in its parent; a model without submodules
            # has nothing convert can replace, and an empty list would not say so.
            changes.append(Change("", "refused", f"the model is itself a {type(model).__name__} without submodules; "
                                  f"recipe {' and '.join(r for r in recipes if r in ('lowmembp', 'sampled'))} replaces "
                                  "modules inside a model (their parent then holds the replacement): convert a model "
                                  "that contains it, e.g. nn.Sequential(module), or build the abp.nn module directly"))
        return model, changes or _converted_before(model, recipes)


def _converted_before(model: nn.Module, recipes: Sequence[str]) -> List[Change]:
    """The one change of a convert that changed nothing on a model an earlier convert converted
    (an empty list would not say why); none where no module is abp's."""
    ours = [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("abp.")]
    if not ours:
        return []
    return [Change("", "refused", f"recipe {' and '.join(recipes)}: nothing left to replace; {len(ours)} module(s) are "
                   f"abp's already ({', '.join(sorted(set(ours)))}: an earlier convert's), which convert leaves as they are")]
