"""compress_saved inside torch.compile graphs (torch versions whose AOTAutograd inlines saved-tensor hooks).

Eager autograd calls ``saved_tensors_hooks`` as Python functions on every saved tensor. A compiled
graph saves its tensors itself; AOTAutograd applies the hooks on top of the stack only when they
are ``torch.fx.GraphModule``s, by tracing them into the forward graph's end (pack) and the
backward graph's start (unpack), and only for the graph's intermediates (AOTAutograd's
"donated" filter: inputs, parameters and outputs are held by their owners anyway). It reads
the hooks when it compiles and guards on their identity.

So compress_saved's hooks are a pair of GraphModules (``hooks(bits, group_size, ...)``),
one pair per setting so that a changed setting recompiles. Each graph is one call of a Python
function that tells the two cases apart:

- called by eager autograd (a real tensor), it hands the tensor to the open block's own pack
  hook (op rules, shared views, stats, the guard) and returns ``(block, what it packed)``, so that
  backward (which runs after the block closed) unpacks with the same block;
- traced by AOTAutograd (``_get_saved_tensor_hook_context`` names the saved node), it decides from
  the graphs, as the op rules do from autograd nodes:

  * kept as they are: tensors off the gradient path (computed from no input that receives a
    gradient: masks, rotary tables), a parameter's views and casts (autocast's weight copy: the
    graph inputs dynamo holds static, seen through views and casts), non-floating ones, ones
    under ``min_numel`` elements, and
    per-row statistics (a last dimension of 1, and a norm op's statistics: as eager compress_saved
    keeps them);
  * codes and the exact support (x > 0, 1 bit) of what a ReLU's backward reads, as eagerly;
  * at 8 bits at least: what fused attention's backward recomputes its probabilities from (query,
    key, logsumexp) and log_softmax's output (abp._save_rules), the latter stored as the
    probabilities exp(y) that its backward reads, as eager compress_saved stores it;
  * everything else: ``abp::gact_pack`` (the gact_b<bits> kernels behind a torch.library op, a
    fresh Philox key per tensor drawn by torch.randint in the graph) and ``abp::gact_unpack``.

What the compiled graphs compress is not in the block's ``stats`` (no Python runs per save);
``compiled_stats()`` reports what the last compiled graphs chose, per saved tensor, in bytes.
"""
from __future__ import annotations

import operator
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from . import _custom_ops, _derived, _save_rules
from .compress import (PARAMETER_CHAIN, PARAMETER_VIEW_OPS, VIEW_OPS, CompressedTensor, code_layout, coded_numel, dequantize, group_layout, mask_bits, mask_from_bits,
                       open_block, plane_groups, quantize_unchecked, rank_key, row_statistic_shape, with_support)
from ._launch import ROW_DTYPES

__all__ = ["available", "hooks", "compiled_stats"]

# AOTAutograd's hook context and its inlining test, imported at first need (_aot): importing them
# loads torch._dynamo and inductor, about as long as importing torch itself, which a user who never
# compiles should not pay on `import abp`.
_AOT: Optional[Tuple[Any, Any]] = None


def _aot() -> Tuple[Any, Any]:
    """(_get_saved_tensor_hook_context, saved_tensors_hooks_are_inlineable), or Nones on a torch
    without them (older torch: compiled graphs are not compressed)."""
    global _AOT
    if _AOT is None:
        try:
            from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
            from torch._functorch._aot_autograd.utils import saved_tensors_hooks_are_inlineable
            _AOT = (_get_saved_tensor_hook_context, saved_tensors_hooks_are_inlineable)
        except ImportError:  # pragma: no cover - older torch
            _AOT = (None, None)
    return _AOT


def available() -> bool:
    """True if compiled graphs can compress their saved tensors with this torch (imports
    AOTAutograd, and with it torch._dynamo, if it is not loaded yet)."""
    return _custom_ops.enabled() and None not in _aot()


