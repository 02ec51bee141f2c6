"""The attention backend (models/attention.py, models/flex.py) equals attention with the whole dense mask.

Tolerances. fp32: every output element is a softmax-weighted mean of at most K = 300 values of
magnitude ≤ ~4 (standard normal inputs), and the backends differ from the reference only in the order
of their sums (FlexAttention and the CPU flash kernel sum in tiles, with an online max). Each sum of
n terms rounds with a relative error of at most n·2^-24 (Higham's bound, 1.8e-5 for n = 300) but
its rounding errors, of either sign, add up like a random walk, ~√n·2^-24 ≈ 1e-6 relative, which
is why the issue's 1e-6 holds on values of magnitude ~1: FP32 = 1e-6 of each tensor's largest
magnitude (at least 1), measured ≤ 4.2e-7 (flex), ≤ 3.2e-7 (the chunked path, with gradients).
bf16: flex on bf16 inputs against the fp32 reference on the same (bf16) values. Its scores, of
magnitude ≤ ~8 here (dot products over 16 channels of unit normals, scaled by 1/4), are rounded to
bf16 before the softmax (2^-9 relative), so each weight is off by at most exp(8·2^-9) − 1 ≈ 1.6 %
and the weighted mean by at most 2 × 1.6 % × max|v| (≈ 4); the output is then rounded to bf16
(2^-9 × 4): BF16 = 0.14 absolute, the worst case; measured ≤ 1.2e-2 (the errors' random walk).
"""

from __future__ import annotations

import pytest
import torch

from tolerances import BF16_ATTENTION, FP32_ATTENTION
from ultratron.models import attention, flex
from ultratron.models.attention import attend, merged_gradients, reference_attention
from ultratron.models.masks import MaskSpec, allowed

B, H, KV, S, D = 2, 4, 2, 300, 16


def _documents(seq: int = S, lengths=(37, 130, 1, 90)) -> torch.Tensor:
    """Two packed rows: documents ending inside tiles (one of one token), the second row one document."""
    first = torch.repeat_interleave(torch.arange(len(lengths) + 1), torch.tensor([*lengths, seq - sum(lengths)]))
    return torch.stack([first, torch.zeros(seq, dtype=torch.long)])


SPECS = {"causal": MaskSpec(), "documents": MaskSpec(documents=_documents()), "window": MaskSpec(window=45),
         "softcap": MaskSpec(softcap=5.0),
         "documents-window-softcap": MaskSpec(documents=_documents(), window=45, softcap=5.0)}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() <= FP32_ATTENTION * max(1.0, want.abs().max().item())


