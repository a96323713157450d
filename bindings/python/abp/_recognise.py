"""What a leaf module computes, found by running it on probes, not by its class (abp.convert).

A model's activations, norms and linear maps come in many classes (torch.nn's, transformers'
GELUActivation / NewGELUActivation / T5LayerNorm / LlamaRMSNorm / Conv1D, timm's, a user's own).
``recognise`` runs a leaf module on random probes in float64 (and float32) and compares the result
with the functions abp can replace:

- activations (no parameters, no buffers): GELU in erf form, GELU in tanh form, SiLU, the ReLU
  family (ReLU, LeakyReLU, ReLU6), Hardsigmoid, Sigmoid, Tanh, and the smooth activations with a
  FewBit table at torch's default parameters (Hardswish, Mish, ELU and CELU with alpha 1, SELU,
  Softplus with beta 1 and threshold 20, LogSigmoid, Softsign, Tanhshrink), elementwise within
  1e-6 relative in float64 and 1e-5 in float32; any other deterministic elementwise function
  (QuickGELU, an ELU of another alpha) is reported as an unknown activation;
- norms (one or two parameters of the same shape, the normalised one(s) last): LayerNorm or
  RMSNorm (mean-free), gamma = weight or 1 + weight (Gemma), with or without beta, fp32 upcasts
  included; probed with randomised parameter values so that no initial value (ones, zeros) hides
  which parameter is which; eps from the module's attributes or, failing that, estimated where it
  matters (inputs of mean square near eps) and verified;
- linear maps (a 2-D weight and an optional bias): y = x W^T + b (torch.nn.Linear, known without a
  probe) or y = x W + b (transformers' Conv1D), run in the module's own dtype and device and
  compared on a few output features, so the weight is never copied.

Norm probes run a CPU float64 copy of the module (small: one or two vectors), whatever its device,
meta included. Modules with one or two parameters of one 1-D (or declared ``normalized_shape``)
shape are probed as norms, so an embedding table is not.
"""
from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._launch import compute_dtype

__all__ = ["Activation", "LinearMap", "Norm", "Unknown", "recognise", "is_leaf"]

#: Attribute names under which modules keep their epsilon.
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


@dataclass(frozen=True)
class Activation:
    """An elementwise activation: kind is a key of ACTIVATION_NAMES ("gelu", "gelu_tanh", "silu",
    "relu", "leaky_relu", "hardswish", ...)."""

    kind: str
    slope: float = 0.0  # LeakyReLU's negative slope


@dataclass(frozen=True)
class Norm:
    """gamma * norm(x) + beta over the trailing ``shape``: kind is "layer" or "rms"."""

    kind: str
    shape: Tuple[int, ...]
    eps: float
    weight: Optional[str]  # the module's parameter names, or None
    bias: Optional[str]
    weight_offset: float  # gamma = weight + weight_offset (1.0 for Gemma-style norms)


@dataclass(frozen=True)
class LinearMap:
    """y = x W^T + b (``transposed`` False, W is (out, in)) or y = x W + b (True, W is (in, out))."""

    weight: str
    bias: Optional[str]
    transposed: bool
    in_features: int
    out_features: int


@dataclass(frozen=True)
class Unknown:
    """A deterministic elementwise function none of the known activations matches, or a module
    with a norm's parameters that computes no norm abp has (the reason says which)."""

    reason: str


Recognised = Union[Activation, Norm, LinearMap, Unknown]


def is_leaf(module: nn.Module) -> bool:
    return next(iter(module.children()), None) is None


def _close(got: Tensor, want: Tensor, rel: float) -> bool:
    if got.shape != want.shape:
        return False
    got, want = got.to(torch.float64), want.to(torch.float64)
    if not bool(torch.isfinite(got).all()):
        return False
    return bool(((got - want).abs() <= rel * (1 + want.abs())).all())


def _run(module: nn.Module, x: Tensor) -> Optional[Tensor]:
    """module.forward(x) without gradients (the user's hooks do not see probes); None if it fails
    or returns something other than one tensor."""
    try:
        with torch.no_grad():
            y = module.forward(x)
    except Exception:  # a module that cannot run on this probe is not the function we look for
        return None
    return y if isinstance(y, Tensor) else None


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------