def in_use() -> bool:
    """available(), once torch._dynamo is loaded: until then no graph has been compiled in this
    process, so a compress_saved block needs no compiled hooks (and `import abp` and eager
    training never load dynamo)."""
    return "torch._dynamo" in sys.modules and available()


# ---------------------------------------------------------------------------------------------
# The codec as torch.library ops
# ---------------------------------------------------------------------------------------------

if _custom_ops.enabled():  # registered at import (cheap); only compiled graphs call them

    @_custom_ops.custom_op("abp::gact_pack", mutates_args=())
    def gact_pack(x: torch.Tensor, key: torch.Tensor, bits: int, group_size: int, padded: int) -> torch.Tensor:
        """`x` as `bits`-bit group codes: one uint8 buffer (compress.group_layout) keyed by `key`;
        `padded`: 0, or the length its channel planes are padded to (compress.plane_groups)."""
        return quantize_unchecked(x, bits, group_size, rank_key(int(key.item())), 0, padded).buffer

    @gact_pack.register_fake
    def _(x: torch.Tensor, key: torch.Tensor, bits: int, group_size: int, padded: int) -> torch.Tensor:
        size, _ = group_layout(coded_numel(x.shape, padded), bits, group_size, x.dtype)
        return x.new_empty((size,), dtype=torch.uint8)

    @_custom_ops.custom_op("abp::gact_unpack", mutates_args=())
    def gact_unpack(buffer: torch.Tensor, bits: int, group_size: int, padded: int, shape: List[int], stride: List[int],
                    dtype: torch.dtype) -> torch.Tensor:
        """The tensor of `shape`, `stride` and `dtype` that gact_pack's `buffer` stands for: laid out
        as the saved tensor was, since the compiled backward may view it by its strides (a
        transposed query)."""
        _, layout = group_layout(coded_numel(shape, padded), bits, group_size, dtype)
        dense = dequantize(CompressedTensor("groups", bits, group_size, tuple(shape), dtype, buffer.device, buffer, layout,
                                            padded))
        if list(dense.stride()) == list(stride):
            return dense
        return torch.empty_strided(shape, stride, dtype=dtype, device=buffer.device).copy_(dense)

    @gact_unpack.register_fake
    def _(buffer: torch.Tensor, bits: int, group_size: int, padded: int, shape: List[int], stride: List[int],
          dtype: torch.dtype) -> torch.Tensor:
        return buffer.new_empty_strided(shape, stride, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# What a compiled graph compresses
# ---------------------------------------------------------------------------------------------

#: Fused attention's backward ops, which recompute the probabilities through exp().
_ATTENTION_BACKWARD = ("_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
                       "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
                       "_scaled_dot_product_fused_attention_overrideable_backward")
#: Their forward ops: (query, key, value, ...).
_ATTENTION_FORWARD = tuple(name[: -len("_backward")] for name in _ATTENTION_BACKWARD)
#: (grad_out, query, key, value, out, logsumexp, ...): query, key and logsumexp.
_ATTENTION_FLOORED = (1, 2, 5)


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))  # "_log_softmax_backward_data.default"
    return name.split(".")[0]


def _on_gradient_path(fw: torch.fx.Graph, bw: torch.fx.Graph) -> Dict[str, bool]:
    """Forward node name -> whether it is computed from an input that receives a gradient.

    The backward graph returns one gradient per forward input, None for inputs that need none."""
    cached = getattr(fw, "_abp_gradient_path", None)
    if cached is not None:
        return cached
    gradients = bw.output_node().args[0]
    inputs = [n for n in fw.nodes if n.op == "placeholder"]
    path: Dict[str, bool] = {}
    for i, node in enumerate(inputs):
        path[node.name] = i < len(gradients) and gradients[i] is not None
    for node in fw.nodes:
        if node.op != "placeholder":
            path[node.name] = any(path.get(a.name, False) for a in node.all_input_nodes)
    fw._abp_gradient_path = path  # type: ignore[attr-defined]
    return path


