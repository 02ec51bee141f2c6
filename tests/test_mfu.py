"""The peak MFU is measured against: a CPU's matmul throughput, measured once and cached."""

import json
from types import SimpleNamespace

import torch

from ultratron.training import mfu as mfu_module
from ultratron.training.mfu import cpu_peak_flops, device_peak_flops


def test_cpu_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mfu_module, "measure_cpu_matmul_flops", lambda dtype: calls.append(dtype) or 1.5e11)
    cache = tmp_path / "sub" / "cpu_peak.json"
    first = cpu_peak_flops("fp32", cache_path=cache)
    second = device_peak_flops(torch.device("cpu"), "float32", cache_path=cache)  # spelled as torch does
    assert first[0] == second[0] == 1.5e11
    assert calls == ["fp32"]
    assert "cached" in second[1]
    assert list(json.loads(cache.read_text()).values()) == [1.5e11]


def test_cpu_matmul_rate_is_two_n_cubed_flops_over_the_fastest_timed_matmul(monkeypatch):
    """The measurement's arithmetic under a scripted clock that moves only inside torch.mm: the
    warm-up (scripted fastest, so counting it would show) is not timed, at least three matmuls are,
    and more until `seconds` have passed; the figure is 2·n³ over the fastest one."""
    durations = iter([2.0**-20, 0.25, 0.375, 0.25, 0.125, 0.0625])  # warm-up, then the timed matmuls
    clock, calls, real_mm = [0.0], [], torch.mm

    def scripted_mm(a, b):
        calls.append((tuple(a.shape), tuple(b.shape), a.dtype, b.dtype))
        clock[0] += next(durations)
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", scripted_mm)
    monkeypatch.setattr(mfu_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    measured = mfu_module.measure_cpu_matmul_flops("bf16", seconds=1.0, size=64)
    # 0.25 + 0.375 + 0.25 after three runs is under the 1 s deadline, so a fourth runs; it reaches the
    # deadline, so the sixth duration is never used. Every duration is a binary fraction: exact sums.
    assert calls == [((64, 64), (64, 64), torch.bfloat16, torch.bfloat16)] * 5
    assert measured == 2 * 64**3 / 0.125
