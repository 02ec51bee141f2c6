"""Context parallelism: attention across cp ranks equals full causal attention, forward and backward.

Both ways of reaching the other ranks' keys and values (the ring, and Llama 3's all-gather), at cp 2
and 4 with the causal balance (each rank holds chunks r and 2·cp−1−r of 2·cp), with multi-head and
grouped-query attention, in fp32: the output and the q, k, v gradients of every shard, put back in
sequence order, within 1e-6 (relative to the largest value of each tensor: fp32 rounds at 6e-8) of
PyTorch's fused attention on the whole sequence in one process.
One launch of 4 ranks.
"""

from __future__ import annotations

import json

import pytest

from ultratron.launch.local import run_local


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict:
    from dist_jobs import ring_attention_errors

    out = tmp_path_factory.mktemp("ring")
    run_local(4, ring_attention_errors, str(out))
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)}


CASES = [f"cp{cp}-{mode}-{heads}" for cp in (2, 4) for mode in ("ring", "allgather") for heads in ("mha", "gqa")]


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_attention_equals_full_causal_attention(errors, case):
    for rank in range(4):
        got = errors[rank][case]
        for name in ("out", "dq", "dk", "dv"):
            assert got[name] <= 1e-6 * got[name + "_scale"], (case, rank, name, got)
            assert got[name + "_scale"] > 0.1  # (the gradients are not trivially zero)