#: Norm ops whose outputs after the first are statistics (a mean, a 1/std, running statistics):
#: eager compress_saved keeps them as they are (they carry no gradient), whatever their shape; a
#: BatchNorm's are (C,) and pass the shape rule. var_mean's outputs are both statistics.
_NORM_OPS = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                       "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
                       "_batch_norm_with_update_functional", "_batch_norm_no_update", "cudnn_batch_norm",
                       "miopen_batch_norm", "native_layer_norm", "native_group_norm", "_fused_rms_norm"})
_STATISTIC_OPS = frozenset({"var_mean"})


def _norm_statistic(node: torch.fx.Node) -> bool:
    """True if `node` is one of a norm op's statistics (the outputs after the first of a norm op, or
    var_mean's), or a detach of one (what GroupNorm saves)."""
    while _op_name(node.target) in ("detach", "alias") and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node.target is not operator.getitem or len(node.args) != 2 or not isinstance(node.args[0], torch.fx.Node):
        return False
    producer, index = node.args
    op = _op_name(producer.target)
    return op in _STATISTIC_OPS or (op in _NORM_OPS and isinstance(index, int) and index >= 1)


#: Forward ops whose output is log-probabilities (stored as exp(y), at LOG_SOFTMAX_MIN_BITS at least).
_LOG_SOFTMAX_FORWARD = ("_log_softmax", "log_softmax")

#: Backward ops that only re-view or re-label a value: its readers are theirs.
_ALIASES = VIEW_OPS | {"contiguous"}


def _uses(name: str, bw: torch.fx.Graph, through: frozenset) -> Iterator[Tuple[torch.fx.Node, torch.fx.Node]]:
    """(user, the node it reads) for each use in backward of the saved value `name`, and of what
    the ops in `through` make of it."""
    frontier = [n for n in bw.nodes if n.op == "placeholder" and n.name == name]
    seen = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            yield user, node
            if _op_name(user.target) in through:
                frontier.append(user)


def _readers(name: str, bw: torch.fx.Graph) -> List[Tuple[str, int]]:
    """(backward op, argument position) of each use of the saved value `name` in backward, looking
    through views and detaches (backward reads a ReLU's output through a detach)."""
    return [(_op_name(user.target), position) for user, node in _uses(name, bw, _ALIASES)
            if _op_name(user.target) not in _ALIASES for position, arg in enumerate(user.args) if arg is node]


#: Backward ops that keep a value what it was up to its sign and layout, and the equality tests.
_SAME_VALUE = _ALIASES | {"abs", "neg", "convert_element_type"}
_EQUALITY = frozenset({"eq", "ne"})


def _compared(name: str, bw: torch.fx.Graph) -> bool:
    """True if backward tests the saved value `name` (or its absolute value, a view of it) for
    equality with another tensor: amax's and an infinity norm's backward find the elements that
    made the result so. Codes break the equality (no element matches: a NaN or zero gradient),
    as eager compress_saved's op rules say (_save_rules.result_from_input)."""
    return any(_op_name(user.target) in _EQUALITY and all(isinstance(a, torch.fx.Node) for a in user.args[:2])
               for user, _ in _uses(name, bw, _SAME_VALUE))


#: Elementwise backward ops through which a recomputed value keeps following its saved input (a
#: norm's affine recomputed from a saved convolution output), and what tests a value against a
#: constant: a comparison with a number, or a kinked activation's own backward.
_ELEMENTWISE = _ALIASES | {"add", "sub", "mul", "div", "neg", "rsqrt", "sqrt", "convert_element_type"}
_SCALAR_COMPARISONS = frozenset({"gt", "ge", "lt", "le"})
_KINKED_BACKWARD = frozenset({"leaky_relu_backward", "hardtanh_backward", "hardsigmoid_backward", "hardswish_backward",
                              "elu_backward", "threshold_backward", "hardshrink_backward", "softshrink_backward",
                              "_prelu_kernel_backward", "rrelu_with_noise_backward"})


