"""Per-op rules for compressed saved tensors: the fewest bits each op's saves may be stored at.

Stochastic rounding is unbiased, so a gradient stays unbiased where backward uses the saved
tensor linearly: a matmul's inputs, a product's factors, a mask. Fused scaled-dot-product
attention (torch >= 2: the flash, memory-efficient, cuDNN and CPU flash kernels) does not: its
backward recomputes the attention probabilities P = exp(q kᵀ · scale − lse) from the saved query,
key and row logsumexp, and D = rowsum(dO ∘ O) from its saved output. Codes of q and k that do not
match the stored logsumexp bias P multiplicatively (its rows no longer sum to one), and an output
that does not match P and v breaks D; on real tasks 2-bit codes of them made training diverge
(docs/compressed-training.md has the measurements).

Two remedies, by what the block can do:

* **Recomputed** (compress_saved's recompute, a kernel abp knows, no dropout): the output and
  logsumexp are recomputed from the decoded q, k and v (`attention_kernel`), so backward is exact
  at those values and nothing diverges. One width for every tensor still keeps q and k at 8 bits
  (measured, they cost the most per bit); per-tensor widths (the controller's) need no floor:
  the controller measures what each costs.
* **Stored**: q, k and the logsumexp at 8 bits at least, whatever the widths.

log_softmax (cross-entropy's first half) saves its output y, and its backward reads exp(y):
compress_saved stores it as the probabilities exp(y) (unbiased where backward reads them), at 8
bits under one width for every tensor (per bit, the most sensitive tensor of a language model),
at 4 under per-tensor widths: the controller's probes do not reach a loss computed outside the
model, and 2 bits cost a language model 0.6 % of its loss where 4 cost nothing (measured).

An activation checkpoint (`torch.utils.checkpoint.checkpoint`, reentrant or not; transformers'
gradient checkpointing calls it) saves its block's inputs, and backward runs the whole block
again from them: the block is as nonlinear in them as it is. Codes of them put the rounding
error into every tensor of the block's backward (a tiny LLaMA, 30 steps under the 2-bit
controller: a last loss of 2.615, against exact training's 2.197 and 2.421 with them kept), so
they are kept as they are, the memory checkpointing costs anyway. Such a save has no node of its
own that tells it (a non-reentrant checkpoint makes none): `saving_checkpoint_inputs()` tells it
by the function on the stack.

A reduction whose backward compares its saved input with its saved result (amax, max() of a whole
tensor, an infinity norm) keeps that input as it is, and compress_saved recomputes the result from
the input as backward reads it (`result_from_input`): codes of either side would match no element,
and the gradient would be NaN.

A kinked activation whose backward tests which piece its saved value lies on (LeakyReLU, PReLU,
RReLU, ELU, CELU, SELU: x > 0; ReLU6 and Hardtanh: min < x < max; Hardsigmoid; Hardswish: -3 <= x <= 3;
threshold, clamp, Hardshrink, Softshrink) reads a derivative that jumps there: codes of an element
near a breakpoint land on the other side as often as not, and its gradient is then wrong by the
jump (LeakyReLU's 1 against 0.01), not by a rounding error. The block keeps, beside the codes, one
bit per element saying whether the value was inside the op's interval (`region_of`), and decodes
each value onto its own side (compress.with_region), as it keeps a ReLU output's support.

A rule is found from the op's autograd node. An op saves its inputs before it runs and its
outputs after, so `compress_saved` holds one op's saves until the op is known (see there): a
saved output whose grad_fn is the node reveals it.
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

#: The fewest bits for what fused attention recomputes its probabilities from (query, key,
#: logsumexp). 8 bits is the narrowest width measured to train as exact training does.
FUSED_ATTENTION_MIN_BITS = 8


@dataclass(frozen=True)
class Floors:
    """Minimum bits for what one op saves; None: any width.

    `inputs[i]` is for the op's i-th input (its node's i-th next function); `outputs` for the
    op's differentiable outputs; `other` for the rest (outputs that carry no gradient, such as a
    logsumexp, and inputs that cannot be matched to a position).
    """

    inputs: Tuple[Optional[int], ...]
    outputs: Optional[int]
    other: Optional[int]


#: The fewest bits for log_softmax's saved output (cross-entropy's log-probabilities), whose
#: backward is dy − exp(y) · Σ dy.
LOG_SOFTMAX_MIN_BITS = 8

_FUSED_ATTENTION = Floors(inputs=(FUSED_ATTENTION_MIN_BITS, FUSED_ATTENTION_MIN_BITS, None),
                          outputs=None, other=FUSED_ATTENTION_MIN_BITS)
_LOG_SOFTMAX = Floors(inputs=(), outputs=LOG_SOFTMAX_MIN_BITS, other=None)
#: The same under per-tensor widths, which pay for every bit from the others' budget.
LOG_SOFTMAX_PER_TENSOR_MIN_BITS = 4
_LOG_SOFTMAX_PER_TENSOR = Floors(inputs=(), outputs=LOG_SOFTMAX_PER_TENSOR_MIN_BITS, other=None)


#: No floors.
NO_FLOORS = Floors(inputs=(), outputs=None, other=None)

#: A floor that keeps the tensor as it is (one of compress_saved's and the controller's widths).
KEPT_BITS = 32
#: The input of a reduction whose backward compares it with its result (result_from_input): kept.
_COMPARED_INPUT = Floors(inputs=(KEPT_BITS,), outputs=None, other=None)


def _signed_dims(dims: Any) -> Any:
    """A node's saved dims (ATen hands negative ones back as unsigned 64-bit values)."""
    if dims is None:
        return None
    return tuple(d - (1 << 64) if d >= 1 << 63 else d for d in dims)