_ACTIVATIONS: Dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "relu6": F.relu6,
    "hardsigmoid": F.hardsigmoid,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    # FewBit's other tables, each at the parameters it was fitted for (CELU with alpha 1 is ELU).
    "hardswish": F.hardswish,
    "mish": F.mish,
    "elu": F.elu,
    "selu": F.selu,
    "softplus": F.softplus,
    "logsigmoid": F.logsigmoid,
    "softsign": F.softsign,
    "tanhshrink": F.tanhshrink,
}

#: What each activation kind is called in messages.
ACTIVATION_NAMES: Dict[str, str] = {
    "gelu": "GELU", "gelu_tanh": "GELU (tanh form)", "silu": "SiLU", "relu": "ReLU", "relu6": "ReLU6",
    "hardsigmoid": "Hardsigmoid", "sigmoid": "Sigmoid", "tanh": "Tanh", "leaky_relu": "LeakyReLU",
    "hardswish": "Hardswish", "mish": "Mish", "elu": "ELU", "selu": "SELU", "softplus": "Softplus",
    "logsigmoid": "LogSigmoid", "softsign": "Softsign", "tanhshrink": "Tanhshrink",
}


def _activation_probe(dtype: torch.dtype) -> Tensor:
    g = torch.Generator().manual_seed(1234)
    dense = torch.linspace(-8, 8, 257, dtype=torch.float64)
    spread = torch.randn(3, 5, 17, generator=g, dtype=torch.float64) * 3
    # Far points: where Softplus's threshold (20) and the saturating ends of others show. 64 of
    # them keep the count a multiple of 64: torch's vectorised loops then leave no scalar tail,
    # whose last bits may differ, so the permutation test below compares like with like.
    far = torch.cat([torch.linspace(-40, -9, 32, dtype=torch.float64), torch.linspace(9, 40, 32, dtype=torch.float64)])
    return torch.cat([dense, spread.flatten(), far]).reshape(-1, 2).to(dtype)


def _recognise_activation(module: nn.Module) -> Optional[Recognised]:
    """Probed in training mode, the mode its replacement trains in (a model fresh from
    from_pretrained is in eval mode, where an RReLU is a LeakyReLU); the caller restores the mode."""
    module.train(True)
    outputs = {}
    for dtype in (torch.float64, torch.float32):
        x = _activation_probe(dtype)
        y = _run(module, x.clone())  # a clone: an in-place activation must not touch the probe
        if y is None or y.shape != x.shape or y.dtype != dtype:
            return None
        outputs[dtype] = (x, y)
    x64, y64 = outputs[torch.float64]
    x32, y32 = outputs[torch.float32]
    for kind, fn in _ACTIVATIONS.items():
        if _close(y64, fn(x64), 1e-6) and _close(y32, fn(x32), 1e-5):
            return Activation(kind)
    negative = x64 < 0
    if _close(y64[~negative], x64[~negative], 1e-12):
        slope = float(y64[x64 == -8].item() / -8)
        if 0 < abs(slope) < 1 and _close(y64, F.leaky_relu(x64, slope), 1e-9):
            return Activation("leaky_relu", slope)
    if _close(y64, x64, 0.0):
        return None  # the identity (Dropout in eval mode, Identity): nothing to replace
    # Deterministic and elementwise? Then it is an activation abp does not know.
    again = _run(module, x64.clone())
    perm = torch.randperm(x64.numel(), generator=torch.Generator().manual_seed(7))
    permuted = _run(module, x64.flatten()[perm].reshape(x64.shape).clone())
    if again is None or permuted is None:
        return None
    if not torch.equal(again, y64):
        return _random_in_training(module, x64)
    if not torch.equal(permuted.flatten(), y64.flatten()[perm]):
        return None
    return Unknown(_parameters_phrase(module) + _UNKNOWN_ACTIVATION)


def _random_in_training(module: nn.Module, x: Tensor) -> Optional[Recognised]:
    """A module that draws at random in training: Dropout and its kind (the identity in eval mode)
    are nothing to replace; one that computes an activation in eval mode (RReLU) is one that no
    fixed replacement trains like."""
    module.eval()
    y = _run(module, x.clone())
    if y is None or y.shape != x.shape or _close(y, x, 0.0):
        return None
    return Unknown("it draws at random in training mode (as RReLU's slope does), which no replacement with a fixed "
                   "derivative reproduces")


