"""Mixed precision: parameters, gradients and optimizer state stay fp32 (the master weights);
under "bf16" the forward and backward compute runs in bf16 through autocast, on CPU and GPU;
"fp8" is bf16 with the blocks' linear layers in fp8 (`parallel/float8.py` converts them).

What runs where (docs/precision.md): `training.precision auto`, the default, is bf16 on a GPU and
fp32 on a CPU (`config.training.resolve_precision`; the trainer settles it on the device it picks,
`settle_precision`). On a GPU the fp32 matmuls that remain (fp32 runs, the router, the loss under
autocast's fp32 ops) run in TF32 (`configure_matmuls`), 10 bits of mantissa at the tensor cores'
rate; a CPU keeps full fp32 matmuls."""

from __future__ import annotations

import contextlib

import torch

from ultratron.config.precision import precision_for


def autocast(precision: str, device: torch.device):
    if precision in ("bf16", "fp8"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def settle_precision(training, device: torch.device) -> str:
    """training.precision, with an `auto` the config resolved without torch made the device's own:
    the config guessed from the driver, the trainer knows the device it picked."""
    if getattr(training, "precision_auto", False):
        training.precision = precision_for(device.type)
    return training.precision


def configure_matmuls(device: torch.device) -> None:
    """TF32 for fp32 matmuls on a GPU ("high": torch's legacy switch, which torch.compile's
    Inductor reads; its newer per-backend one may not be mixed with it); nothing on a CPU."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