def result_from_input(node: Any) -> Optional[Tuple[Callable[[torch.Tensor], torch.Tensor], bool]]:
    """For a reduction whose backward reads its saved input and its saved result together, (the
    function computing that result from the input, whether the input is kept as it is); else None.

    * amax and amin, max() and min() of a whole tensor, an infinity norm: backward finds the
      elements that made the result by comparing them (``self == result``). Codes of either side
      break the equality: no element matches, and the gradient is NaN (amax divides by the count
      of matches) or zero. The input is kept (its floor is KEPT_BITS): a gradient sent to the
      wrong element of a near tie is not a rounding error that averages out.
    * logsumexp: backward weighs the gradient by exp(self - result), softmax weights that sum to
      one only where the two agree (as fused attention's logsumexp, above).

    compress_saved recomputes the result from what backward will read as the input, so that the
    two agree whatever the input is stored as."""
    name = type(node).__name__
    if name in ("AmaxBackward0", "AminBackward0", "LogsumexpBackward0"):
        reduce = {"AmaxBackward0": torch.amax, "AminBackward0": torch.amin, "LogsumexpBackward0": torch.logsumexp}[name]
        dims, keepdim = _signed_dims(node._saved_dim), bool(node._saved_keepdim)
        return (lambda x: reduce(x, dims, keepdim)), name != "LogsumexpBackward0"
    if name in ("MaxBackward1", "MinBackward1"):  # the whole tensor's (with a dim, indices say which)
        return (torch.max if name == "MaxBackward1" else torch.min), True
    if name in ("LinalgVectorNormBackward0", "NormBackward1"):
        order = getattr(node, "_saved_ord", None) if name == "LinalgVectorNormBackward0" else getattr(node, "_saved_p", None)
        if not isinstance(order, (int, float)) or order not in (float("inf"), float("-inf")):
            return None  # a finite order reads the result as a scale, not by comparison
        dims, keepdim = _signed_dims(node._saved_dim), bool(node._saved_keepdim)
        if dims == ():
            dims = None  # torch.norm's whole tensor
        return (lambda x: torch.linalg.vector_norm(x, order, dims, keepdim)), True
    return None


