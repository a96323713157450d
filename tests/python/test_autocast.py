"""A converted model's training step under CPU autocast: bf16, and fp16 where this torch's CPU
autocast has it. transformers' LLaMA (RMSNorm, SiLU), GPT-2 (LayerNorm, tanh GELU) and BERT
(post-LN, erf GELU) from small configs (bench/model_zoo.py, no downloads).

- The exact recipe (memory-sharing norms only) gives the original model's gradients under the
  same autocast to within one epsilon of the autocast dtype (global relative error): the only
  difference is that a norm recovers its normalised value from its output, which under autocast
  may be rounded to that dtype, an O(eps) relative error that backward propagates linearly. The
  original model's own autocast-against-fp32 gap is of the same order (bf16: 0.5-0.6 %).
- With ReGELU2/ReSiLU2 the gradient is by design not the original's; there each activation's
  input gradient must be its defined derivative at the low-precision input it got, times the
  incoming gradient, rounded once to that dtype (checked to one epsilon), and the step must run
  in sensible dtypes: activations in the autocast dtype, norms fp32 in and fp32 or the autocast
  dtype out, parameter gradients fp32 and finite.
Current-torch lane (transformers).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

import abp
from abp_reference import library_on_one_thread

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import model_zoo  # noqa: E402  (bench/model_zoo.py: small configs, shared with test_models.py)

NAMES = ["llama", "gpt2", "bert"]
DTYPES = [torch.bfloat16, torch.float16]


_library = pytest.fixture(autouse=True)(library_on_one_thread)


def _autocast_or_skip(dtype: torch.dtype) -> None:
    """Skips where this torch's CPU autocast does not run a Linear in `dtype` (older versions
    warn and disable autocast for fp16 on CPU)."""
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=dtype):
        if torch.nn.functional.linear(x, w).dtype != dtype:
            pytest.skip(f"torch {torch.__version__}: CPU autocast does not support {dtype}")


def _model(name: str) -> Tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, make_input = model_zoo.build(name)
    model.train()
    return model, make_input(0)


def _step(model: torch.nn.Module, ids: torch.Tensor,
          dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """One forward and backward under autocast: (output, loss, parameter gradients)."""
    model.zero_grad(set_to_none=True)
    try:
        with torch.autocast("cpu", dtype=dtype):
            y = model(input_ids=ids)[0]
            # A loss that weighs every output differently, in fp32 as a loss would be.
            loss = (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum()
        loss.backward()
    except (RuntimeError, NotImplementedError) as e:  # an op this torch has no CPU kernel for in dtype
        if "not implemented for" in str(e):
            pytest.skip(f"torch {torch.__version__} on CPU: {e}")
        raise
    return y, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _relative(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    """‖got − want‖ / ‖want‖ over all parameter gradients together (fp64)."""
    diff = sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want)
    norm = sum(float(want[k].double().pow(2).sum()) for k in want)
    return (diff / norm) ** 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_exact_recipe_under_autocast_gives_the_original_gradients(name: str, dtype: torch.dtype) -> None:
    _autocast_or_skip(dtype)
    model, ids = _model(name)
    # example_inputs: the norms only linear layers read emit the autocast dtype (docs/python.md).
    converted, _ = abp.convert(model, "lowmembp", gelu=None, silu=None, example_inputs=(ids,))
    y_want, _, want = _step(model, ids, dtype)
    y_got, _, got = _step(converted, ids, dtype)
    assert y_got.dtype == y_want.dtype
    assert got.keys() == want.keys()
    error = _relative(got, want)
    assert error <= torch.finfo(dtype).eps, f"{name}: relative gradient error {error:.2e} under {dtype}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_step_under_autocast_runs_in_sensible_dtypes_with_the_defined_derivative(name: str, dtype: torch.dtype) -> None:
    _autocast_or_skip(dtype)
    model, ids = _model(name)
    converted, _ = abp.convert(model, "lowmembp")
    seen: List[Tuple[str, torch.dtype, torch.dtype]] = []
    captured: Dict[str, Dict[str, Any]] = {}
    handles = []
    for module_name, module in converted.named_modules():
        if isinstance(module, (abp.nn.AbpActivation, abp.nn.MSLayerNorm, abp.nn.MSRMSNorm)):
            def record(m: torch.nn.Module, args: Any, out: torch.Tensor, key: str = module_name) -> None:
                x = args[0]
                seen.append((key, x.dtype, out.dtype))
                if isinstance(m, abp.nn.AbpActivation) and x.requires_grad:
                    slot = captured[key] = {"module": m, "x": x.detach().clone()}
                    # x feeds only this activation (the projection before it), so its gradient
                    # is what the activation's backward returned.
                    x.register_hook(lambda g: slot.__setitem__("dx", g.detach().clone()))
                    out.register_hook(lambda g: slot.__setitem__("dy", g.detach().clone()))

            handles.append(module.register_forward_hook(record))
    y_want, _, _ = _step(model, ids, dtype)
    y, loss, grads = _step(converted, ids, dtype)
    for h in handles:
        h.remove()

    assert y.dtype == y_want.dtype and loss.dtype == torch.float32 and bool(torch.isfinite(loss))
    activations = [s for s in seen if isinstance(converted.get_submodule(s[0]), abp.nn.AbpActivation)]
    norms = [s for s in seen if s not in activations]
    assert activations and norms
    # An activation follows a Linear, which autocast runs in dtype; it keeps its input's dtype.
    assert all(d_in == dtype and d_out == dtype for _, d_in, d_out in activations), activations
    # Norms read the fp32 residual stream and emit fp32 or, where only linear layers read them, dtype.
    assert all(d_in == torch.float32 and d_out in (torch.float32, dtype) for _, d_in, d_out in norms), norms
    assert grads and all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads.values())
    assert any(bool(g.any()) for g in grads.values())

    assert captured
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    for key, slot in captured.items():
        assert slot["dx"].dtype == dtype and slot["dy"].dtype == dtype
        # The derivative the module defines, at the same low-precision input, computed in fp32.
        x = slot["x"].float().requires_grad_(True)
        slot["module"](x).backward(slot["dy"].float())
        # Rounding the fp32 product to dtype once costs at most eps/2 relatively; subnormals
        # (fp16) are spaced eps·smallest_normal apart.
        torch.testing.assert_close(slot["dx"].float(), x.grad, rtol=eps, atol=eps * tiny,
                                   msg=lambda m, key=key: f"{name} {key}: {m}")
