"""Trains the small pre-LN transformer of lowmembp_demo.py with sampled backward passes.

    PYTHONPATH=bindings/python python3 examples/sampled_demo.py [--steps 40] [--device cpu|cuda]

Runs from the same seed, data and initial weights: exact; WTA-CRS at keep 0.3 and 0.1 on the
attention output and both FFN Linears (``abp.convert(recipe="sampled")``; q/k/v stay exact); and
VCAS (``abp.vcas.Controller``), which calibrates every 10 steps and adapts its keep ratios. It
prints the bytes saved for backward per step, the final training loss, and VCAS's final ratios
and GEMM-FLOPs ratio.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F

import abp
from lowmembp_demo import Block, demo_args, demo_setup, train

#: The Linears WTA-CRS samples in lowmembp_demo's Block: attention output and the FFN.
SAMPLED = ["*.out", "*.fc1", "*.fc2"]


def main() -> None:
    args = demo_args(__doc__, steps=40)
    device, original, data, probe = demo_setup(args)

    def saved_bytes(model: torch.nn.Module) -> int:
        with abp.memory.SavedTensorsCounter() as counter:
            loss = F.cross_entropy(model(probe[0]), probe[1])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return counter.total_bytes

    runs = []
    for name in ("exact", "wtacrs 0.3", "wtacrs 0.1", "vcas"):
        torch.manual_seed(0)
        model = copy.deepcopy(original)
        before_step = None
        extra = ""
        if name.startswith("wtacrs"):
            model, _ = abp.convert(model, recipe="sampled", keep=float(name.split()[1]), layers=SAMPLED, inplace=True)
        controller = None
        if name == "vcas":
            controller = abp.vcas.Controller(model, Block, cal_var_freq=10)

            calibration_order = torch.Generator().manual_seed(2)

            def before_step(loss_of: Callable[[torch.Tensor], torch.Tensor], c: abp.vcas.Controller = controller,
                            order: torch.Generator = calibration_order) -> None:
                if c.due():  # M fresh batches, drawn apart from the training order
                    batches = [torch.randint(0, data[0].shape[0], (args.batch,), generator=order).to(device)
                               for _ in range(c.cal_var_m)]
                    c.calibrate(loss_of, batches)
                c.step()

        stored = saved_bytes(model)
        losses, seconds = train(model, data, args.steps, args.batch, before_step=before_step)
        if controller is not None:
            rho = ", ".join(f"{r:.2f}" for r in controller.activation_ratios)
            nu = sum(controller.weight_ratios.values()) / len(controller.weight_ratios)
            extra = f"; rho [{rho}], mean nu {nu:.2f}, GEMM FLOPs x{controller.flops_ratio():.2f}"
        tail = losses[-10:]
        runs.append((name, stored, sum(tail) / len(tail), seconds, extra))
    exact_bytes = runs[0][1]
    print("saved for backward per step (parameters saved by Linears included):")
    for name, stored, loss, seconds, extra in runs:
        print(f"  {name:<11} {stored / 2**20:6.2f} MiB ({exact_bytes / stored:4.2f}x less)  "
              f"final loss {loss:.4f}  ({seconds:.1f} s){extra}")


if __name__ == "__main__":
    main()