def _code_of(function: Any) -> Tuple[Any, ...]:
    """The code object of `function` under its decorators, as a tuple (empty where it has none)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return (code,) if code is not None else ()


def _torch_checkpoint_codes() -> Tuple[Tuple[Any, ...], Tuple[Any, ...]]:
    """The code of torch.utils.checkpoint.checkpoint, and of the backward of its reentrant kind
    (CheckpointFunction), which reruns the block."""
    try:
        from torch.utils.checkpoint import CheckpointFunction, checkpoint
    except ImportError:  # pragma: no cover - every torch abp supports has them
        return (), ()
    return _code_of(checkpoint), _code_of(CheckpointFunction.backward)


_CHECKPOINT_CODE, _RECOMPUTATION_CODE = _torch_checkpoint_codes()


def _nested_codes(function_name: str, inner: str) -> Tuple[Any, ...]:
    """The code of the function `inner` defined inside torch.utils.checkpoint's `function_name`."""
    import torch.utils.checkpoint as checkpoint

    outer = getattr(getattr(checkpoint, function_name, None), "__code__", None)
    if outer is None:
        return ()
    return tuple(c for c in outer.co_consts if getattr(c, "co_name", None) == inner)


# torch 1.13's non-reentrant checkpoint recomputes inside its unpack hook; torch 2.x (2.0 to 2.4
# cannot name the innermost hooks either) in the recompute_fn its generator, or the generator's
# body, defines.
_NONREENTRANT_RECOMPUTATION_CODE = _nested_codes("_checkpoint_without_reentrant", "unpack") + \
    _nested_codes("_checkpoint_without_reentrant_generator", "recompute_fn") + \
    _nested_codes("_checkpoint_without_reentrant_generator_impl", "recompute_fn")
# The innermost saved-tensor hooks (torch >= 2.1); torch 1.13 cannot say.
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def inside_checkpoint_hooks(depth: int = 128) -> bool:
    """True where a non-reentrant activation checkpoint's saved-tensor hooks are the innermost:
    its forward, or its recomputation in backward. Hooks opened there would take every save from
    it (the innermost win), so it would neither keep only its inputs nor recompute. Where torch
    cannot name the innermost hooks (1.13 to 2.4), the stack says: torch.utils.checkpoint.checkpoint
    (a reentrant checkpoint's forward runs without grad, so it saves nothing anyway) or a
    non-reentrant checkpoint's recomputation, within `depth` frames."""
    if _TOP_HOOKS is not None:
        try:
            top = _TOP_HOOKS(False)
        except TypeError:  # pragma: no cover - an older signature
            top = None
        else:
            return top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint"
    return _on_stack(_CHECKPOINT_CODE + _NONREENTRANT_RECOMPUTATION_CODE, depth)

# The graph task backward is running, -1 outside backward (torch >= 2.0; absent on 1.13).
_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)


