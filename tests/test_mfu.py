"""The peak MFU is measured against: a CPU's matmul throughput, measured once and cached."""

import json

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


def test_cpu_matmul_measurement_is_plausible():
    measured = mfu_module.measure_cpu_matmul_flops("fp32", seconds=0.05, size=256)
    assert 1e8 < measured < 1e14
