"""Context parallelism: attention across cp ranks equals the attention of the whole sequence,
forward and backward, causal, document-masked and through a sliding window.

Both ways of reaching the other ranks' keys and values (the ring, and Llama 3's all-gather), at cp 2
and 4 with the causal balance (each rank holds chunks r and 2·cp−1−r of 2·cp): multi-head and
grouped-query attention, causal, and grouped-query within packed documents (some ending inside a
chunk, some on a chunk boundary, so that whole blocks and single query rows of a block see no key),
through a sliding window of 12 (ending inside chunks, so that some blocks are hidden wholly), and
both. The reference is the whole dense mask in one process (`attention.reference_attention`); the
blocks build theirs from the same `MaskSpec` (the model's).
In fp32 the output and the q, k, v gradients of every shard, put back in sequence order, are within
1e-6 (relative to the largest value of each tensor: fp32 rounds at 6e-8) of PyTorch's fused
attention on the whole sequence in one process (measured ≤ 3.8e-7). And a model under cp2 on packed
documents gives each document the logits of the document alone (test_document_masking's bound and
its reasons; measured ≤ 6.0e-6).
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


CASES = [f"cp{cp}-{mode}-{heads}" for cp in (2, 4) for mode in ("ring", "allgather")
         for heads in ("mha", "gqa", "gqa-documents", "gqa-window", "gqa-documents-window")]


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_attention_equals_full_causal_attention(errors, case):
    for rank in range(4):
        got = errors[rank][case]
        for name in ("out", "dq", "dk", "dv"):
            assert got[name] <= 1e-6 * got[name + "_scale"], (case, rank, name, got)
            assert got[name + "_scale"] > 0.1  # (the gradients are not trivially zero)


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_each_documents_logits_under_cp2_equal_the_document_alone(errors, mode):
    """1e-5 absolute on fp32 logits of magnitude ~1-5, as tests/test_document_masking.py (only the
    summation order differs: the attention merges blocks by their log-sum-exps)."""
    for rank in range(4):
        got = errors[rank][f"model-cp2-{mode}"]
        assert got["logits"] <= 1e-5, (rank, got)
        assert got["plain"] > 1e-2, (rank, got)  # without the documents they see each other: the test can tell
