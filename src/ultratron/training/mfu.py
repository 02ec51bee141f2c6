"""Model FLOPs utilisation: the peak a step is measured against, and the MFU of each step.

On a GPU the peak is the dense figure of the hardware table (`planning.hardware`). A CPU has no
datasheet peak, so its matmul throughput is measured (cached per machine, thread count and torch
version in ~/.cache/ultratron/cpu_peak.json). A peak measured while the CPU was busy comes out
low; when training itself goes faster, the meter measures again (once) rather than report an
MFU above 100%. MFU counts model FLOPs only (`planning.flops`), never recomputation.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from ultratron import atomic
from ultratron.planning.flops import mfu
from ultratron.planning.hardware import dtype_key, peak_flops


def default_cache_path() -> Path:
    return Path.home() / ".cache" / "ultratron" / "cpu_peak.json"


def measure_cpu_matmul_flops(dtype: str = "fp32", seconds: float = 1.0, size: int = 1024) -> float:
    """Best FLOP/s of repeated square matmuls on this CPU with torch's current thread count."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(size, size, dtype=torch_dtype)
    b = torch.randn(size, size, dtype=torch_dtype)
    torch.mm(a, b)  # warm-up: first call pays for thread-pool start and kernel selection
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
        runs += 1
    return 2.0 * size**3 / best


def _cpu_key(dtype: str) -> str:
    return f"{platform.machine()}|{platform.processor() or 'cpu'}|{os.cpu_count()}|" \
           f"threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"


def cpu_peak_flops(dtype: str = "fp32", cache_path: Path | None = None, refresh: bool = False) -> tuple[float, str]:
    """Measured matmul FLOP/s of this CPU for `dtype`, cached per machine, thread count and torch version.

    A peak is a maximum: a measurement taken while other work shares the CPU comes out low. So
    `refresh=True` measures again and keeps the larger of the old and new figures."""
    path = cache_path or default_cache_path()
    key = _cpu_key(dtype)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    if key in cache and not refresh:
        return float(cache[key]), f"measured {dtype} matmul on this CPU (cached in {path})"
    value = max(measure_cpu_matmul_flops(dtype), float(cache.get(key, 0.0)))
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, cache, indent=1, sort_keys=True)  # never a half-written cache
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return value, f"measured {dtype} matmul on this CPU"


def device_peak_flops(device: torch.device, precision: str, cache_path: Path | None = None,
                      refresh: bool = False) -> tuple[float, str]:
    """(peak FLOP/s, its source) for the device this rank trains on. A CPU emulates fp8 with bf16
    matmuls, so its fp8 peak is its measured bf16 one."""
    if device.type == "cpu":
        key = "bf16" if precision == "fp8" else dtype_key(precision)
        if key not in ("fp32", "bf16", "fp16"):
            return 0.0, f"no CPU measurement for dtype {precision!r}"
        return cpu_peak_flops(key, cache_path, refresh)
    return peak_flops(torch.cuda.get_device_name(device), precision)


class MfuMeter:
    """The MFU of each step against the device's peak; re-measures a CPU peak that training beats."""

    def __init__(self, device: torch.device, precision: str, flops_per_token: float, world_size: int, log):
        self.device, self.precision, self.log = device, precision, log
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak, self.source = device_peak_flops(device, precision)
        self._refreshed = False

    def __call__(self, tokens_per_sec: float) -> float:
        per_device = tokens_per_sec / self.world_size
        achieved = per_device * self.flops_per_token
        if self.device.type == "cpu" and achieved > self.peak and not self._refreshed:
            self._refreshed = True
            old = self.peak
            self.peak, self.source = device_peak_flops(self.device, self.precision, refresh=True)
            self.log(f"mfu: training reached {achieved / 1e9:.0f} GFLOP/s, above the cached peak of "
                     f"{old / 1e9:.0f}; re-measured the peak: {self.peak / 1e9:.0f} GFLOP/s")
        return mfu(per_device, self.flops_per_token, self.peak)