def _on_stack(codes: Tuple[Any, ...], depth: int) -> bool:
    """True if one of the `depth` frames above the caller of the caller runs one of `codes`."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def outside_backward() -> bool:
    """True where torch says no backward is running (torch >= 2.0); False where it cannot say."""
    return _GRAPH_TASK is not None and _GRAPH_TASK() == -1


def cannot_tell_backward() -> bool:
    """True where torch does not say whether backward runs (1.13: outside_backward is always False)."""
    return _GRAPH_TASK is None


def is_reentrant_checkpoint(node: Any) -> bool:
    """Whether an autograd node is a reentrant checkpoint's (CheckpointFunction: its backward
    reruns the block and runs a backward of its own, which torch allows only under .backward())."""
    return type(node).__name__ == "CheckpointFunctionBackward"


def recomputing_checkpoint(depth: int = 512) -> bool:
    """True if the pack hook calling this runs inside a reentrant checkpoint's recomputation (its
    backward reruns the block with grad on, saving as the forward would have). Outside backward
    (where torch tells) it is not; else walks the whole stack, since the block's modules come
    between (up to `depth` frames): callers ask only for saves made once backward has begun."""
    if _GRAPH_TASK is not None and _GRAPH_TASK() == -1:
        return False
    return _on_stack(_RECOMPUTATION_CODE, depth)


def saving_checkpoint_inputs(depth: int = 16) -> bool:
    """True if the saved-tensor pack hook calling this packs what an activation checkpoint saves:
    one of the `depth` frames above runs torch.utils.checkpoint.checkpoint. Inside it, only the
    checkpoint's own saves reach outer hooks: its block's inputs (a reentrant checkpoint runs the
    block without grad; a non-reentrant one routes the block's saves to its own hooks). The
    recomputation in backward runs outside it. The hook's own frames come between (compress_saved's,
    and those of the GraphModule that compiles() puts first)."""
    return _on_stack(_CHECKPOINT_CODE, depth)


#: Recomputed fused attention under one width for every tensor: q and k at 8 bits (not for
#: stability: per bit they cost the most).
_CONSISTENT_ATTENTION = Floors(inputs=(FUSED_ATTENTION_MIN_BITS, FUSED_ATTENTION_MIN_BITS, None),
                               outputs=None, other=None)


def is_fused_attention(node: Any) -> bool:
    """ScaledDotProduct{Flash,FlashAttentionForCpu,Efficient,Cudnn,FusedAttentionOverrideable}...Backward0."""
    name = type(node).__name__
    return name.startswith("ScaledDotProduct") and "Attention" in name


def rule_for(node: Any, *, recomputed: bool = False, uniform: bool = False) -> Optional[Floors]:
    """The floors of the op whose autograd node is `node`, or None if it has none. `recomputed`:
    fused attention's output and logsumexp are recomputed from its query, key and value;
    `uniform`: the block stores every tensor at one width (no per-tensor widths)."""
    if is_fused_attention(node):
        if not recomputed:
            return _FUSED_ATTENTION
        return _CONSISTENT_ATTENTION if uniform else None
    if type(node).__name__ == "LogSoftmaxBackward0":
        return _LOG_SOFTMAX if uniform else _LOG_SOFTMAX_PER_TENSOR
    reduction = result_from_input(node)
    if reduction is not None and reduction[1]:
        return _COMPARED_INPUT
    return None


@dataclass(frozen=True)
class Region:
    """The interval a kinked activation's backward tests its saved value against: (lo, hi), or
    [lo, hi] if `closed`; an infinite end is not tested."""

    lo: float
    hi: float
    closed: bool

    def inside(self, t: torch.Tensor) -> torch.Tensor:
        """Where `t` lies in the interval (bool, t's shape)."""
        above = t >= self.lo if self.closed else t > self.lo
        if math.isinf(self.hi):
            return above
        return above & (t <= self.hi if self.closed else t < self.hi)


_POSITIVE = Region(0.0, math.inf, False)

#: Kinked activations by their backward node: the interval backward tests the saved value against
#: (torch's derivatives.yaml and its CPU kernels: leaky_relu_backward tests x > 0, hardtanh_backward
#: min < x < max, hardswish_backward x < -3 and x <= 3, clamp's backward min <= x <= max, ...).
_REGIONS: Dict[str, Callable[[Any], Optional[Region]]] = {
    **{name: (lambda node: _POSITIVE) for name in (
        "LeakyReluBackward0", "LeakyReluBackward1", "EluBackward0", "EluBackward1", "CeluBackward0", "CeluBackward1",
        "SeluBackward0", "SeluBackward1", "PreluKernelBackward0", "PreluBackward0", "RreluWithNoiseBackward0",
        "RreluWithNoiseBackward1")},
    "HardtanhBackward0": lambda node: Region(float(node._saved_min_val), float(node._saved_max_val), False),
    "HardtanhBackward1": lambda node: Region(float(node._saved_min_val), float(node._saved_max_val), False),
    "HardsigmoidBackward0": lambda node: Region(-3.0, 3.0, False),
    "HardswishBackward0": lambda node: Region(-3.0, 3.0, True),
    "ThresholdBackward0": lambda node: Region(float(node._saved_threshold), math.inf, False),
    "ClampBackward1": lambda node: _clamp_region(node._saved_min, node._saved_max),
    "ClampMinBackward0": lambda node: _clamp_region(node._saved_min, None),
    "ClampMaxBackward0": lambda node: _clamp_region(None, node._saved_max),
    "HardshrinkBackward0": lambda node: Region(-float(node._saved_lambd), float(node._saved_lambd), True),
    "SoftshrinkBackward0": lambda node: Region(-float(node._saved_lambd), float(node._saved_lambd), True),
}


def _clamp_region(lo: Any, hi: Any) -> Optional[Region]:
    if lo is None and hi is None:
        return None
    return Region(-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi), True)


#: The in-place forms among them: they save their result, the others their input.
_SAVING_RESULT = frozenset({"LeakyReluBackward1", "EluBackward1", "CeluBackward1", "SeluBackward1", "HardtanhBackward1",
                            "RreluWithNoiseBackward1"})