_UNKNOWN_ACTIVATION = ("an elementwise activation that is none of GELU (erf or tanh form), SiLU, the ReLU family "
                       "(ReLU, LeakyReLU, ReLU6), Hardsigmoid, Sigmoid, Tanh, or Hardswish, Mish, ELU/CELU (alpha 1), "
                       "SELU, Softplus (beta 1, threshold 20), LogSigmoid, Softsign, Tanhshrink")


def _parameters_phrase(module: nn.Module) -> str:
    """"with beta=2.0, threshold=20.0 it is ": the parameters the module shows (its extra_repr, the
    in-place flag left out), so that a Softplus or ELU at parameters FewBit has no table for says
    which; empty for a module that shows none."""
    try:
        shown = module.extra_repr()
    except Exception:  # a user's extra_repr that fails is not convert's to report
        return ""
    parts = [p.strip() for p in shown.split(",") if p.strip() and not p.strip().startswith("inplace")]
    return f"with {', '.join(parts)} it is " if parts else ""


# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------


def _normalise(kind: str, x: Tensor, dims: Tuple[int, ...], eps: float) -> Tensor:
    if kind == "layer":
        x = x - x.mean(dims, keepdim=True)
    return x / torch.sqrt(x.pow(2).mean(dims, keepdim=True) + eps)


def _eps_candidates(module: nn.Module, dtype: torch.dtype) -> List[float]:
    found = []
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(float(value))
        elif value is None and name == "eps" and isinstance(module, getattr(nn, "RMSNorm", ())):
            found.append(float(torch.finfo(dtype).eps))  # torch.nn.RMSNorm(eps=None)
    return found


def _estimate_eps(kind: str, probe: nn.Module, gamma: Tensor, beta: Optional[Tensor], shape: Tuple[int, ...]) -> Optional[float]:
    """eps from the output on rows whose mean square is comparable to eps (1 / s^2 - var)."""
    dims = tuple(range(-len(shape), 0))
    g = torch.Generator().manual_seed(99)
    for scale in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        x = torch.randn((4,) + shape, generator=g, dtype=torch.float64) * scale
        y = _run(probe, x)
        if y is None or y.shape != x.shape:
            return None
        n = (y.to(torch.float64) - (beta if beta is not None else 0)) / gamma
        centred = x - x.mean(dims, keepdim=True) if kind == "layer" else x
        var = centred.pow(2).mean(dims)
        s = (n * centred).sum(dims) / centred.pow(2).sum(dims)
        eps = 1 / s.pow(2) - var
        ratio = (eps / var).median().item()
        if 1e-2 <= ratio <= 1e2:
            return float(eps.median().item())
    return None


def _norm_matches(kind: str, probe: nn.Module, gamma: Tensor, beta: Optional[Tensor], shape: Tuple[int, ...], eps: float) -> bool:
    dims = tuple(range(-len(shape), 0))
    g = torch.Generator().manual_seed(5)
    for scale, shift in ((2.0, 0.5), (math.sqrt(eps), 0.0), (30.0, -3.0)):
        x = torch.randn((3,) + shape, generator=g, dtype=torch.float64) * scale + shift * scale
        y = _run(probe, x)
        if y is None:
            return False
        want = _normalise(kind, x, dims, eps) * gamma + (beta if beta is not None else 0)
        # Modules that compute in float32 internally (LLaMA's RMSNorm) are accurate to ~1e-7.
        if not _close(y, want, 1e-5):
            return False
    x32 = torch.randn((2, 3) + shape, generator=g)
    y32 = _run(probe.to(torch.float32), x32)
    probe.to(torch.float64)
    return y32 is not None and y32.dtype == torch.float32 and y32.shape == x32.shape


