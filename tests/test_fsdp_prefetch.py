"""ZeRO-3's backward prefetch (parallel/data.py): under gloo (a CPU) every FSDP2 module prefetches
only itself in backward, a no-op, so one gathered block is held at a time instead of two; under any
other backend (NCCL on a GPU, and `simulate`'s fake group, which stands in for one) FSDP2 keeps its
default. One process, a group of one: which modules each FSDP2 state will prefetch, no data."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.llama.parallel_plan import PLAN
from ultratron.parallel import data
from ultratron.parallel.data import apply_fsdp


class _Dims:
    zero = 3

    def __init__(self):
        self.dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _sharded(monkeypatch, backend: str | None):
    if backend is not None:  # the backend FSDP2's prefetch choice reads, as another device would have it
        monkeypatch.setattr(data.dist, "get_backend", lambda *a, **k: backend)
    args = LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, max_seq_len=32)
    model = apply_fsdp(Llama(args), _Dims(), "fp32", PLAN)
    modules = [*PLAN.blocks(model).values(), model]
    return [(m, m._get_fsdp_state()._states_to_backward_prefetch) for m in modules]


def test_under_gloo_each_block_and_the_root_prefetch_only_themselves(gloo, monkeypatch):
    assert dist.get_backend() == "gloo" and not data.prefetches_in_backward()
    for module, prefetch in _sharded(monkeypatch, None):
        assert prefetch == [module._get_fsdp_state()], module


@pytest.mark.parametrize("backend", ["nccl", "fake"])
def test_other_backends_keep_fsdp2s_default_prefetch(gloo, monkeypatch, backend):
    for module, prefetch in _sharded(monkeypatch, backend):
        assert prefetch == [], (backend, module)  # empty: FSDP2 prefetches the next block by itself
