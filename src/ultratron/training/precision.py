"""Mixed precision: parameters, gradients and optimizer state stay fp32 (the master weights);
under "bf16" the forward and backward compute runs in bf16 through autocast, on CPU and GPU;
"fp8" is bf16 with the blocks' linear layers in fp8 (`parallel/float8.py` converts them)."""

from __future__ import annotations

import contextlib

import torch


def autocast(precision: str, device: torch.device):
    if precision in ("bf16", "fp8"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
