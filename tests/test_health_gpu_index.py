"""The health check reads the NVML device of this process's GPU (issue 45, part 3): found by the
GPU's UUID or PCI bus id, not by the CUDA ordinal, which under CUDA_VISIBLE_DEVICES (or Slurm's
GPU binding) counts only the visible GPUs and would name another job's. Fake NVML and CUDA data."""

import sys
import types

import pytest

from ultratron.training import health
from ultratron.training.health import GpuMonitor, nvml_index

# a node of four GPUs as NVML numbers them: (UUID, PCI bus id)
NODE = [("GPU-aaaa1111-0000-0000-0000-000000000000", "00000000:18:00.0"),
        ("GPU-bbbb2222-0000-0000-0000-000000000000", "00000000:3B:00.0"),
        ("GPU-cccc3333-0000-0000-0000-000000000000", "00000000:86:00.0"),
        ("GPU-dddd4444-0000-0000-0000-000000000000", "00000000:AF:00.0")]


def test_by_uuid_as_torch_spells_it():
    # Slurm bound GPUs 2 and 3 to this task: CUDA's ordinal 0 is NVML's 2
    assert nvml_index(0, NODE, uuid="cccc3333-0000-0000-0000-000000000000", visible="2,3") == 2


def test_by_pci_bus_id():
    assert nvml_index(1, NODE, bus_id="00000000:af:00.0", visible="2,3") == 3
    assert nvml_index(0, NODE, bus_id="3b:00.0") == 1  # (without the domain)


@pytest.mark.parametrize("visible, ordinal, expected", [
    ("2,3", 1, 3),  # indices
    ("GPU-bbbb2222-0000-0000-0000-000000000000", 0, 1),  # a whole UUID
    ("GPU-dddd", 0, 3),  # a unique prefix, as CUDA accepts
    ("1", 1, None),  # no such visible GPU
    (None, 2, 2),  # every GPU visible: the ordinal is NVML's index
])
def test_by_cuda_visible_devices(visible, ordinal, expected):
    assert nvml_index(ordinal, NODE, visible=visible) == expected


def fake_pynvml(devices):
    handles = {i: f"handle-{i}" for i in range(len(devices))}
    by_handle = {h: devices[i] for i, h in handles.items()}
    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetUUID=lambda h: by_handle[h][0].encode(),
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=by_handle[h][1].encode()),
        nvmlEventSetCreate=lambda: None, nvmlDeviceRegisterEvents=lambda *a: None,
        nvmlEventTypeXidCriticalError=0)


def test_the_monitor_of_cuda_device_0_watches_the_bound_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(health, "cuda_identity", lambda ordinal: ("cccc3333-0000-0000-0000-000000000000", None))
    monitor = GpuMonitor(cuda_device=0)
    assert [index for index, _ in monitor.handles] == [2]


def test_a_gpu_nvml_does_not_know_is_not_replaced_by_another(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(NODE))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-ffff")
    monkeypatch.setattr(health, "cuda_identity", lambda ordinal: (None, None))
    monitor = GpuMonitor(cuda_device=0)
    assert monitor.handles == []
    assert "no GPU matching CUDA device 0" in monitor.check(90).summary