def _tested_against_constant(name: str, bw: torch.fx.Graph) -> bool:
    """True if backward tests the saved value `name`, or what it recomputes from it elementwise, for
    the piece of a kinked function it lies on (x > 0 for LeakyReLU, min < x < max for ReLU6, ...):
    codes near the breakpoint land on the other piece as often as not, and the gradient there is
    wrong by the jump. Eager compress_saved keeps such a value's side exactly beside its codes
    (compress.with_region); here the value is kept as it is."""
    for user, node in _uses(name, bw, _ELEMENTWISE):
        op = _op_name(user.target)
        if op in _KINKED_BACKWARD:
            return True
        if op in _SCALAR_COMPARISONS and any(not isinstance(a, torch.fx.Node) for a in user.args[:2]):
            return True
    return False


def _parameter_copy(node: torch.fx.Node) -> bool:
    """True if `node` is, through views and casts, a graph input torch.compile holds static (its
    module's parameter or buffer: dynamo marks them ``is_static_input``), as eager compress_saved
    tells autocast's weight copy by its autograd ancestry (compress._parameter_of)."""
    for _ in range(PARAMETER_CHAIN):
        if node.op == "placeholder":
            if "is_static_input" not in node.meta:
                # A torch whose partitioner does not mark them: the copy is coded, as before
                # (static_inputs_unmarked() says so).
                _TRACED.static_unmarked = True
            return bool(node.meta.get("is_static_input", False))
        if _op_name(node.target) not in PARAMETER_VIEW_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return False


#: Forward ops whose output is a ReLU's (its backward reads where it is positive), and backward
#: ops that read a saved value that way.
_RELU_FORWARD = frozenset({"relu", "relu_"})
_RELU_BACKWARD = frozenset({"threshold_backward"})


def _decide(x: torch.Tensor, context: Dict[str, Any], bits: int, min_numel: int, op_rules: bool,
            exact_relu: bool) -> Tuple[int, str]:
    """(bits to store the saved value at, 32 = as it is; why) from the graphs AOTAutograd traces."""
    node, fw, bw = context["_node"], context["_fw_graph"], context["_bw_graph"]
    if x.dtype not in ROW_DTYPES:
        return 32, "not floating"
    if _parameter_copy(node):
        return 32, PARAMETER_KEPT
    if x.numel() < min_numel:
        return 32, f"under min_numel={min_numel} elements"
    if row_statistic_shape(tuple(x.shape)):
        return 32, "a per-row statistic (last dimension 1): kept as it is"
    if _norm_statistic(node):
        return 32, "a norm's statistic (a mean, a 1/std): kept as it is"
    if not _derived.dense(x):  # unpack lays codes out by the saved strides: a permutation, no overlap
        return 32, "not dense (an expanded or strided view): kept as it is"
    if not _on_gradient_path(fw, bw).get(node.name, True):
        return 32, "off the gradient path (a constant of backward: a mask, a table)"
    if _compared(node.name, bw):
        return 32, COMPARED_KEPT
    readers = _readers(node.name, bw)
    # A ReLU's output, which its backward reads for the sign (threshold_backward, or a comparison
    # and a where once decomposed): its support (x > 0) is kept exactly beside the codes, as eager
    # compress_saved keeps it, so the sign backward reads is exact and the values are codes.
    relu = _op_name(node.target) in _RELU_FORWARD or any(op in _RELU_BACKWARD for op, _ in readers)
    if exact_relu and relu:
        return bits, SUPPORT_KEPT
    if not op_rules:
        return bits, "compressed"
    if not relu and _tested_against_constant(node.name, bw):  # a ReLU's output: exact_relu decides
        return 32, PIECE_KEPT
    floor = None
    for op, position in readers:
        if op in _ATTENTION_BACKWARD and position in _ATTENTION_FLOORED:
            floor = _save_rules.FUSED_ATTENTION_MIN_BITS
        elif op == "_log_softmax_backward_data" and position == 1:
            floor = _save_rules.LOG_SOFTMAX_MIN_BITS
    # The same rules read from the forward graph (backward may be decomposed into exp, sub, ...):
    # log_softmax's output, and the query and key fused attention was given.
    if _op_name(node.target) in _LOG_SOFTMAX_FORWARD:
        floor = _save_rules.LOG_SOFTMAX_MIN_BITS
    for user in node.users:
        if _op_name(user.target) in _ATTENTION_FORWARD and any(a is node for a in user.args[:2]):
            floor = _save_rules.FUSED_ATTENTION_MIN_BITS
    if floor is not None and bits < floor:
        return floor, f"raised to {floor} bits (read through exp() in backward)"
    return bits, "compressed"


