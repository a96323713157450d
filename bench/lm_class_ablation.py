"""Which classes of a language model's saved tensors tolerate how few bits? (measurement, CPU)

The charlm task of real_tasks.py (a LLaMA-style byte-level model of the Python standard
library's source), 300 steps, seed 0, `compress_saved(bits_for=...)` with every saved tensor at a
base width except one class at another: first everything at 2 bits but one class at 8, then
everything at 4 bits but one class at 1. Each saved tensor's class is read off the innermost
module saving it and its shape:

  norm    what the RMSNorms save (their input, and the input times the weight)
  linear  what the Linear layers save (their inputs)
  act     what the SiLU saves (its input)
  mul     what SwiGLU's product saves (its two factors)
  sdpa    fused attention's value and output (query and key: 8 bits by the op rule)
  rope    the rotary tables the rotation's products save
  loss    cross-entropy's log-probabilities (8 bits by the op rule)

Prints the validation loss (nats per byte) and the largest gradient norm (sampled every 10 steps;
the committed output sampled every step) of each run. Usage
(torch 2.x lane): PYTHONPATH=bindings/python ABP_LIBRARY=... ABP_KERNEL_DIR=... python
bench/lm_class_ablation.py [steps]. The committed output: results/lm-class-ablation-*.txt.
"""
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import abp  # noqa: E402
import real_tasks as rt  # noqa: E402

CLASSES = ("norm", "linear", "act", "mul", "sdpa", "rope", "loss")


def classify(path: str, shape: tuple) -> str:
    """The class of a tensor saved inside the module at `path` (a TinyLlama), by module and shape."""
    last = path.split(".")[-1]
    if last in ("attn_norm", "mlp_norm", "norm"):
        return "norm"
    if last in ("q", "k", "v", "o", "gate", "up", "down", "head"):
        return "linear"
    if last == "act":
        return "act"
    if path == "<outside>":
        return "loss"
    if len(shape) == 4:  # saved in a block, outside its submodules: attention, the rotation, SwiGLU
        return "sdpa"
    return "rope" if len(shape) == 2 else "mul"


def run(base: int, cls: str, cls_bits: int, steps: int, seed: int = 0) -> tuple:
    """Validation loss and largest sampled gradient norm after `steps` steps of real_tasks' charlm
    with every saved tensor at `base` bits but class `cls` at `cls_bits` (32: as it is)."""

    def setting(model: torch.nn.Module):
        if base == 32 and cls_bits == 32:
            return contextlib.nullcontext
        stack = []  # the modules running now, innermost last
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name))
            module.register_forward_hook(lambda m, a, o, name=name: (stack.pop(), None)[1])

        def bits_for(t: torch.Tensor) -> int:
            path = stack[-1] if stack else "<outside>"
            return cls_bits if classify(path, tuple(t.shape)) == cls else base

        return lambda: abp.compress_saved(bits_for=bits_for, guard=False)

    r = rt.train("charlm", setting, seed, steps=steps)
    return r["val_loss"], r["grad_norm_max"]


def main() -> None:
    torch.set_num_threads(2)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    configs = [(32, None, 32), (2, None, 2), (4, None, 4)]
    configs += [(2, c, 8) for c in CLASSES] + [(4, c, 1) for c in CLASSES]
    for base, cls, cls_bits in configs:
        start = time.time()
        loss, largest = run(base, cls, cls_bits, steps)
        print(f"base={base} {cls}={cls_bits}: val={loss:.3f} gmax={largest:.1f} ({time.time() - start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
