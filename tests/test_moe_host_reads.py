"""No host read in a mixture of experts' layer loop (issue 45, part 3): routing's counts stay on the
device, and the experts run as grouped matmuls over them, so a GPU never waits for the host to learn
how many rows each expert got. Counted here: every way a tensor's values reach Python (`tolist`,
`item`, and the dispatcher's `_local_scalar_dense`, which `int()`/`float()`/`bool()` of a tensor go
through) during a training step's forward and backward of an MoE model."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ultratron.config import load_config
from ultratron.models import moe
from ultratron.models.registry import build_model


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values to the host while active."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads: list[str] = []
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.reads.append(_name)
                return _original(tensor, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


def _model(capacity: float):
    cfg = load_config(None, ["--model.preset", "moe-tiny", "--model.n_layers", "3", "--model.dim", "32",
                             "--model.n_heads", "2", "--model.n_kv_heads", "2", "--model.vocab_size", "128",
                             "--model.moe_capacity_factor", str(capacity)])
    torch.manual_seed(0)
    return build_model(cfg.model).train()


@pytest.mark.parametrize("capacity", [0.0, 1.0])  # dropless, and with slots dropped
def test_a_step_of_an_moe_model_reads_nothing_to_the_host(monkeypatch, capacity):
    model = _model(capacity)
    tokens = torch.randint(0, 128, (2, 24))
    with HostReads(monkeypatch) as counter:
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
    assert counter.reads == []


def test_grouped_experts_equal_one_matmul_chain_per_expert_and_dropped_rows_are_zero():
    torch.manual_seed(0)
    experts, counts = moe.GroupedExperts(4, 16, 32), [5, 0, 7, 2]
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w)
    x = torch.randn(17, 16)  # 14 rows routed, the last 3 dropped
    grouped = experts(x, torch.tensor(counts))
    chain = moe._swiglu_per_expert(x, counts, experts.w1, experts.w2, experts.w3)
    assert torch.equal(grouped, chain)
    assert torch.equal(grouped[14:], torch.zeros(3, 16))


def test_a_dropped_slot_sends_no_gradient_to_its_token():
    """The grouped matmul leaves rows past the last expert's unwritten, in the output and in the
    input's gradient: the dropped rows' gradient reaching their tokens is zero, not what was there."""
    torch.manual_seed(0)
    experts = moe.GroupedExperts(2, 8, 16)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w)
    x = torch.randn(6, 8, requires_grad=True)
    experts(x, torch.tensor([2, 1])).sum().backward()
    assert torch.equal(x.grad[3:], torch.zeros(3, 8)) and x.grad[:3].abs().sum() > 0
