"""The GPU generator's state in a checkpoint is this process's device's only (issue 45, part 3):
saved with `get_rng_state()`, restored with `set_rng_state()`; a checkpoint from before, which held
every visible GPU's state in a list, restores its entry at this device's index. On a CPU the CUDA
calls are stood in for by a fake node with a chosen number of GPUs."""

import pytest
import torch

from ultratron.training import state


class FakeCuda:
    """`torch.cuda`'s generator calls on a node with `count` GPUs, this process on `current`."""

    def __init__(self, count: int, current: int = 0):
        self.count, self.current = count, current
        self.states = [torch.tensor([i], dtype=torch.uint8) for i in range(count)]
        self.set_calls: list[tuple[int, torch.Tensor]] = []

    def _device(self, index: int) -> int:
        if index >= self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(cuda, "set_rng_state", lambda s, device="cuda": self.set_calls.append((self.current, s)))

        def set_all(states):
            for i, s in enumerate(states):
                self.set_calls.append((self._device(i), s))
        monkeypatch.setattr(cuda, "set_rng_state_all", set_all)


def test_saves_one_state_of_the_own_device(monkeypatch):
    FakeCuda(count=8, current=3).install(monkeypatch)
    saved = state.rng_state()["cuda"]
    assert isinstance(saved, torch.Tensor) and saved.tolist() == [3]


def test_resume_on_a_node_with_fewer_gpus(monkeypatch):
    FakeCuda(count=8, current=0).install(monkeypatch)
    saved = state.rng_state()
    fewer = FakeCuda(count=1, current=0)
    fewer.install(monkeypatch)
    state.set_rng_state(saved)  # an 8-GPU checkpoint on a 1-GPU node: no invalid ordinal
    assert [(i, s.tolist()) for i, s in fewer.set_calls] == [(0, [0])]


def test_old_list_checkpoint_restores_the_entry_of_this_device(monkeypatch):
    old = state.rng_state() | {"cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(4)]}
    node = FakeCuda(count=2, current=1)
    node.install(monkeypatch)
    state.set_rng_state(old)
    assert [(i, s.tolist()) for i, s in node.set_calls] == [(1, [1])]


@pytest.mark.parametrize("saved, index, expected", [
    (torch.tensor([7]), 5, [7]),  # this format: the one state, whatever the index
    ([torch.tensor([0]), torch.tensor([1])], 1, [1]),  # a list: the entry at this device's index
    ([torch.tensor([0])], 2, None),  # a list without one there: the generator keeps its seeding
])
def test_own_cuda_state_rule(saved, index, expected):
    own = state.own_cuda_state(saved, index)
    assert (own.tolist() if own is not None else None) == expected
