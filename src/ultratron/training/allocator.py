"""The host allocator of a training process on a CPU.

glibc's malloc serves a request of at least M_MMAP_THRESHOLD bytes with its own mmap, returned to
the system by free; smaller ones come from the heap (arenas), whose freed memory stays with the
process until the top of the heap is free (and then only above M_TRIM_THRESHOLD). The threshold
starts at 128 KiB but is dynamic: freeing an mmapped chunk raises it to that chunk's size, up to
32 MiB on 64-bit (mallopt(3), "M_MMAP_THRESHOLD"). A training step frees large tensors early, so the
threshold soon sits at 32 MiB, and FSDP2's gathered parameters (8–32 MiB each for a 1-2 B model's
block), its all-gather buffers, activations and gradients then land in the heap, where what one
block frees is not what the next one asks for: the heap fragments and the resident set keeps the
high-water mark of many blocks (measured on benchmarks/start_at_scale.py's LoRA run: each rank's
peak 0.57–0.61 × the model's fp32 bytes above the tiny run's, 0.45–0.46 with a fixed 1 MiB
threshold). Setting the threshold explicitly turns the dynamic adjustment off (mallopt(3): so does
setting M_TRIM_THRESHOLD, M_TOP_PAD or M_MMAP_MAX), so every tensor of at least `MMAP_THRESHOLD`
bytes gets its own mapping and gives it back when freed. The cost: a page fault per touched page
of each new large tensor, and a munmap per free (docs/performance.md, "Host memory on a CPU", has
the step times: no difference shows within a shared machine's noise).

A GPU run's tensors live on the device (its host allocations are small and few), so nothing is set
there. glibc only: elsewhere (musl, macOS) `mallopt` is absent and this does nothing. A user's own
MALLOC_MMAP_THRESHOLD_ (glibc's environment tunable, read at the process's first malloc) wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 * 2**20  # bytes; chosen by measuring RSS and step time (docs/performance.md)
ENV = "MALLOC_MMAP_THRESHOLD_"


def configure_host_allocator(device: torch.device, threshold: int = MMAP_THRESHOLD) -> bool:
    """On a CPU device, a fixed mmap threshold of `threshold` bytes for glibc's malloc (see the module
    doc). Returns whether it was set: not on another device, not without glibc's mallopt, not when
    the environment already sets one."""
    if device.type != "cpu" or os.environ.get(ENV):
        return False
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


def _mallopt():
    """glibc's `int mallopt(int param, int value)`, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
