"""Document masking: in a packed sequence each document's logits are the document's alone.

Tolerance: 1e-5 absolute on fp32 logits of magnitude ~1-5 (the issue's figure). The packed and the
lone forward do the same arithmetic on the same values except that attention runs over a longer,
masked row (SDPA with an explicit mask instead of is_causal; masked scores contribute exact zeros
after the softmax) and matmuls see other shapes, so only summation order differs: a few fp32 ulps
(2^-23 ≈ 1.2e-7 relative) per reduction over ≤ 64 terms and 2 layers. Measured here: ≤ 4e-6 on logits
up to 6.8 (so the bound holds with a margin of 2.5).
"""

import pytest
import torch

from ultratron.data.loader import batch_of
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.llama.model import document_layout
from ultratron.models.masks import MaskSpec

LENGTHS = [7, 13, 1, 20, 23]  # packed into one row of 64 (a one-token document too)


def _model(**extra):
    torch.manual_seed(0)
    args = LlamaArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, max_seq_len=64,
                     init_std=0.2, **extra)
    return Llama(args).eval()


def _packed(batch: int = 2):
    torch.manual_seed(1)
    tokens = torch.randint(0, 97, (batch, sum(LENGTHS)))
    bounds = torch.cumsum(torch.tensor([0] + LENGTHS), 0)
    documents = torch.zeros_like(tokens)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        documents[:, a:b] = i + 1
    return tokens, documents, bounds


@pytest.mark.parametrize("extra", [{}, {"qk_norm": True, "attn_softcap": 20.0}])
def test_each_documents_logits_equal_the_document_alone(extra):
    model = _model(**extra)
    tokens, documents, bounds = _packed()
    with torch.no_grad():
        packed = model(tokens, documents=documents)
        worst = 0.0
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            alone = model(tokens[:, a:b])
            worst = max(worst, (packed[:, a:b] - alone).abs().max().item())
        assert worst <= 1e-5
        # without the documents the later documents see the earlier ones: the test can tell
        plain = model(tokens)
        a, b = bounds[3].item(), bounds[4].item()
        assert (plain[:, a:b] - model(tokens[:, a:b])).abs().max().item() > 1e-2


def test_positions_restart_and_the_mask_is_block_causal():
    _, documents, bounds = _packed(batch=1)
    positions, mask = document_layout(documents)
    assert positions[0].tolist() == [p for n in LENGTHS for p in range(n)]
    doc = documents[0]
    want = (doc[:, None] == doc[None, :]) & torch.ones(64, 64, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], want)


def test_gradients_of_a_document_do_not_depend_on_its_neighbours():
    """Training: the loss on one document gives the same gradients packed or alone."""
    model = _model()
    tokens, documents, bounds = _packed(batch=1)
    a, b = bounds[3].item(), bounds[4].item()

    def grads(logits, targets):
        model.zero_grad()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    targets = tokens[:, a + 1:b]
    packed = grads(model(tokens, documents=documents)[:, a:b - 1], targets)
    alone = grads(model(tokens[:, a:b])[:, :-1], targets)
    assert (packed - alone).abs().max().item() <= 1e-5 * alone.abs().max().item()


def test_the_loaders_document_numbers_drive_the_model():
    """From shards to logits: a window with two EOS-ended documents, numbered by the loader."""
    model = _model()
    eos = 0
    window = torch.tensor([5, 6, 7, eos, 8, 9, 10, 11, eos, 12, 13]).numpy()
    inputs, targets, documents = batch_of([(window, None)], eos, documents=True)
    with torch.no_grad():
        packed = model(inputs, documents=documents)
        assert (packed[:, 4:9] - model(inputs[:, 4:9])).abs().max().item() <= 1e-5


def test_context_parallel_blocks_skip_a_row_that_sees_no_key():
    """Context parallel's masked blocks, merged by their log-sum-exps: a query row that may attend no
    key of a block (its document starts after the block) gets lse -inf and output 0 from it, merging
    that — also into an accumulator that has seen nothing yet, -inf with -inf — makes no nan and
    changes nothing, and the block gives that row no gradient; the merged output and gradients equal
    one masked attention over both blocks' keys. Tolerance 1e-6 absolute on values of magnitude
    ~1-3: fp32 (6e-8 relative) over sums of ≤ 8 terms, only their order differs (measured ≤ 5e-7)."""
    from ultratron.parallel.context import _empty_output, block_backward, block_forward, merge

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    # True: the query (row) may attend the key (column); the first block holds keys 0-1, the second 2-3
    mask = torch.tensor([[1, 0, 1, 1],
                         [0, 0, 1, 0],  # row 1 sees no key of the first block
                         [1, 1, 1, 0],
                         [1, 1, 0, 0]], dtype=torch.bool)[None, None]  # row 3 none of the second
    out, lse = _empty_output(q)
    parts = [(slice(0, 2), block_forward(q, k[:, :, :2], v[:, :, :2], False, 1, mask[..., :2])),
             (slice(2, 4), block_forward(q, k[:, :, 2:], v[:, :, 2:], False, 1, mask[..., 2:]))]
    assert parts[0][1][1][0, :, 1].eq(float("-inf")).all() and parts[0][1][0][0, :, 1].eq(0).all()
    for _, part in parts:
        out, lse = merge(out, lse, *part)
        assert not out.isnan().any()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out - want).abs().max().item() <= 1e-6
    dout = torch.randn_like(want)
    want.backward(dout)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for keys, _ in parts:
        g = block_backward(dout, q.detach(), k.detach()[:, :, keys], v.detach()[:, :, keys], out, lse, False, 1,
                           mask[..., keys])
        if keys.start == 0:
            assert g[0][0, :, 1].eq(0).all()  # row 1: nothing from the block it cannot see
        dq += g[0]
        dk[:, :, keys], dv[:, :, keys] = g[1], g[2]
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert (got - ref).abs().max().item() <= 1e-6


def test_documents_that_do_not_fit_the_tokens_are_refused():
    from ultratron.parallel.context import ContextParallelAttention

    model = _model()
    tokens, documents, _ = _packed()
    with pytest.raises(ValueError, match="documents cover 64 tokens, the sequence has 32"):
        model(tokens[:, :32], documents=documents)
    attention = ContextParallelAttention(None, 0, 2, "ring")
    attention.active = True
    q = torch.zeros(2, 4, 32, 16)
    with pytest.raises(ValueError, match="must cover each of the sequence's 64 keys"):
        attention(q, q, q, MaskSpec(documents=documents[:, :32]), 1)
