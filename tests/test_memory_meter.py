"""The allocator meter the planner is checked against keeps a kernel's own scratch apart from the
tensors a step creates (what differs between CPUs from what does not)."""

from types import SimpleNamespace

import pytest
import torch

from ultratron.kernels.cpu_linear import onednn_linear, probe
from ultratron.parallel.memory import AllocatedBytes, _kernel_scratch


def test_scratch_is_what_one_operator_call_allocates_and_frees_itself():
    mm, other_mm, empty = (SimpleNamespace(name=n) for n in ("aten::mm", "aten::mm", "aten::empty"))
    events = [
        (1, 0xA, 100, mm),  # the output of mm: freed later by someone else
        (2, 0xB, 40, mm),  # mm's workspace, freed by mm before it returns
        (3, 0xB, -40, mm),
        (4, 0xC, 10, empty),  # a tensor made through another operator, freed by mm: not mm's own
        (5, 0xC, -10, mm),
        (6, 0xD, 7, mm),  # the same address reused by another call of mm: not scratch of the first
        (7, 0xD, -7, other_mm),
        (8, 0xA, -100, None),
    ]
    assert _kernel_scratch(events) == {1, 2}


@pytest.mark.skipif(probe() is not None, reason=f"oneDNN's linear unavailable here: {probe()}")
def test_a_onednn_matmul_counts_its_output_and_keeps_its_scratchpad_apart():
    torch.set_num_threads(1)
    x, w = torch.randn(512, 256), torch.randn(384, 256)
    with AllocatedBytes() as meter:
        y = onednn_linear(x, w)
    output = y.numel() * y.element_size()
    assert meter.peak == meter.end == output  # every byte a tensor the step would hold, nothing else
    # oneDNN allocates its scratchpad through torch's allocator (how much depends on the CPU's kernel)
    assert meter.raw_peak == output + meter.scratch_peak
