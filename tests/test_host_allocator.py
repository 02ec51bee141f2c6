"""training/allocator.py: on a CPU the trainer fixes glibc's mmap threshold, so every tensor of a
MiB or more is its own mapping, given back when freed; on a GPU, or where the environment already
sets glibc's tunable, it leaves malloc alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from ultratron.training import allocator


@pytest.fixture
def calls(monkeypatch):
    made = []
    monkeypatch.delenv(allocator.ENV, raising=False)
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda param, value: made.append((param, value)) or 1)
    return made


def test_a_cpu_device_sets_the_threshold(calls):
    assert allocator.configure_host_allocator(torch.device("cpu"))
    assert calls == [(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD)]


def test_a_gpu_device_leaves_malloc_alone(calls):
    assert not allocator.configure_host_allocator(torch.device("cuda", 0))
    assert calls == []


def test_the_environments_own_threshold_wins(calls, monkeypatch):
    monkeypatch.setenv(allocator.ENV, "4194304")
    assert not allocator.configure_host_allocator(torch.device("cpu"))
    assert calls == []


MAPPED = textwrap.dedent("""
    import ctypes, sys, torch
    sys.path[:0] = {path!r}
    from ultratron.training.allocator import configure_host_allocator
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info
    torch.empty(4 * 2**20)  # 16 MiB, mmapped, then freed: glibc's dynamic threshold rises to it
    configured = {configure} and configure_host_allocator(torch.device("cpu"))
    before = libc.mallinfo2().hblks
    kept = [torch.empty(2**19) for _ in range(8)]  # 2 MiB each
    print(configured, libc.mallinfo2().hblks - before)
""")


def _mapped(configure: bool) -> tuple[str, int]:
    """In a fresh process: (configured?, how many of eight 2 MiB tensors got a mapping of their own)."""
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MAPPED.format(path=sys.path, configure=configure)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    configured, mapped = out.stdout.split()
    return configured, int(mapped)


@pytest.mark.skipif(allocator._mallopt() is None or not hasattr(allocator.ctypes.CDLL(None), "mallinfo2"),
                    reason="not glibc (≥ 2.33)")
def test_with_glibc_2_mib_tensors_are_mmapped_even_after_a_16_mib_free_raised_the_dynamic_threshold():
    """Freeing a 16 MiB tensor raises glibc's dynamic threshold to 16 MiB, so 2 MiB tensors then come
    from the heap (which keeps them when freed); configured, each comes from a mapping of its own."""
    assert _mapped(configure=True) == ("True", 8)
    assert _mapped(configure=False) == ("False", 0)