def _recognise_norm(module: nn.Module, params: Dict[str, nn.Parameter]) -> Optional[Norm]:
    shapes = {tuple(p.shape) for p in params.values()}
    if params:
        if len(params) not in (1, 2) or len(shapes) != 1:
            return None
        shape = shapes.pop()
    else:  # no affine: the width is the module's own normalized_shape, if it says
        declared = getattr(module, "normalized_shape", None)
        if not isinstance(declared, (tuple, list, torch.Size)) or not all(isinstance(d, int) for d in declared):
            return None
        shape = tuple(int(d) for d in declared)
    if not shape or math.prod(shape) < 2:
        return None
    # A CPU copy whatever the module's device (CUDA, meta): its parameters are set at random anyway.
    probe = copy.deepcopy(module)
    if any(p.device.type == "meta" for p in probe.parameters(recurse=False)):
        probe = probe.to_empty(device="cpu")
    probe = probe.to(device="cpu", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    values = {}
    for name, p in probe.named_parameters(recurse=False):
        # Random values: at initialisation (ones, zeros) gamma and beta could not be told apart.
        values[name] = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
        with torch.no_grad():
            p.copy_(values[name])
    names = list(values)
    assignments: List[Tuple[Optional[str], Optional[str]]] = [(None, None)]
    if len(names) == 1:
        assignments = [(names[0], None)]
    elif len(names) == 2:
        assignments = [(names[0], names[1]), (names[1], names[0])]
    # torch.nn.RMSNorm(eps=None) uses the epsilon of the dtype it computes in: float64's on the
    # probe; in the model, float32's for float32, float16 and bfloat16 parameters (half-precision
    # rows are normalised in float32), float64's for float64 ones.
    dtype_eps = isinstance(module, getattr(nn, "RMSNorm", ())) and getattr(module, "eps", 0) is None
    model_dtype = next(iter(params.values())).dtype if params else torch.get_default_dtype()
    for kind in ("layer", "rms"):
        for weight, bias in assignments:
            for offset in ((0.0, 1.0) if weight is not None else (0.0,)):
                gamma = values[weight] + offset if weight is not None else torch.ones(shape, dtype=torch.float64)
                beta = values[bias] if bias is not None else None
                if dtype_eps:
                    if _norm_matches(kind, probe, gamma, beta, shape, float(torch.finfo(torch.float64).eps)):
                        return Norm(kind, shape, float(torch.finfo(compute_dtype(model_dtype)).eps), weight,
                                    bias, offset)
                    continue
                candidates = _eps_candidates(module, torch.float32)
                estimate = _estimate_eps(kind, probe, gamma, beta, shape)
                if estimate is not None:
                    candidates.append(estimate)
                for eps in candidates:
                    if _norm_matches(kind, probe, gamma, beta, shape, eps):
                        return Norm(kind, shape, eps, weight, bias, offset)
    return None


# ---------------------------------------------------------------------------------------------
# Linear maps
# ---------------------------------------------------------------------------------------------


def _recognise_linear(module: nn.Module, params: Dict[str, nn.Parameter]) -> Optional[LinearMap]:
    matrices = [n for n, p in params.items() if p.dim() == 2]
    vectors = [n for n, p in params.items() if p.dim() == 1]
    if len(matrices) != 1 or len(vectors) > 1 or len(params) != len(matrices) + len(vectors):
        return None
    w_name = matrices[0]
    w = params[w_name]
    b_name = vectors[0] if vectors else None
    b = params[b_name] if b_name is not None else None
    if not w.is_floating_point() or w.device.type == "meta":
        return None
    rel = 1e-4 if w.dtype in (torch.float32, torch.float64) else 3e-2
    g = torch.Generator().manual_seed(11)
    for transposed in (False, True):
        in_f, out_f = (w.shape[0], w.shape[1]) if transposed else (w.shape[1], w.shape[0])
        if b is not None and b.shape[0] != out_f:
            continue
        x = torch.randn(2, 3, in_f, generator=g).to(device=w.device, dtype=w.dtype)
        y = _run(module, x)
        if y is None or y.shape != (2, 3, out_f):
            continue
        # The reference for a few output features: no copy of the whole weight (it may be large).
        cols = torch.randperm(out_f, generator=g)[:8].to(w.device)
        with torch.no_grad():
            rows = (w[:, cols].t() if transposed else w[cols]).to(torch.float64)
            want = x.to(torch.float64) @ rows.t()
            if b is not None:
                want = want + b[cols].to(torch.float64)
        got = y[..., cols].to(torch.float64)
        scale = want.abs().max().item() + 1e-30
        if bool(((got - want).abs() <= rel * scale).all()):
            return LinearMap(w_name, b_name, transposed, int(in_f), int(out_f))
    return None


def _normalises(module: nn.Module) -> bool:
    """True if a CPU float64 copy of `module` gives the same output for x and 10·x on an (N, C) or
    (N, C, H, W) input (C its parameters' length): a normalisation abp has no replacement for
    (channels-first, batch statistics), not a scale-and-shift such as LayerScale."""
    probe = copy.deepcopy(module)
    if any(p.device.type == "meta" for p in probe.parameters(recurse=False)):
        probe = probe.to_empty(device="cpu")
    probe = probe.to(device="cpu", dtype=torch.float64)
    c = next(probe.parameters()).shape[0]
    g = torch.Generator().manual_seed(17)
    for shape in ((6, c), (2, c, 3, 3)):
        x = torch.randn(shape, generator=g, dtype=torch.float64) + 0.3
        y, y10 = _run(probe, x), _run(probe, 10 * x)
        if y is None or y10 is None or y.shape != x.shape:
            continue
        # Compared at the output's own scale: a LayerScale initialised at 1e-5 gives outputs
        # within any absolute tolerance of each other, and scales them by 10 all the same.
        scale = float(y.abs().max())
        if scale > 0 and _close(y10 / scale, y / scale, 1e-4) and not _close(y, x, 1e-6):
            return True
    return False


#: Norms over more features than this are not probed (no model normalises rows that wide; an
#: embedding table with one 2-D parameter would otherwise be copied and probed as a norm).
_MAX_NORM_FEATURES = 1 << 20


def _may_be_norm(module: nn.Module, params: Dict[str, nn.Parameter]) -> bool:
    """One or two parameters of one shape that is 1-D or the module's declared normalized_shape."""
    if len(params) > 2 or len({tuple(p.shape) for p in params.values()}) != 1 or hasattr(module, "num_embeddings"):
        return False
    shape = tuple(next(iter(params.values())).shape)
    declared = getattr(module, "normalized_shape", None)
    declared = tuple(declared) if isinstance(declared, (tuple, list, torch.Size)) else None
    return (len(shape) == 1 or shape == declared) and 0 < math.prod(shape) <= _MAX_NORM_FEATURES


def _other_arguments(module: nn.Module) -> List[str]:
    """The named parameters of `module`'s forward besides its first (the input), defaults or not."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing to say
        return []
    named = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return [p.name for p in named[1:]]


def recognise(module: nn.Module) -> Optional[Recognised]:
    """What the leaf `module` computes, or None if it is none of the functions abp knows.

    Probes run the module's forward without gradients and without its hooks; the caller restores
    the random state (a module may draw, e.g. Dropout)."""
    if not is_leaf(module):
        return None
    found = _recognise_leaf(module)
    extra = _other_arguments(module)
    if not extra or found is None or isinstance(found, Unknown):
        return found
    # Probed with its input alone it computes a known function (a gated norm with gate=None), but
    # the model may pass the others, which a replacement taking one input would refuse or drop. A
    # module that needs the others (a rotary embedding's positions) computes nothing alone: None.
    return Unknown(f"with its input alone it computes {_describe(found)}, but its forward takes "
                   f"{', '.join(f'`{n}`' for n in extra)} besides its input, which abp's replacement would not take")


def _describe(found: Recognised) -> str:
    if isinstance(found, Activation):
        return ACTIVATION_NAMES[found.kind]
    if isinstance(found, Norm):
        return "LayerNorm" if found.kind == "layer" else "RMSNorm"
    return "a linear map"


def _recognise_leaf(module: nn.Module) -> Optional[Recognised]:
    """recognise's probes of a leaf, called with its input alone."""
    params = dict(module.named_parameters(recurse=False))
    if type(module) is nn.Linear and "forward" not in vars(module):
        # torch's own Linear runs F.linear(x, weight, bias): nothing to probe (and no weight to copy).
        return LinearMap("weight", "bias" if module.bias is not None else None, False,
                         module.in_features, module.out_features)
    training = module.training
    try:
        if not params:
            if next(iter(module.buffers()), None) is not None:
                return None
            return _recognise_activation(module) or _recognise_norm(module, params)
        if _may_be_norm(module, params):
            norm = _recognise_norm(module, params)
            if norm is not None:
                return norm
            if all(p.dim() == 1 for p in params.values()) and _normalises(module):
                return Unknown("its parameters look like a norm's (one or two vectors of one shape), but it computes "
                               "neither LayerNorm nor RMSNorm over the last dimension (a channels-first norm, "
                               "batch statistics or another normalisation)")
        if type(module).__module__ == nn.modules.activation.__name__:  # torch's PReLU
            return Unknown(f"its output depends on its learned parameters ({', '.join(params)}) besides its input; abp "
                           "replaces activations that are fixed functions of their input")
        if any(p.device.type == "meta" for p in params.values()):
            return None  # a linear map on the meta device cannot be run
        return _recognise_linear(module, params)
    finally:
        module.train(training)
