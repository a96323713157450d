#!/usr/bin/env python3
"""One quantize and one dequantize launch of a large bf16 tensor, for a kernel profiler (ncu):
`ncu --section SpeedOfLight --section WarpStateStats python3 bench/profile_codec.py [bits] [group]`."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))
import abp.compress as C  # noqa: E402

bits = int(sys.argv[1]) if len(sys.argv) > 1 else 2
group = int(sys.argv[2]) if len(sys.argv) > 2 else 256
x = torch.randn(1 << 26, device="cuda", dtype=torch.bfloat16)
c = C.quantize(x, bits, group, seed=1)  # warm-up: module load
torch.cuda.synchronize()
c = C.quantize(x, bits, group, seed=2)
y = C.dequantize(c)
torch.cuda.synchronize()
print("max error", float((y.float() - x.float()).abs().max()))
