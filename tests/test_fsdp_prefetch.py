"""ZeRO-3's units and backward prefetch (parallel/data.py): under gloo (a CPU) each linear layer of a
block is an FSDP2 unit of its own and every unit prefetches only itself in backward, a no-op, so one
layer's weight is gathered at a time instead of two blocks; under any other backend (NCCL on a GPU,
and `simulate`'s fake group, which stands in for one) a block is a unit and FSDP2 keeps its default
prefetch. One process, a group of one: which modules are units and what each will prefetch, no data."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.llama.parallel_plan import PLAN
from ultratron.parallel import data
from ultratron.parallel.data import apply_fsdp
from ultratron.planning import rules


class _Dims:
    zero = 3

    def __init__(self):
        self.dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _model(monkeypatch, backend: str | None, zero: int = 3):
    if backend is not None:  # the backend FSDP2's prefetch choice reads, as another device would have it
        monkeypatch.setattr(data.dist, "get_backend", lambda *a, **k: backend)
    args = LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=96, max_seq_len=32)
    dims = _Dims()
    dims.zero = zero
    return apply_fsdp(Llama(args), dims, "fp32", PLAN)


def _units(model) -> list:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _sharded(monkeypatch, backend: str | None):
    return [(m, m._get_fsdp_state()._states_to_backward_prefetch) for m in _units(_model(monkeypatch, backend))]


@pytest.mark.parametrize("split", [False, True])
def test_under_gloo_each_unit_prefetches_only_itself(gloo, monkeypatch, split):
    assert dist.get_backend() == "gloo" and not data.prefetches_in_backward()
    if split:
        monkeypatch.setattr(rules, "PER_LINEAR_FROM_BYTES", 0)
    for module, prefetch in _sharded(monkeypatch, None):
        assert prefetch == [module._get_fsdp_state()], module


def test_under_gloo_zero3_makes_each_linear_layer_of_a_large_block_a_unit(gloo, monkeypatch):
    small = _model(monkeypatch, None)  # 3 blocks of 0.2 MB: each one unit, as its collectives cost
    assert set(_units(small)) == {*PLAN.blocks(small).values(), small}
    monkeypatch.setattr(rules, "PER_LINEAR_FROM_BYTES", 100_000)  # below a block's 0.2 MB
    model = _model(monkeypatch, None)
    linears = [m for block in PLAN.blocks(model).values() for m in block.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 3 * 7  # wq wk wv wo w1 w2 w3 in each of 3 blocks
    assert set(_units(model)) == {*linears, *PLAN.blocks(model).values(), model}
    # ZeRO-2 keeps every weight gathered from forward through backward: finer units would buy nothing
    two = _model(monkeypatch, None, zero=2)
    assert set(_units(two)) == {*PLAN.blocks(two).values(), two}


@pytest.mark.parametrize("backend", ["nccl", "fake"])
def test_other_backends_keep_blocks_as_units_and_fsdp2s_default_prefetch(gloo, monkeypatch, backend):
    monkeypatch.setattr(rules, "PER_LINEAR_FROM_BYTES", 0)  # (blocks of any size)
    sharded = _sharded(monkeypatch, backend)
    assert len(sharded) == 3 + 1  # the blocks and the root
    for module, prefetch in sharded:
        assert prefetch == [], (backend, module)  # empty: FSDP2 prefetches the next block by itself