#: Why a ReLU's output is stored as codes and its support (abp.compress's exact_relu, compiled).
SUPPORT_KEPT = "compressed, with its support (x > 0) kept exactly in 1 bit (a ReLU's output)"
PLANES_RAW = "kept: its planes (rows, channels), padded to whole groups, would take more bytes coded (compress.codes_pay)"
DYNAMIC_PLANES_RAW = ("kept: its planes (rows, channels) have a dynamic size, so no code group can be kept within one "
                      "(compress.plane_groups)")
#: Why a value backward tests for the piece of a kinked function it lies on is kept.
PIECE_KEPT = ("kept as it is: backward tests it (or what it recomputes from it) for the piece of a kinked function "
              "it lies on (LeakyReLU's x > 0, ReLU6's 0 < x < 6, ...), which codes near the breakpoint would flip")
#: Why a value backward tests for equality is kept (amax's input and result, an infinity norm's).
COMPARED_KEPT = "kept as it is: backward tests it for equality with another tensor (amax, an infinity norm)"
#: Why a parameter's copy is kept (as eager compress_saved keeps it).
PARAMETER_KEPT = "a parameter's view or cast (autocast's weight copy): kept as it is, as eagerly"


def _with_support(dense: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`dense` with its support restored from `bits` (compress.mask_bits of x > 0), laid out as
    `dense` is (the saved tensor's strides)."""
    out = with_support(dense, mask_from_bits(bits, dense.shape))
    if out.stride() == dense.stride():
        return out
    return torch.empty_strided(dense.shape, dense.stride(), dtype=dense.dtype, device=dense.device).copy_(out)


_TRACED = threading.local()


def compiled_stats() -> List[Dict[str, Any]]:
    """What the graphs compiled in this thread chose for each saved intermediate, in trace order:
    ``node``, ``shape``, ``dtype``, ``bits`` (32: kept), ``why``, ``bytes_in`` and ``bytes_stored``.
    Cleared by ``clear_compiled_stats()``."""
    return list(getattr(_TRACED, "records", []))


def clear_compiled_stats() -> None:
    _TRACED.records = []
    _TRACED.static_unmarked = False


def static_inputs_unmarked() -> bool:
    """True if a graph compiled in this thread since `clear_compiled_stats` had graph inputs this
    torch does not mark static or not (older torch): parameters' copies were then coded."""
    return bool(getattr(_TRACED, "static_unmarked", False))


def _pack_traced(x: torch.Tensor, context: Dict[str, Any], bits: int, group_size: int, min_numel: int,
                 op_rules: bool, exact_relu: bool) -> Any:
    chosen, why = _decide(x, context, bits, min_numel, op_rules, exact_relu)
    size_in = x.numel() * x.element_size()
    layout = code_layout(tuple(x.shape), x.dtype, chosen, group_size) if chosen != 32 else None
    if chosen != 32 and layout is None:
        chosen, why = 32, PLANES_RAW if plane_groups(tuple(x.shape), group_size)[0] else DYNAMIC_PLANES_RAW
    group_size, padded = layout if layout is not None else (0, 0)
    stored = size_in if layout is None else group_layout(coded_numel(x.shape, padded), chosen, group_size, x.dtype)[0]
    support = why == SUPPORT_KEPT
    if support:
        stored += (x.numel() + 7) // 8
    records = getattr(_TRACED, "records", None)
    if records is None:
        records = _TRACED.records = []
    records.append({"node": context["_node"].name, "shape": tuple(x.shape), "dtype": x.dtype, "bits": chosen,
                    "why": why, "bytes_in": size_in, "bytes_stored": stored})
    if chosen == 32:
        return x
    key = torch.randint(0, 2**63 - 1, (1,), device="cpu")
    # log_softmax's output as the probabilities exp(y) its backward reads, as eager compress_saved
    # stores it: codes of exp(y) are unbiased there, codes of y are not (and coarser near p = 1).
    logs = _op_name(context["_node"].target) in _LOG_SOFTMAX_FORWARD
    coded = x.exp() if logs else x
    return (gact_pack(coded, key, chosen, group_size, padded), chosen, group_size, padded, list(x.shape),
            list(x.stride()), x.dtype, logs, mask_bits(x > 0) if support else None)


# ---------------------------------------------------------------------------------------------
# The hooks
# ---------------------------------------------------------------------------------------------

def pack_saved(x: Any, bits: int, group_size: int, min_numel: int, op_rules: bool, exact_relu: bool) -> Any:
    hook_context = (_AOT or _aot())[0]
    context = hook_context() if hook_context is not None else None
    if context is not None and "_node" in context:
        return _pack_traced(x, context, bits, group_size, min_numel, op_rules, exact_relu)
    block = open_block()  # eager saves go to the open block's own pack hook
    if block is None:  # pragma: no cover - the hooks are only on the stack while a block is open
        raise RuntimeError("abp.compress_saved: its saved-tensor hooks ran outside its block")
    return (block, block.pack(x))


def unpack_saved(packed: Any) -> Any:
    if isinstance(packed, torch.Tensor):
        return packed  # kept as it was in a compiled graph
    if len(packed) == 2:  # (block, what its eager pack hook returned)
        block, saved = packed
        return block.unpack(saved)
    buffer, bits, group_size, padded, shape, stride, dtype, logs, support = packed
    dense = gact_unpack(buffer, bits, group_size, padded, shape, stride, dtype)
    if support is not None:
        dense = _with_support(dense, support)
    return dense.log() if logs else dense


_PAIRS: Dict[Tuple[Any, ...], Tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = {}


def _graph_module(function: Any, constants: Tuple[Any, ...]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    value = graph.placeholder("saved")
    graph.output(graph.call_function(function, (value,) + constants))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    # Eager autograd calls the hook on every save and every read: it goes straight to the function
    # the graph calls, not through nn.Module.__call__ and the generated forward (a few Python frames
    # each time). Compiled graphs inline the graph itself. fx gives each GraphModule a class of its
    # own, so this touches no other; a recompile() would only restore the slower call.
    cls = type(module)
    if cls is not torch.fx.GraphModule:
        cls.__call__ = lambda self, saved: function(saved, *constants)  # type: ignore[method-assign]
    return module


def hooks(bits: int, group_size: int, min_numel: int, op_rules: bool, exact_relu: bool
          ) -> Tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The (pack, unpack) GraphModules for one setting; the same objects each time, so that a
    compiled graph is reused (dynamo guards on their identity) until the setting changes."""
    key = (bits, group_size, min_numel, op_rules, exact_relu)
    pair = _PAIRS.get(key)
    if pair is None:
        pair = _PAIRS[key] = (_graph_module(pack_saved, key), _graph_module(unpack_saved, ()))
    return pair