def _qkv(dtype=torch.float32, requires_grad=False, q_len=S, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D) for h, n in ((H, q_len), (KV, S), (KV, S)))
    return [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("case", list(SPECS))
def test_flex_equals_the_dense_mask_fp32(case):
    q, k, v = _qkv()
    with torch.no_grad():
        got = flex.flex_attend(q, k, v, SPECS[case], H // KV)
        want = reference_attention(q, k, v, SPECS[case], H // KV)
    assert _close(got, want)


@pytest.mark.parametrize("case", ["documents", "documents-window-softcap"])
def test_flex_equals_the_dense_mask_bf16(case):
    q, k, v = _qkv(torch.bfloat16)
    with torch.no_grad():
        got = flex.flex_attend(q, k, v, SPECS[case], H // KV).float()
        want = reference_attention(q.float(), k.float(), v.float(), SPECS[case], H // KV)
    assert (got - want).abs().max().item() <= BF16_ATTENTION


def test_flex_refuses_to_train_on_a_cpu():
    q, k, v = _qkv(requires_grad=True)
    with pytest.raises(ValueError, match="FlexAttention has no CPU backward"):
        attend(q, k, v, MaskSpec(documents=_documents(), backend="flex"), H // KV)


@pytest.mark.parametrize("case", [c for c in SPECS if c != "causal"])
def test_the_chunked_path_equals_the_dense_mask_forward_and_backward(case, monkeypatch):
    """The CPU path of every masked attention (`auto` and `sdpa`), in chunks of 64 queries so that a
    chunk starts inside a document and inside a window; the soft cap takes the checkpointed path."""
    monkeypatch.setattr(attention, "QUERY_CHUNK", 64)
    weight = torch.randn(B, H, S, D)
    results = []
    for fn in (attend, reference_attention):
        q, k, v = _qkv(requires_grad=True)
        out = fn(q, k, v, SPECS[case], H // KV)
        (out * weight).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for got, want in zip(*results, strict=True):
        assert _close(got, want)


@pytest.mark.parametrize("q_len", [1, 5, 40])
@pytest.mark.parametrize("documents", [False, True])
def test_queries_at_given_positions_as_a_kv_cache_asks(q_len, documents):
    """Fewer queries than keys (a decode step: `DECODE_QUERIES` or fewer, SDPA directly; a prefill after
    a prefix: the chunks), each row at its own positions, through a window and documents: both paths
    and flex equal the dense mask."""
    q, k, v = _qkv(q_len=q_len)
    rows = torch.stack([torch.arange(3, 3 + q_len), torch.arange(S - q_len, S)])
    spec = MaskSpec(rows=rows, window=40, documents=_documents() if documents else None)
    with torch.no_grad():
        want = reference_attention(q, k, v, spec, H // KV)
        for got in (attend(q, k, v, spec, H // KV), flex.flex_attend(q, k, v, spec, H // KV)):
            assert _close(got, want)


def test_the_block_mask_skips_and_fills_only_whole_tiles():
    """Each 128 × 128 tile the BlockMask skips has no allowed pair, each it marks full has no masked
    one; here some of each (documents on tile boundaries, a window of two tiles)."""
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor([256, 128, 128]))[None]
    spec = MaskSpec(documents=documents, window=256)
    q_pos, k_pos = torch.arange(512)[None], torch.arange(512)
    block_mask = flex.block_mask_of(spec, q_pos, k_pos)
    dense = allowed(spec, q_pos, k_pos)[0, 0].unflatten(0, (4, 128)).unflatten(2, (4, 128))
    listed = block_mask.to_dense()[0, 0].bool()  # partial or full
    full = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        full[i, block_mask.full_kv_indices[0, 0, i, :block_mask.full_kv_num_blocks[0, 0, i]]] = True
    assert torch.equal(listed, dense.any(3).any(1))  # exact here: each tile's documents are one
    assert torch.equal(full, dense.all(3).all(1)) and full.any() and (listed & ~full).any()


def _dense_kernel(spec, q_pos, k_pos):
    """(o, lse) of a block by plain autograd ops, scores materialized: the stand-in for FlexAttention's
    differentiable block on a GPU."""
    def kernel(q, k, v):
        mask = allowed(spec, q_pos, k_pos)
        scores = (q @ attention.repeat_kv(k, H // KV).transpose(-2, -1)) / D ** 0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        return torch.softmax(scores, -1).nan_to_num() @ attention.repeat_kv(v, H // KV), lse
    return kernel


def test_a_blocks_gradients_from_the_merged_output_by_autograd():
    """`merged_gradients` (context parallel's backward on a GPU): the keys split in two blocks, each
    block's gradients from the merged output and lse, summed, equal autograd of one attention."""
    from ultratron.parallel.context import _empty_output, merge

    spec = MaskSpec(documents=_documents(), window=80)
    q, k, v = _qkv(requires_grad=True)
    want = reference_attention(q, k, v, spec, H // KV)
    dout = torch.randn_like(want)
    want.backward(dout)
    q_pos, halves = torch.arange(S)[None], (slice(0, 150), slice(150, S))
    kernels = [_dense_kernel(spec, q_pos, torch.arange(S)[h]) for h in halves]
    out, lse = _empty_output(q)
    for kernel, h in zip(kernels, halves, strict=True):
        with torch.no_grad():
            out, lse = merge(out, lse, *kernel(q, k[:, :, h], v[:, :, h]))
    assert _close(out, want)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for kernel, h in zip(kernels, halves, strict=True):
        g = merged_gradients(kernel, dout, q.detach(), k.detach()[:, :, h], v.detach()[:, :, h], out, lse)
        dq += g[0]
        dk[:, :, h], dv[:, :, h] = g[1], g[2]
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert _close(got, ref)


def test_a_bad_spec_is_refused():
    from ultratron.config import load_config
    from ultratron.errors import ConfigError
    from ultratron.models.masks import BACKENDS
    from ultratron.models.presets import ATTENTION_BACKENDS

    assert BACKENDS == ATTENTION_BACKENDS  # the config's choices are the backend's
    with pytest.raises(ConfigError, match="model.attention"):
        load_config(None, ["--model.attention", "fast"])
    with pytest.raises(ValueError, match="attention backend 'fast': one of auto, flex, sdpa"):
        MaskSpec(backend="fast")
    with pytest.raises(ValueError, match="sliding window -1"):
        MaskSpec(window=-1)


def test_a_tree_of_shared_prefixes_sees_its_own_branch_and_the_trunk_before_its_fork():
    """A KV cache's packed tree (`MaskSpec.shared`): keys 0..5 the first prompt, 6..8 a second
    that forks from it at 3, 9 a third forking at 5. Each branch sees the trunk's keys before its
    fork and its own, never another branch's; flex is not taken for it, and both attention paths
    (a few queries; the chunks) equal the dense mask."""
    documents = torch.tensor([[0] * 6 + [1] * 3 + [2]])
    shared = torch.tensor([[0] * 6 + [3] * 3 + [5]])
    spec = MaskSpec(rows=torch.arange(10)[None], documents=documents, shared=shared, backend="flex")
    seen = allowed(spec, spec.rows, torch.arange(10))[0, 0]
    want = [list(range(i + 1)) for i in range(6)] + [[0, 1, 2, 6], [0, 1, 2, 6, 7], [0, 1, 2, 6, 7, 8],
                                                     [0, 1, 2, 3, 4, 9]]
    assert [row.nonzero().squeeze(1).tolist() for row in seen] == want
    q, k, v = _qkv(q_len=10)
    q, k, v = q[:1], k[:1, :, :10], v[:1, :, :10]
    assert not attention.uses_flex(spec, q, k)
    with torch.no_grad():
        want_out = reference_attention(q, k, v, spec, H // KV)
        assert _close(attend(q, k, v, spec, H // KV), want_out)  # ≤ DECODE_QUERIES: SDPA with the mask
        wide = MaskSpec(rows=torch.arange(30)[None], documents=documents.repeat(1, 3), shared=shared.repeat(1, 3))
        q3, k3, v3 = _qkv(q_len=30)
        q3, k3, v3 = q3[:1], k3[:1, :, :30], v3[:1, :, :30]
        assert _close(attend(q3, k3, v3, wide, H // KV), reference_attention(q3, k3, v3, wide, H // KV))
