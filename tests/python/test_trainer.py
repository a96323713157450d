"""A converted transformers model trains with the stock transformers.Trainer (no subclass) through
abp's callbacks: abp.vcas.trainer_callback and abp.controller.trainer_callback.

A tiny LLaMA built from a config (no download), converted with recipe lowmembp, trained on an
in-memory list of token batches on the CPU for a few steps. The controller's callback must make
every micro-batch (forward and backward) one controller step, as ``with controller:`` around
them would, compress what the forward saves, estimate at step 0, and leave no saved-tensor hook
behind when a step raises in forward or in backward. Current-torch lane (transformers).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import abp
from abp import compress, vcas
from abp.controller import CompressionController, trainer_callback
from abp_reference import library_on_one_thread

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS, BATCH = 64, 16, 4


_library = pytest.fixture(autouse=True)(library_on_one_thread)


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    torch.manual_seed(0)
    converted, changes = abp.convert(transformers.AutoModelForCausalLM.from_config(config), "lowmembp")
    assert sum(c.action == "replaced" for c in changes) == 7  # 2 x (2 norms, SiLU) and the final norm
    return converted


def _data(n: int = 32) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _trainer(model: torch.nn.Module, tmp_path: Path, callbacks: List[Any], **args: Any) -> Any:
    options = dict(max_steps=3, per_device_train_batch_size=BATCH, learning_rate=1e-3, report_to=[], use_cpu=True,
                   save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path), **{**options, **args})
    return transformers.Trainer(model=model, args=arguments, train_dataset=_data(), callbacks=callbacks)


def _losses(trainer: Any) -> List[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_vcas_callback_calibrates_when_due_in_a_stock_trainer(tmp_path: Path) -> None:
    model = _model()
    controller = vcas.Controller(model, transformers.models.llama.modeling_llama.LlamaDecoderLayer, cal_var_freq=2)
    assert len(controller.linears) == 2 * 7  # q, k, v, o, gate, up, down per layer
    trainer = _trainer(model, tmp_path, [vcas.trainer_callback(controller)], max_steps=4)
    trainer.train()
    # Calibrations at steps 0 and 2, each measuring a positive SGD variance from fresh batches.
    assert controller.steps == 4 and controller.calibrations == 2
    assert controller.last["v_sgd"] > 0
    losses = _losses(trainer)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("order", ["compression first", "vcas first"])
def test_vcas_calibrations_stay_out_of_the_compression_controllers_steps(tmp_path: Path, order: str) -> None:
    """Both callbacks in one Trainer: VCAS calibrates at on_step_begin, which the compression
    callback (listed first) has already begun a step at. The calibration's forwards were that
    step's: compressed (so VCAS measured compressed gradients as exact ones) and replayed by the
    estimate (7x the tensors, 20x the time). They now run outside it, in either order: the
    controller estimates exactly the keys of a run without VCAS, and VCAS measures what it
    measures without the controller."""
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    runs = {}
    for with_compression, with_vcas in ((True, False), (False, True), (True, True)):
        model = _model()
        compression = CompressionController(model, avg_bits=4.0, interval=4, generator=torch.Generator().manual_seed(3))
        sampling = vcas.Controller(model, layer, cal_var_freq=4, generator=torch.Generator().manual_seed(5))
        callbacks = ([trainer_callback(compression)] if with_compression else []) + \
            ([vcas.trainer_callback(sampling)] if with_vcas else [])
        if order == "vcas first":
            callbacks.reverse()
        _trainer(model, tmp_path / str(len(runs)), callbacks, max_steps=1).train()
        runs[(with_compression, with_vcas)] = (compression, sampling)
        if not with_compression:
            compression.remove()
    both_compression, both_vcas = runs[(True, True)]
    assert set(both_compression.bits) == set(runs[(True, False)][0].bits)
    assert both_vcas.calibrations == 1
    assert both_vcas.last["v_sgd"] == pytest.approx(runs[(False, True)][1].last["v_sgd"], rel=1e-6)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_compression_callback_makes_each_micro_batch_a_controller_step(tmp_path: Path, accumulation: int) -> None:
    model = _model()
    controller = CompressionController(model, avg_bits=4.0)  # estimates at step 0 only (interval 1000)
    callback = trainer_callback(controller)
    # What each call of the model sees (a hook on the model itself runs for the Trainer's calls,
    # not for the estimate's replays, and after the callback's hook): the controller's step and
    # the compress_saved block open.
    during: List[Any] = []
    def probe_call(module: Any, args: Any) -> None:
        during.append((controller.step, getattr(compress.open_block(), "label", None)))

    probe = model.register_forward_pre_hook(probe_call)
    trainer = _trainer(model, tmp_path, [callback], gradient_accumulation_steps=accumulation)
    trainer.train()
    probe.remove()
    micro_batches = 3 * accumulation
    # One step per micro-batch, ended (after its backward) before the next forward began; every
    # forward ran inside the controller's compress_saved block.
    assert [step for step, _ in during] == list(range(micro_batches))
    assert all(label == "abp.CompressionController(avg_bits=4)" for _, label in during)
    assert controller.step == micro_batches
    assert controller.estimates == 1 and controller.bits and controller.average_bits() <= 4.0
    stats = controller.stats  # the last step's: compressed, at about 4 of 32 bits
    assert stats["compressed"] > 0 and 0 < stats["bytes_stored"] < 0.3 * stats["bytes_in"], stats
    losses = _losses(trainer)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    # Nothing is left open: a new block opens, and the next forward saves its tensors as they are.
    assert compress.open_block() is None
    x = torch.randn(64, 64, requires_grad=True)
    y = x.exp()
    assert y.grad_fn._saved_result.data_ptr() == y.data_ptr()
    controller.remove()


def test_compression_callback_estimates_what_a_with_block_estimates(tmp_path: Path) -> None:
    """The callback's step 0 records the Trainer's call from hooks; ``with controller:`` around
    the same call (same model, same inputs) records it by wrapping forward. The replays must see
    the same call: the same keys, sensitivities and allocation."""
    model = _model()
    controller = CompressionController(model, avg_bits=4.0)
    callback = trainer_callback(controller)
    first: List[Any] = []
    probe = model.register_forward_pre_hook(
        lambda m, args, kwargs: first.append((args, {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                     for k, v in kwargs.items()})) if not first else None,
        with_kwargs=True)
    _trainer(model, tmp_path, [callback], max_steps=1).train()
    probe.remove()
    assert controller.estimates == 1 and controller.sensitivity

    fresh = _model()  # the same initial parameters
    reference = CompressionController(fresh, avg_bits=4.0)
    args, kwargs = first[0]
    fresh.train()
    with reference:
        fresh(*args, **kwargs).loss.backward()
    assert controller.sensitivity.keys() == reference.sensitivity.keys()
    for key, value in reference.sensitivity.items():
        assert controller.sensitivity[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key
    assert controller.bits == reference.bits
    controller.remove()
    reference.remove()


class _Planted(torch.autograd.Function):
    """Identity whose backward raises: a step failing in backward (as the divergence guard's
    "raise" mode or an out-of-memory error would)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("planted failure in backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_compression_callback_leaves_no_hook_when_a_step_raises(tmp_path: Path, where: str) -> None:
    model = _model()
    controller = CompressionController(model, avg_bits=4.0, interval=1)  # every step records its call
    callback = trainer_callback(controller)
    calls = {"n": 0}

    # Hooks on the model itself, after the callback's: they run for the Trainer's calls (not for
    # the estimate's replays) while the controller's compress_saved block is open.
    def fail_in_forward(module: torch.nn.Module, args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("planted failure in forward")

    def fail_in_backward(module: torch.nn.Module, args: Any, output: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            output["loss"] = _Planted.apply(output["loss"])
        return output

    planted = (model.register_forward_pre_hook(fail_in_forward) if where == "forward"
               else model.register_forward_hook(fail_in_backward))
    with pytest.raises(RuntimeError, match=f"planted failure in {where}"):
        _trainer(model, tmp_path / "1", [callback]).train()
    planted.remove()
    # The first step counted; the failed one not. No compress_saved block and no saved-tensor
    # hook is left: a new block opens, and autograd saves tensors as they are.
    assert controller.step == 1
    assert compress.open_block() is None
    with compress.compress_saved(bits=8):
        pass
    x = torch.randn(64, 64, requires_grad=True)
    y = x.exp()
    assert y.grad_fn._saved_result.data_ptr() == y.data_ptr()
    # Training again (a new Trainer, the same controller) drops the failed step and goes on.
    _trainer(model, tmp_path / "2", [trainer_callback(controller)], max_steps=2).train()
    assert controller.step == 3 and controller.estimates == 3
    controller.remove()


def test_compression_callback_refuses_a_trainer_whose_model_it_does_not_watch(tmp_path: Path) -> None:
    model = _model()
    controller = CompressionController(_model(), avg_bits=4.0)  # built on another model
    with pytest.raises(ValueError, match="not the controller's model"):
        _trainer(model, tmp_path, [trainer_callback(controller)]).train()
    controller.remove()


def test_compression_callback_of_a_compiled_model_says_it_cannot_estimate(tmp_path: Path) -> None:
    """Trainer(torch_compile=True): the callback's hooks record each call at the compiled model's
    edge and its eager replays find tensors to allocate, but the step's own saves are the
    compiled graph's, which no width reaches: the controller warns, estimates nothing and reports
    32 bits (it reported the allocation it never applied)."""
    model = _model()
    controller = CompressionController(model, avg_bits=4.0, interval=2)
    trainer = _trainer(model, tmp_path, [trainer_callback(controller)], max_steps=3, torch_compile=True,
                       torch_compile_backend="aot_eager")
    with pytest.warns(RuntimeWarning, match="none of its saved tensors reached the controller: a torch.compile'd model"):
        trainer.train()
    assert controller.estimates == 0 and controller.average_bits() == 32 and not controller.bits
    assert controller.stats["tensors"] > 0 and controller.stats["compressed"] == 0
    controller.remove()


def test_a_resumed_trainer_run_of_the_random_recipes_continues_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """Recipe "all" (sampled projections, compress_saved's stochastic rounding, lowmembp) holds no
    state of its own and draws from torch's generator, which the Trainer's checkpoint restores:
    steps 3-4 resumed from the step-2 checkpoint log the losses of the run that went on."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)

    def converted() -> torch.nn.Module:
        torch.manual_seed(0)
        model, changes = abp.convert(transformers.AutoModelForCausalLM.from_config(config), "all")
        assert any("SampledLinear" in c.detail for c in changes) and any(c.action == "wrapped" for c in changes)
        return model

    whole = _trainer(converted(), tmp_path, [], max_steps=4, save_strategy="steps", save_steps=2)
    whole.train()
    resumed = _trainer(converted(), tmp_path, [], max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    # The resumed history holds the checkpoint's steps 1-2 and its own 3-4.
    assert len(_losses(whole)) == 4 and _losses(resumed) == _losses(whole)
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4]


def test_a_resumed_trainer_run_under_vcas_continues_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """The callback's calibration batches are drawn from the training set by the Trainer's seed and
    the controller's count of calibrations: a run resumed at step 3 calibrates at step 4 on what
    the uninterrupted run did (an iterator of its own started over and calibrated on step 0's)."""
    saved: Dict[int, Any] = {}

    class SaveController(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self, controller: vcas.Controller) -> None:
            self.controller = controller

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            saved[state.global_step] = copy.deepcopy(self.controller.state_dict())
            return control

    def build() -> Any:
        model = _model()
        return model, vcas.Controller(model, transformers.models.llama.modeling_llama.LlamaDecoderLayer, cal_var_freq=2)

    model, controller = build()
    whole = _trainer(model, tmp_path, [vcas.trainer_callback(controller), SaveController(controller)], max_steps=6,
                     save_strategy="steps", save_steps=3)
    whole.train()
    assert controller.calibrations == 3  # steps 0, 2 and 4
    model, controller = build()
    controller.load_state_dict(saved[3])
    resumed = _trainer(model, tmp_path, [vcas.trainer_callback(controller)], max_steps=6, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert controller.calibrations == 3 and _losses(resumed) == _losses(whole)


def test_vcas_calibrate_names_a_loss_fn_that_returns_no_loss_and_refuses_no_grad() -> None:
    model = _model()
    controller = vcas.Controller(model, transformers.models.llama.modeling_llama.LlamaDecoderLayer)
    batches = [{"input_ids": row[None], "labels": row[None]} for row in torch.stack([d["input_ids"] for d in _data(2)])]
    with pytest.raises(TypeError, match=r"loss_fn\(batch\): expected the scalar loss tensor, got CausalLMOutputWithPast "
                                        r"\(a model's output: return its .loss\)"):
        controller.calibrate(lambda b: model(**b), batches)
    with torch.no_grad(), pytest.raises(RuntimeError, match="calibrate: gradients are off"):
        controller.calibrate(lambda b: model(**b).loss, batches)
    controller.calibrate(lambda b: model(**b).loss.view(1), batches)  # one element is a loss too
    controller.remove()


def test_vcas_callback_reads_an_iterable_dataset_through_its_own_iterator(tmp_path: Path) -> None:
    """An IterableDataset cannot be indexed, even one that defines a length."""

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(_data())

        def __len__(self) -> int:
            return 32

    model = _model()
    controller = vcas.Controller(model, transformers.models.llama.modeling_llama.LlamaDecoderLayer, cal_var_freq=2)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=BATCH, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0), train_dataset=Stream(), callbacks=[vcas.trainer_callback(controller)])
    trainer.train()
    assert controller.calibrations == 2
    controller.remove()
