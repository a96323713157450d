"""abp.memory.report: bytes saved for backward per module, each storage once, on plain torch models.

Expected numbers come from what torch's autograd saves for the ops used (a Linear saves its input, a
ReLU its output, ``sin`` its input, ``x * buffer`` the buffer); parameters and buffers never count.
"""
from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn

import abp

F32 = 4


class Parent(nn.Module):
    """Saves in a child (the Linear), then in itself after the child returned (sin saves its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x).sin()


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = Parent()
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.p(x) * y.cos() * self.scale  # top level: saves y, sin(...), cos(y) and the buffer


def test_shared_storage_counts_once_parameters_are_left_out():
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(5, 8, requires_grad=True)
    r = abp.memory.report(seq, x)
    # Linear 0 saves x (its weight is a parameter); ReLU saves its output, which Linear 2 saves again.
    assert r.per_module == {"0": 5 * 8 * F32, "1": 5 * 8 * F32, "2": 0}
    assert r.total_bytes == 2 * 5 * 8 * F32 == sum(r.per_module.values())
    assert r.baseline_total_bytes is None and r.baseline_per_module is None


def test_innermost_module_tuple_inputs_top_level_and_buffers():
    model = TwoInputs()
    x, y = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    r = abp.memory.report(model, (x, y))
    row = 3 * 8 * F32
    assert r.per_module["p.child"] == row  # x
    assert r.per_module["p"] == row  # the child's output, saved by sin after the child returned
    # Top level: y by cos, sin(...) and cos(y) by their product; "* scale" saves only the buffer
    # (the product is not needed: the buffer takes no gradient), which the module keeps anyway.
    assert r.per_module[""] == 3 * row
    assert r.total_bytes == 5 * row
    assert "(top level)" in str(r)
    with abp.memory.SavedTensorsCounter() as counter:  # the buffer was saved: left out, not missed
        model(x, y)
    assert any(s.shape == (8,) and s.storage_ptr == model.scale.data_ptr() for s in counter.tensors)
    # activation_bytes leaves out the model's parameters and buffers, as the report does.
    assert counter.total_bytes > r.total_bytes
    assert counter.activation_bytes(model) == r.total_bytes


def test_backward_runs_and_grads_are_left_as_they_were():
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(5, 8, requires_grad=True)
    before = torch.full_like(seq[0].weight, 7.0)
    seq[0].weight.grad = before
    calls: List[torch.Size] = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        out.register_hook(lambda g: calls.append(g.shape))
        return out.pow(2).sum()

    abp.memory.report(seq, x, loss_fn=loss_fn)
    assert calls == [torch.Size([5, 4])], "the report ran backward through the loss"
    assert seq[0].weight.grad is before and bool((before == 7.0).all())
    assert seq[2].weight.grad is None and x.grad is None


def test_buffers_and_random_streams_are_left_as_they_were():
    """A report mid-training must not feed its batch into BatchNorm's statistics, nor move the
    random streams (the next dropout masks), of the model or of the baseline."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.GELU(), nn.Dropout(0.1), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 10))
    converted, _ = abp.convert(model, "lowmembp", example_inputs=(torch.randn(4, 3, 8, 8),))
    x = torch.randn(4, 3, 8, 8)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (model, converted)]
    rng = torch.get_rng_state()
    report = abp.memory.report(converted, (x,), baseline=model)
    assert report.total_bytes > 0 and report.baseline_total_bytes > 0
    for m, saved in zip((model, converted), before):
        changed = [k for k, v in m.state_dict().items() if not torch.equal(v, saved[k])]
        assert not changed, changed
    assert torch.equal(torch.get_rng_state(), rng), "the report advanced torch's random stream"


def test_nothing_requires_grad_saves_nothing():
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).requires_grad_(False)
    r = abp.memory.report(seq, torch.randn(2, 8))
    assert r.total_bytes == 0 and sum(r.per_module.values()) == 0


def test_baseline_is_measured_on_the_same_inputs():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    baseline = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    r = abp.memory.report(model, x, baseline=baseline)
    row = 4 * 8 * F32
    assert (r.total_bytes, r.baseline_total_bytes) == (2 * row, 2 * row)
    assert r.baseline_per_module == {"0": row, "1": row, "2": 0}
    text = str(r)
    assert "baseline" in text.splitlines()[0] and len(text.splitlines()) == 1 + 3 + 1  # header, 3 modules, total


def test_output_tuple_is_summed_and_a_model_without_tensor_output_needs_loss_fn():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor):
            return self.a(x), self.b(x).exp()

    x = torch.randn(2, 4, requires_grad=True)
    r = abp.memory.report(Pair(), x)
    assert r.per_module == {"a": 2 * 4 * F32, "b": 0, "": 2 * 4 * F32}  # x (shared by a, b); exp's result

    class NoTensor(nn.Module):
        def forward(self, x: torch.Tensor):
            return {"ids": x.argmax(-1), "note": "none"}  # no floating-point tensor to sum

    with pytest.raises(TypeError, match=r"output \(dict\) holds no floating-point tensor; pass loss_fn="):
        abp.memory.report(NoTensor(), x)
    r = abp.memory.report(NoTensor(), x, loss_fn=lambda out: x.neg().sum())
    assert r.total_bytes == 0


