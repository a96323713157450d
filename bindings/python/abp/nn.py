"""Drop-in activation modules (torch.nn names) whose backward saves k-bit codes instead of the input.

Each module runs one manifest operator (``.operator``) and exposes the derivative it uses:

- ``.borders`` and ``.levels`` (float32 tensors). For bucket operators (ReGELU2, ReSiLU2, FewBit) these
  are the manifest's table: code(x) = #{i : borders[i] < x} and dx = levels[code(x)] * dy. For the
  exact piecewise-linear operators the code is one bit (docs/algorithms.md §2.1), ``.borders`` are the
  breakpoints that define it and ``.levels`` are ``[derivative where the bit is 0, where it is 1]``;
  see each class for the bit.

``inplace=True`` writes the result into the input, as torch's modules do (the codes backward
keeps are taken from the input before it is written), so a model that reads the input after the
call sees what it saw with torch's module.
"""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from . import _custom_ops, _lib, functional, sampling
from ._launch import bind_arguments, check_param
from ._manifest import Operator
from .autograd import NotScriptable
from .compress import check_generator

__all__ = [
    "ReGELU2",
    "ReSiLU2",
    "GELU",
    "SiLU",
    "CELU",
    "ELU",
    "Hardswish",
    "LogSigmoid",
    "Mish",
    "SELU",
    "Sigmoid",
    "Softplus",
    "Softsign",
    "Tanh",
    "Tanhshrink",
    "ReLU",
    "ReLU6",
    "Hardsigmoid",
    "LeakyReLU",
    "Threshold",
    "Hardtanh",
    "Hardshrink",
    "Softshrink",
    "MSLayerNorm",
    "MSRMSNorm",
    "SampledConv1D",
    "SampledLinear",
    "Apply",
]


