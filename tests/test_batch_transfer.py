"""A batch reaches a GPU from pinned host memory with a non-blocking copy (issue 45, part 3); on a CPU
the batch is used where it is. The CUDA copy is stood in for: what is checked is the decision —
pinned first, then `non_blocking` — which a pageable copy would silently make synchronous."""

import torch

from ultratron.parallel.axis import MicroBatch, to_device


def _record_copies(monkeypatch) -> list[tuple]:
    copies: list[tuple] = []
    pinned: set[int] = set()

    def pin_memory(self):
        out = self.clone()
        pinned.add(id(out))
        return out

    def to(self, device, non_blocking=False):
        copies.append((torch.device(device).type, non_blocking, id(self) in pinned))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


def test_to_a_gpu_the_batch_is_pinned_and_copied_non_blocking(monkeypatch):
    copies = _record_copies(monkeypatch)
    batch = MicroBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                       documents=torch.zeros(2, 4, dtype=torch.long))
    batch.to(torch.device("cuda", 0))
    assert copies == [("cuda", True, True)] * 3


def test_on_a_cpu_nothing_is_pinned(monkeypatch):
    copies = _record_copies(monkeypatch)
    to_device(torch.zeros(3), torch.device("cpu"))
    assert copies == [("cpu", True, False)]


def test_on_a_cpu_the_batch_is_the_same_tensors():
    inputs = torch.arange(8).view(2, 4)
    moved = MicroBatch(inputs, inputs + 1).to(torch.device("cpu"))
    assert moved.inputs is inputs and torch.equal(moved.targets, inputs + 1)
