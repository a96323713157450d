"""Norm look-alikes shared by test_convert and test_recognise (classes written as model code writes them)."""
from __future__ import annotations

import torch
from torch import nn


class BertLayerNorm(nn.Module):
    """Old BERT code's LayerNorm: parameters named gamma / beta, eps=1e-12 hard-coded (no attribute)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.gamma * (x - u) / torch.sqrt(s + 1e-12) + self.beta


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + w), w starting at zeros, computed in float32."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)