def saves_result(node: Any) -> bool:
    """Whether a kinked activation's node saved its result (an in-place form) rather than its input."""
    return type(node).__name__ in _SAVING_RESULT


def region_of(node: Any) -> Optional[Region]:
    """The interval the backward of `node` tests its saved value against, if it is a kinked
    activation's (or clamp's, threshold's); None otherwise. ReLU is not here: compress_saved keeps
    its output's support (exact zeros off it) with `exact_relu`."""
    make = _REGIONS.get(type(node).__name__)
    if make is None:
        return None
    try:
        return make(node)
    except (AttributeError, TypeError, ValueError):  # a tensor bound (clamp(x, t)): not a constant interval
        return None


_aten = torch.ops.aten

#: Fused attention kernels by their backward node: a call (query, key, value, mask, dropout_p,
#: is_causal, scale) -> (output, logsumexp) running the kernel the forward ran, and the node's
#: attribute names of its saved query, key, value, mask (None: the kernel takes none), output and
#: logsumexp. The signatures are ATen's (native_functions.yaml).
_ATTENTION_KERNELS = {
    "ScaledDotProductFlashAttentionForCpuBackward0": (
        lambda q, k, v, m, p, c, s: _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, p, c, attn_mask=m, scale=s)[:2],
        ("_saved_query", "_saved_key", "_saved_value", "_saved_attn_mask", "_saved_output", "_saved_logsumexp")),
    "ScaledDotProductFlashAttentionBackward0": (
        lambda q, k, v, m, p, c, s: _aten._scaled_dot_product_flash_attention(q, k, v, p, c, False, scale=s)[:2],
        ("_saved_query", "_saved_key", "_saved_value", None, "_saved_output", "_saved_logsumexp")),
    "ScaledDotProductEfficientAttentionBackward0": (
        lambda q, k, v, m, p, c, s: _aten._scaled_dot_product_efficient_attention(q, k, v, m, True, p, c, scale=s)[:2],
        ("_saved_query", "_saved_key", "_saved_value", "_saved_attn_bias", "_saved_output", "_saved_log_sumexp")),
    "ScaledDotProductCudnnAttentionBackward0": (
        lambda q, k, v, m, p, c, s: _aten._scaled_dot_product_cudnn_attention(
            q, k, v, m, True, p, c, False, scale=s)[:2],
        ("_saved_query", "_saved_key", "_saved_value", "_saved_attn_bias", "_saved_output", "_saved_logsumexp")),
}


def attention_kernel(node: Any) -> Tuple[Callable[..., Any], Tuple[Optional[str], ...]]:
    """The kernel call and saved-attribute names of fused attention node `node` (see
    `recomputable_attention`)."""
    return _ATTENTION_KERNELS[type(node).__name__]


def recomputable_attention(node: Any) -> bool:
    """True if `node` is a fused attention whose output and logsumexp can be recomputed from its
    saved query, key and value: a kernel abp knows, run without dropout (its mask could not be
    drawn again)."""
    return type(node).__name__ in _ATTENTION_KERNELS and getattr(node, "_saved_dropout_p", 1.0) == 0


def _is_input(t: torch.Tensor, edge: Tuple[Any, int]) -> bool:
    fn, output_nr = edge
    if fn is None:
        return False
    if t.grad_fn is not None:
        return t.grad_fn is fn and t.output_nr == output_nr
    return getattr(fn, "variable", None) is t  # a leaf's AccumulateGrad


def floor_of(t: torch.Tensor, node: Any, floors: Floors) -> Optional[int]:
    """The floor for `t`, one of the tensors the op of `node` saved."""
    if t.grad_fn is node:
        return floors.outputs
    for i, edge in enumerate(node.next_functions):
        if _is_input(t, edge):
            return floors.inputs[i] if i < len(floors.inputs) else floors.other
    return floors.other


_GET_SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None)


def sequence_number() -> Optional[int]:
    """The autograd node counter of this thread: an op's node takes the current value, so every
    save an op makes (inputs before it runs, outputs after) sees the same count, and its node's
    sequence number is that count minus one. None where torch lacks it (1.13): ops are not told
    apart and no rule applies."""
    return _GET_SEQUENCE_NR() if _GET_SEQUENCE_NR is not None else None
