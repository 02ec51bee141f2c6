"""The one timer the benchmarks' measurements share."""

from __future__ import annotations

import time

import torch


def seconds_of(run, device) -> float:
    """Wall seconds of one call of `run` on `device` (a GPU's queued work waited for)."""
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