def _f32(values: List[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float32)


class AbpActivation(NotScriptable, torch.nn.Module):
    """Base class: runs manifest operator ``operator`` with f32 ``params`` on its input."""

    operator: str
    params: Tuple[float, ...]

    def __init__(self, operator: str, params: Tuple[float, ...] = (), inplace: bool = False) -> None:
        super().__init__()
        self.operator = operator
        self.params = tuple(float(p) for p in params)
        self.inplace = functional.check_inplace(inplace)
        # Fails here, with the list of known operators, if the kernel library lacks this one.
        _lib.kernel_library().operator(operator)

    def _record(self) -> Operator:
        return _lib.kernel_library().operator(self.operator)

    #: Write the result into the input, as torch's ``inplace=True`` activations do.
    inplace: bool = False

    def forward(self, input: Tensor) -> Tensor:
        try:
            output = functional.apply(self.operator, input, self.params)
        except TypeError as e:  # a wrong dtype or type: say which module of the user's model it is
            raise TypeError(f"{type(self).__name__} ({self.operator}): {e}") from e
        # functional.in_place, inline: this runs on every call of every activation.
        return input.copy_(output) if self.inplace else output

    @property
    def saved_bits_per_element(self) -> float:
        """Bits the backward keeps per input element: the sum over the operator's per-element
        residuals (codes and dense tensors) of the manifest; scalar residuals add nothing."""
        return float(sum(r.bits or 0 for r in self._record().residuals if r.kind != "scalar"))

    @property
    def borders(self) -> Tensor:
        """The inner borders of the derivative table (float32), as the kernels compare them."""
        return _f32(list(self._record().tables[0].borders))

    @property
    def levels(self) -> Tensor:
        """The derivative levels indexed by the saved code (float32), as the kernels use them."""
        return _f32(list(self._record().tables[0].levels))

    def extra_repr(self) -> str:
        return f"operator={self.operator}, saved_bits_per_element={self.saved_bits_per_element:g}"


class ReGELU2(AbpActivation):
    """Exact GELU forward; ReGELU2 backward (2-bit codes, LowMemoryBP; docs/algorithms.md §4).

    ``approximate`` as torch.nn.GELU: "none" (erf form, operator ``regelu2``) or "tanh" (tanh form,
    operator ``regelu2_tanh``, its table fitted to that form by tools/regelu2_fit.py).
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__(functional.gelu_form(approximate)[1])
        self.approximate = approximate

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, {super().extra_repr()}"


class ReSiLU2(AbpActivation):
    """Exact SiLU forward; ReSiLU2 backward (2-bit codes, LowMemoryBP; docs/algorithms.md §4)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__("resilu2", inplace=inplace)


class _FewBit(AbpActivation):
    """A FewBit continuous activation: exact forward, ``bits``-bit table derivative backward."""

    activation: str = ""

    def __init__(self, *, bits: int = 3, weight: str = "normal", activation: Optional[str] = None,
                 inplace: bool = False) -> None:
        # `activation` overrides the class's table family (GELU's tanh form: "gelu_tanh").
        family = activation or self.activation
        super().__init__(functional.fewbit_operator(family, bits, weight), inplace=inplace)
        self.activation = family
        self.bits = bits
        self.weight = weight

    def extra_repr(self) -> str:
        return f"bits={self.bits}, weight={self.weight!r}, operator={self.operator}"


def _require_default(module: str, name: str, value: Any, default: float) -> None:
    if check_param(name, value) != default:
        raise ValueError(
            f"{name}: abp.nn.{module} supports only {name}={default:g} (got {value!r}): its k-bit derivative "
            f"tables are fitted for torch's default {name}; use torch.nn.{module} for other values"
        )


class GELU(_FewBit):
    """GELU, erf form (``approximate="none"``) or tanh form (``"tanh"``, operators
    ``gelu_tanh_b<bits>``); FewBit ``bits``-bit backward with the tables fitted for that form."""

    activation = "gelu"

    def __init__(self, approximate: str = "none", *, bits: int = 3, weight: str = "normal") -> None:
        super().__init__(bits=bits, weight=weight, activation=functional.gelu_form(approximate)[0])
        self.approximate = approximate

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, {super().extra_repr()}"


class SiLU(_FewBit):
    """SiLU; FewBit ``bits``-bit backward."""

    activation = "silu"

    def __init__(self, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> None:
        super().__init__(bits=bits, weight=weight, inplace=inplace)


class CELU(_FewBit):
    """CELU (alpha=1 only: the tables' parameter); FewBit ``bits``-bit backward."""

    activation = "celu"

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> None:
        _require_default("CELU", "alpha", alpha, 1.0)
        super().__init__(bits=bits, weight=weight, inplace=inplace)


class ELU(_FewBit):
    """ELU (alpha=1 only: the tables' parameter); FewBit ``bits``-bit backward."""

    activation = "elu"

    def __init__(self, alpha: float = 1.0, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> None:
        _require_default("ELU", "alpha", alpha, 1.0)
        super().__init__(bits=bits, weight=weight, inplace=inplace)


class Hardswish(_FewBit):
    """Hardswish; FewBit ``bits``-bit backward."""

    activation = "hardswish"

    def __init__(self, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> None:
        super().__init__(bits=bits, weight=weight, inplace=inplace)


class LogSigmoid(_FewBit):
    """LogSigmoid; FewBit ``bits``-bit backward."""

    activation = "logsigmoid"


class Mish(_FewBit):
    """Mish; FewBit ``bits``-bit backward."""

    activation = "mish"

    def __init__(self, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> None:
        super().__init__(bits=bits, weight=weight, inplace=inplace)


class SELU(_FewBit):
    """SELU; FewBit ``bits``-bit backward."""

    activation = "selu"

    def __init__(self, inplace: bool = False, *, bits: int = 3, weight: str = "normal") -> None:
        super().__init__(bits=bits, weight=weight, inplace=inplace)


class Sigmoid(_FewBit):
    """Sigmoid; FewBit ``bits``-bit backward."""

    activation = "sigmoid"


class Softplus(_FewBit):
    """Softplus (beta=1, threshold=20 only: the tables' parameters); FewBit ``bits``-bit backward."""

    activation = "softplus"

    def __init__(self, beta: float = 1.0, threshold: float = 20.0, *, bits: int = 3, weight: str = "normal") -> None:
        _require_default("Softplus", "beta", beta, 1.0)
        _require_default("Softplus", "threshold", threshold, 20.0)
        super().__init__(bits=bits, weight=weight)


class Softsign(_FewBit):
    """Softsign; FewBit ``bits``-bit backward."""

    activation = "softsign"


class Tanh(_FewBit):
    """Tanh; FewBit ``bits``-bit backward."""

    activation = "tanh"


class Tanhshrink(_FewBit):
    """Tanhshrink; FewBit ``bits``-bit backward."""

    activation = "tanhshrink"


class _Piecewise(AbpActivation):
    """A piecewise-linear activation with its exact derivative in one bit per element."""

    def _table(self) -> Tuple[List[float], List[float]]:
        raise NotImplementedError

    @property
    def borders(self) -> Tensor:
        """The breakpoints that define the saved bit (float32)."""
        return _f32(self._table()[0])

    @property
    def levels(self) -> Tensor:
        """The derivative where the saved bit is 0 and where it is 1 (float32)."""
        return _f32(self._table()[1])

    def extra_repr(self) -> str:
        names = self._record().params
        return ", ".join(f"{n}={v:g}" for n, v in zip(names, self.params))


class ReLU(_Piecewise):
    """ReLU; bit = !(x <= 0) (NaN passes dy, as torch's threshold_backward)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__("relu", inplace=inplace)

    def _table(self) -> Tuple[List[float], List[float]]:
        return [0.0], [0.0, 1.0]


class ReLU6(_Piecewise):
    """ReLU6; bit = !(x <= 0 or x >= 6) (torch's hardtanh_backward)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__("relu6", inplace=inplace)

    def _table(self) -> Tuple[List[float], List[float]]:
        return [0.0, 6.0], [0.0, 1.0]


class Hardsigmoid(_Piecewise):
    """Hardsigmoid; bit = (-3 < x < 3); dx = dy * (1/6 in fp32) where the bit is set."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__("hardsigmoid", inplace=inplace)

    def _table(self) -> Tuple[List[float], List[float]]:
        return [-3.0, 3.0], [0.0, 1.0 / 6.0]


class LeakyReLU(_Piecewise):
    """LeakyReLU; bit = (x > 0); dx = dy where set, dy * negative_slope elsewhere."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
        super().__init__("leaky_relu", (check_param("negative_slope", negative_slope),), inplace=inplace)
        self.negative_slope = negative_slope

    def _table(self) -> Tuple[List[float], List[float]]:
        return [0.0], [self.params[0], 1.0]


class Threshold(_Piecewise):
    """Threshold (y = x if x > threshold else value); bit = (x > threshold)."""

    def __init__(self, threshold: float, value: float, inplace: bool = False) -> None:
        super().__init__("threshold", (check_param("threshold", threshold), check_param("value", value)),
                         inplace=inplace)
        self.threshold = threshold
        self.value = value

    def _table(self) -> Tuple[List[float], List[float]]:
        return [self.params[0]], [0.0, 1.0]


class Hardtanh(_Piecewise):
    """Hardtanh (clamp to [min_val, max_val]); bit = !(x <= min_val or x >= max_val)."""

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> None:
        lo, hi = check_param("min_val", min_val), check_param("max_val", max_val)
        if lo > hi:
            raise ValueError(f"min_val: expected min_val <= max_val, got min_val={min_val!r} > max_val={max_val!r}")
        super().__init__("hardtanh", (lo, hi), inplace=inplace)
        self.min_val = min_val
        self.max_val = max_val

    def _table(self) -> Tuple[List[float], List[float]]:
        return [self.params[0], self.params[1]], [0.0, 1.0]


class Hardshrink(_Piecewise):
    """Hardshrink; bit = !(-lambd <= x <= lambd)."""

    def __init__(self, lambd: float = 0.5) -> None:
        super().__init__("hardshrink", (check_param("lambd", lambd),))
        self.lambd = lambd

    def _table(self) -> Tuple[List[float], List[float]]:
        return [-self.params[0], self.params[0]], [0.0, 1.0]


class Softshrink(_Piecewise):
    """Softshrink; bit = !(-lambd <= x <= lambd)."""

    def __init__(self, lambd: float = 0.5) -> None:
        value = check_param("lambd", lambd)
        if not value >= 0:
            raise ValueError(f"lambd: expected a value >= 0 (as torch.nn.Softshrink), got {lambd!r}")
        super().__init__("softshrink", (value,))
        self.lambd = lambd

    def _table(self) -> Tuple[List[float], List[float]]:
        return [-self.params[0], self.params[0]], [0.0, 1.0]


class _MSNorm(NotScriptable, torch.nn.Module):
    """Base of the memory-sharing norms: backward from the output and one value per row.

    With ``elementwise_affine=True`` the module has torch.nn.LayerNorm's ``weight`` (gamma, ones) and,
    with ``bias=True``, ``bias`` (beta, zeros); backward recovers the normalised value from the output
    (abp._affine_norm). ``weight_offset`` makes the multiplier ``weight + weight_offset`` (1 for
    Gemma-style norms, whose weight starts at zeros). Under autocast an fp32 input gives an output in
    the autocast dtype, so the next Linear saves this very tensor; ``autocast_output=False`` keeps
    the input's dtype (for an output that also feeds a residual stream; abp.convert decides it
    from the consumers it sees).
    """

    operator: str

    def __init__(
        self, normalized_shape: Any, eps: float, elementwise_affine: bool = False, bias: bool = True,
        weight_offset: float = 0.0, device: Any = None, dtype: Any = None, autocast_output: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(autocast_output, bool):
            raise TypeError(f"autocast_output: expected True or False, got {autocast_output!r}")
        self.autocast_output = autocast_output
        self.normalized_shape: Tuple[int, ...] = functional.check_normalized_shape(normalized_shape)
        self.eps: float = functional.check_eps(eps)
        for name, flag in (("elementwise_affine", elementwise_affine), ("bias", bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected True or False, got {flag!r}")
        self.elementwise_affine = elementwise_affine
        self.weight_offset: float = functional.check_weight_offset(weight_offset)
        if self.weight_offset and not elementwise_affine:
            raise ValueError("weight_offset: needs elementwise_affine=True (gamma = weight + weight_offset)")
        self.weight: Optional[torch.nn.Parameter]
        self.bias: Optional[torch.nn.Parameter]
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """gamma = 1 (weight = 1 - weight_offset) and beta = 0, as torch's norms initialise theirs (and
        as a model made on the meta device and then materialised with to_empty() asks for)."""
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(1.0 - self.weight_offset)
            if self.bias is not None:
                self.bias.zero_()

    def _check_gamma(self) -> None:
        """At the first training call, one host read: features whose gamma (weight + weight_offset)
        is 0 lose their gradients (abp._affine_norm), so a weight set to 0 there would never leave
        it. Warns once, naming them. Not while torch.compile traces (its dynamo before 2.5 could not
        trace the flag's setattr under fullgraph=True); the first eager call checks."""
        if _custom_ops.compiling() or self.__dict__.get("_gamma_checked"):
            return
        weight = self.weight
        if weight is None:
            self._gamma_checked = True
            return
        if not self.training or not weight.requires_grad or not torch.is_grad_enabled() or weight.device.type == "meta":
            return
        self._gamma_checked = True
        zero = (weight.detach() + self.weight_offset) == 0
        count = int(zero.sum())
        if count:
            where = zero.flatten().nonzero().flatten()[:8].tolist()
            warnings.warn(
                f"{type(self).__name__}: gamma (weight + weight_offset) is 0 at {count} of {zero.numel()} features "
                f"(flat indices {where}{', ...' if count > 8 else ''}). The memory-sharing backward recovers the "
                "normalised value as (y - bias) / gamma, so there it is lost: the gradients of the input and of "
                "the weight at those features are wrong (the weight's is 0, so a weight initialised at 0 never "
                "leaves it). Initialise the weight non-zero, or use torch's norm for this layer (abp.convert "
                "refuses such norms)", RuntimeWarning, stacklevel=2)

    def forward(self, input: Tensor) -> Tensor:
        if not self.__dict__.get("_gamma_checked"):  # one dict read on every call after the first
            self._check_gamma()
        # functional.ms_layer_norm / ms_rms_norm without their one extra call.
        return functional._ms_norm(self.operator, input, self.normalized_shape, self.eps, self.weight, self.bias,
                                   self.weight_offset, self.autocast_output)

    @property
    def saved_bits_per_row(self) -> float:
        """Bits this module saves per row beyond its output (one fp32 statistic: 32)."""
        return _lib.kernel_library().operator(self.operator).saved_bits_per_row

    def extra_repr(self) -> str:
        text = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        if self.elementwise_affine:
            text += f", bias={self.bias is not None}"
        if not self.autocast_output:
            text += ", autocast_output=False"
        return text + (f", weight_offset={self.weight_offset}" if self.weight_offset else "")


class MSLayerNorm(_MSNorm):
    """LayerNorm whose backward reads only its output (shared with the next Linear) and 1/sigma per
    row (docs/algorithms.md §5); with ``elementwise_affine=True`` a drop-in for torch.nn.LayerNorm (same
    parameters and state_dict; the default is no affine, unlike torch's)."""

    operator = "ms_layernorm"

    def __init__(
        self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = False, bias: bool = True,
        weight_offset: float = 0.0, device: Any = None, dtype: Any = None, autocast_output: bool = True,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, weight_offset, device, dtype, autocast_output)


class MSRMSNorm(_MSNorm):
    """RMSNorm whose backward reads only its output and one value per row; with
    ``elementwise_affine=True`` a drop-in for torch.nn.RMSNorm given a numeric eps (the default is
    no affine, unlike torch's; ``bias=False`` by default, as RMSNorms have none)."""

    operator = "ms_rmsnorm"

    def __init__(
        self, normalized_shape: Any, eps: float = 1e-6, elementwise_affine: bool = False, bias: bool = False,
        weight_offset: float = 0.0, device: Any = None, dtype: Any = None, autocast_output: bool = True,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, weight_offset, device, dtype, autocast_output)


class _SampledRows:
    """What both sampled layouts share: the method, keep, generator and gradient-norm cache, and a
    training forward whose backward estimates dW from a sample of the input's token rows."""

    method: str
    keep: float
    generator: Optional[torch.Generator]
    grad_norm_cache: Optional[Tuple[Any, int]]
    training: bool
    bias: Optional[torch.nn.Parameter]

    def _set_sampling(self, method: str, keep: float, generator: Optional[torch.Generator]) -> None:
        self.method = sampling.check_method(method)
        self.keep = sampling.check_keep(keep)
        self.generator = check_generator(generator)
        # (cache, slot) once a sampling.GradNormCache is attached: p ∝ ‖x_t‖·‖dY_t‖ of the last visit.
        self.grad_norm_cache = None

    def _sampled(self, input: Tensor, weight: Tensor) -> Tensor:
        """F.linear(input, weight, bias); in training with gradients on, dW estimated from sampled rows."""
        if not self.training:
            return torch.nn.functional.linear(input, weight, self.bias)
        gamma = record = None
        if self.grad_norm_cache is not None and torch.is_grad_enabled():
            cache, slot = self.grad_norm_cache
            rows = input.numel() // input.shape[-1] if input.dim() and input.shape[-1] else 0
            gamma, record = cache.lookup(slot, rows, input.device)
        return sampling.sampled_linear(input, weight, self.bias, method=self.method, keep=self.keep,
                                       generator=self.generator, gamma=gamma, record=record)


def _sharing(cls: Any, source: torch.nn.Module, want: str, transposed: bool, method: str, keep: float,
             generator: Optional[torch.Generator]) -> Any:
    """A `cls` (a sampled layout) sharing `source`'s weight and bias Parameters (not copies), so an
    optimizer built on the original keeps updating them; `transposed`: the weight is (in, out)."""
    weight = getattr(source, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        raise TypeError(f"linear: expected {want} (or a module with a 2-D weight Parameter), got {type(source).__name__}")
    bias = getattr(source, "bias", None)
    in_f, out_f = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
    module = cls(in_f, out_f, bias=bias is not None, method=method, keep=keep, device="meta", generator=generator)
    module.weight = weight
    module.bias = bias
    module.train(source.training)
    return module


class SampledLinear(_SampledRows, NotScriptable, torch.nn.Linear):
    """nn.Linear whose backward estimates dW from a sample (or sketch) of the input's token rows,
    so forward saves about `keep` of the input (abp.sampling; docs/algorithms.md §3, §8).

    method: "wtacrs" (winner-take-all column-row sampling), "crs" / "uniform" (column-row
    sampling by ‖x_t‖ / uniformly), "gaussian" or "rademacher" (random sketches); keep ∈ (0, 1]. The output, dX and db are exact; dW is unbiased. Each
    training call draws its Philox key from `generator` (torch's default generator if None). In
    eval mode, or with gradients off, it is a plain Linear.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        method: str = "wtacrs",
        keep: float = 0.3,
        device: Any = None,
        dtype: Any = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        self._set_sampling(method, keep, generator)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_linear(
        cls, linear: torch.nn.Module, method: str = "wtacrs", keep: float = 0.3,
        generator: Optional[torch.Generator] = None,
    ) -> "SampledLinear":
        """A SampledLinear sharing the torch.nn.Linear `linear`'s weight and bias Parameters (not
        copies), so an optimizer built on the original keeps updating them."""
        weight = getattr(linear, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__} "
                            "(abp.nn.SampledConv1D.from_conv1d takes x @ W layouts)")
        return _sharing(cls, linear, "a torch.nn.Linear", False, method, keep, generator)

    def forward(self, input: Tensor) -> Tensor:
        return self._sampled(input, self.weight)

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        # A model pickled before SampledConv1D existed holds a SampledLinear with transposed=True
        # (the weight kept as (in, out)): it loads as the SampledConv1D it is.
        if self.__dict__.pop("transposed", False):
            self.__class__ = SampledConv1D  # type: ignore[assignment]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method!r}, keep={self.keep}"


class SampledConv1D(_SampledRows, NotScriptable, torch.nn.Module):
    """SampledLinear for the ``x @ weight + bias`` layout of transformers' Conv1D (GPT-2's
    projections): weight is (in_features, out_features), as there, so the state_dict is the
    Conv1D's. Not a torch.nn.Linear: code that reads a Linear's weight as (out, in) (peft's merge,
    pruning) must not take it for one."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        method: str = "wtacrs",
        keep: float = 0.3,
        device: Any = None,
        dtype: Any = None,
        generator: Optional[torch.Generator] = None,
    ) -> None:
        super().__init__()
        self._set_sampling(method, keep, generator)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(in_features, out_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            torch.nn.init.normal_(self.weight, std=0.02)  # as transformers' Conv1D

    @property
    def nf(self) -> int:
        """transformers' Conv1D's name for out_features."""
        return self.out_features

    @property
    def nx(self) -> int:
        """transformers' Conv1D's name for in_features."""
        return self.in_features

    @classmethod
    def from_conv1d(
        cls, conv1d: torch.nn.Module, method: str = "wtacrs", keep: float = 0.3,
        generator: Optional[torch.Generator] = None,
    ) -> "SampledConv1D":
        """A SampledConv1D sharing `conv1d`'s weight (in_features, out_features) and bias Parameters."""
        if isinstance(conv1d, torch.nn.Linear):  # its weight is (out, in): read as (in, out) it would be transposed
            raise TypeError("conv1d: got a torch.nn.Linear, whose weight is (out_features, in_features); "
                            "use abp.nn.SampledLinear.from_linear")
        return _sharing(cls, conv1d, "a module computing x @ weight + bias", True, method, keep, generator)

    def forward(self, input: Tensor) -> Tensor:
        return self._sampled(input, self.weight.t())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method!r}, keep={self.keep}")


#: The modules whose backward samples dW (isinstance checks).
SAMPLED_LAYERS = (SampledLinear, SampledConv1D)


class Apply(NotScriptable, torch.nn.Module):
    """An nn.Module running the manifest operator `operator` (the op library's, or one compiled at
    run time by ``abp.compile_operators``) with its parameters fixed, by position or by their
    manifest names: ``Apply("my_act", 0.1)`` or ``Apply("my_act", slope=0.1)``. forward takes the
    operator's tensor inputs in order and returns ``abp.functional.apply``'s result. No
    parameters or buffers of its own, so it drops into a model and its state dict unchanged."""

    operator: str
    params: Tuple[float, ...]

    def __init__(self, operator: str, *params: Any, **named: Any) -> None:
        super().__init__()
        if not isinstance(operator, str):
            raise TypeError(f"operator: expected an operator's name (a str), got {type(operator).__name__}")
        names = _lib.kernel_library().operator(operator).params  # unknown: the list of known ones
        given = bind_arguments(names, params, named, operator, takes=f"its parameters are {list(names)}")
        self.operator = operator
        self.params = tuple(check_param(f"{operator}: {n}", v) for n, v in zip(names, given))

    def forward(self, *inputs: Tensor) -> Any:
        return functional.apply(self.operator, inputs[0] if len(inputs) == 1 else inputs, self.params)

    def extra_repr(self) -> str:
        names = _lib.kernel_library().operator(self.operator).params
        return ", ".join([repr(self.operator)] + [f"{n}={v:g}" for n, v in zip(names, self.params)])