def test_outputs_in_mappings_and_dataclasses_are_summed_by_default():
    """A model returning a dict, or a transformers ModelOutput (a mapping, and a dataclass), made
    the default loss fail: "the model returned no tensor; pass loss_fn=" (a ViT classifier's
    logits in `out.logits`). Their tensors, however nested, are summed as a tuple's are."""
    import dataclasses

    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor
        extra: tuple

    class Returns(nn.Module):
        def __init__(self, wrap) -> None:
            super().__init__()
            self.a, self.b, self.wrap = nn.Linear(4, 4), nn.Linear(4, 4), wrap

        def forward(self, x: torch.Tensor):
            return self.wrap(self.a(x), self.b(x).exp())

    x = torch.randn(2, 4, requires_grad=True)
    expected = abp.memory.report(Returns(lambda a, b: (a, b)), x).per_module
    for wrap in (lambda a, b: {"logits": a, "hidden": [b]}, lambda a, b: Output(a, (b, None))):
        assert abp.memory.report(Returns(wrap), x).per_module == expected


def test_argument_errors():
    x = torch.randn(2, 2)
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        abp.memory.report(lambda t: t, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="baseline: expected a torch.nn.Module or None"):
        abp.memory.report(nn.Linear(2, 2), x, baseline="original")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs: expected a tensor or a tuple of positional arguments, got dict "
                                         r"\(keyword arguments go in kwargs=\)"):
        abp.memory.report(nn.Linear(2, 2), {"x": x})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="kwargs: expected a mapping of argument names to values, got tuple"):
        abp.memory.report(nn.Linear(2, 2), kwargs=(x,))  # type: ignore[arg-type]


def test_keyword_arguments_are_passed_and_counted_as_positional_ones():
    # A vision-language model's call needs input_ids, pixel_values and more by name (Qwen2-VL's
    # mm_token_type_ids is its 12th positional argument); report took positional ones alone.
    model = TwoInputs()
    x, y = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    by_position = abp.memory.report(model, (x, y), baseline=TwoInputs())
    by_name = abp.memory.report(model, kwargs={"y": y, "x": x}, baseline=TwoInputs())
    mixed = abp.memory.report(model, x, kwargs={"y": y})
    assert by_name.per_module == by_position.per_module == mixed.per_module
    assert by_name.baseline_total_bytes == by_position.baseline_total_bytes
    assert x.grad is None and y.grad is None, "the inputs' .grad is left as it was"


def test_counters_see_what_compress_saved_keeps_instead():
    """compress_saved's hooks hide the saves from an outer counter; it reports its codes instead, so
    the one accounting counts compressed bytes (and parameters, which the report leaves out)."""
    import abp.compress as C

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    # A hidden state on the gradient path (an input that requires no grad is kept as it is).
    x = torch.randn(32, 256, requires_grad=True).clone()
    params = {abp.memory.storage_key(p)[:2] for p in model.parameters()}
    with abp.memory.SavedTensorsCounter() as counter:
        with C.compress_saved(bits=2, allow_low_bits=True) as compressed:
            model(x).sum().backward()
    activations = [s for s in counter.tensors if (s.device, s.storage_ptr) not in params]
    assert abp.memory.distinct_bytes(activations) == compressed.stats["bytes_stored"]
    assert 0 < compressed.stats["bytes_stored"] < compressed.stats["bytes_in"] / 8
    assert len(counter.tensors) > len(activations)  # the Linears' weights were seen, and left out here


def test_convert_compress_recipe_is_counted_by_report():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    # A hidden state on the gradient path (an input that requires no grad is kept as it is).
    x = torch.randn(32, 256, requires_grad=True).clone()
    converted, changes = abp.convert(model, "compress", bits=4)
    assert [c.action for c in changes] == ["wrapped"]
    r = abp.memory.report(converted, (x,), baseline=model)
    # fp32 at 4 bits: codes are 1/8 of the values, plus 8 header bytes per group of 256.
    assert r.baseline_total_bytes is not None and r.total_bytes < r.baseline_total_bytes / 6
    torch.testing.assert_close(converted(x), model(x))
    import copy
    import io
    twin = copy.deepcopy(converted)  # a copy compresses too (its own hooks)
    assert abp.memory.report(twin, (x,)).total_bytes == r.total_bytes
    if abp._custom_ops.enabled():  # torch >= 2.4 (torch 1.13 wraps the forward: not pickled)
        buffer = io.BytesIO()
        torch.save(converted, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert abp.memory.report(loaded, (x,)).total_bytes == r.total_bytes
        # A forward set on the instance (a user's or accelerate's wrapper) still runs.
        calls = []
        plain_forward = model.forward
        model.forward = lambda inp: calls.append(1) or plain_forward(inp)
        wrapped, _ = abp.convert(model, "compress", bits=4)
        wrapped(x)
        assert calls == [1]
        del model.forward
    # A forward that raises leaves no compress_saved block open: what is saved next is not compressed.
    broken, _ = abp.convert(torch.nn.Sequential(torch.nn.Linear(256, 4)), "compress")
    with pytest.raises(RuntimeError):
        broken(torch.randn(3, 5))
    t = torch.randn(4096, requires_grad=True)
    assert torch.equal((t * t).grad_fn._saved_self, t)

def test_a_counter_used_out_of_order_says_so() -> None:
    counter = abp.memory.SavedTensorsCounter()
    with pytest.raises(RuntimeError, match="exited, but it is not counting"):
        counter.__exit__(None, None, None)
    with counter:
        with pytest.raises(RuntimeError, match="already counting"):
            counter.__enter__()
    (torch.randn(3, requires_grad=True) * 2).sin()  # the hooks are gone: nothing is counted after
    assert counter.tensors == []


def test_a_report_inside_a_compress_saved_block_warns_that_the_block_does_not_see_it():
    """The report's hooks are innermost, so a compress_saved block open around the call compressed
    nothing and the report showed raw bytes, without a word (helper's trial)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    x = torch.randn(32, 64)
    plain = abp.memory.report(model, x).total_bytes
    with pytest.warns(RuntimeWarning, match="inside an open compress_saved block, whose hooks never see"):
        with abp.compress_saved(bits=4):
            inside = abp.memory.report(model, x).total_bytes
    assert inside == plain
