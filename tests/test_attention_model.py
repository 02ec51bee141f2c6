"""The model through the attention backend: packed documents at 8,192 tokens without an S × S tensor,
sliding windows per layer, and the planner's count of a windowed model's attention.

Tolerance of the losses: relative FP32_ATTENTION (1e-6, tests/test_attention.py's derivation): the
backend and the dense-mask path do the same arithmetic on the same values, summed in other orders.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tolerances import FP32_ATTENTION
from ultratron.models.attention import reference_attention
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.llama.spec import attention_flops_per_token, attention_keys, layer_windows
from ultratron.models.registry import plan_of


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op makes (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def _tiny(seq: int, n_layers: int = 1, **extra) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaArgs(n_layers=n_layers, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=32, vocab_size=64,
                           max_seq_len=seq, init_std=0.2, **extra))


def _loss(model, tokens, documents, meter=None) -> float:
    model.zero_grad()
    with meter or contextlib.nullcontext():
        loss = F.cross_entropy(model(tokens[:, :-1], documents=documents[:, :-1]).flatten(0, 1), tokens[0, 1:])
        loss.backward()
    return loss.item()


def test_document_masking_at_8192_tokens_holds_no_square_tensor_and_equals_the_dense_mask():
    """Grouped-query attention over packed documents, one of them longer than a chunk of queries and
    one shorter: the step's largest tensor is a chunk's mask (1,024 queries × the keys they can see),
    under S²/8; the loss and the gradients equal the dense (batch, 1, S, S) mask's."""
    seq = 8192
    model = _tiny(seq + 1)
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (1, seq + 1))
    lengths = torch.tensor([3000, 17, 2200, 1, seq + 1 - 5218])
    documents = torch.repeat_interleave(torch.arange(5), lengths)[None]
    meter = _Largest()
    loss = _loss(model, tokens, documents, meter)
    grads = [p.grad.clone() for p in model.parameters()]
    assert meter.numel <= seq * seq // 8, (meter.numel, meter.op)
    plan_of(model).set_attention(model, reference_attention)  # the whole dense mask
    dense_meter = _Largest()
    dense = _loss(model, tokens, documents, dense_meter)
    assert dense_meter.numel >= seq * seq  # the meter can tell
    assert abs(loss - dense) <= FP32_ATTENTION * abs(dense)
    for got, p in zip(grads, model.parameters(), strict=True):
        assert (got - p.grad).abs().max().item() <= FP32_ATTENTION * max(1.0, p.grad.abs().max().item())


def test_layer_windows_follow_the_pattern():
    assert layer_windows(4, 0, 2) == [0, 0, 0, 0]
    assert layer_windows(4, 8) == [8, 8, 8, 8]
    assert layer_windows(4, 8, 2) == [8, 0, 8, 0]  # Gemma 2's alternation
    assert layer_windows(6, 8, 3) == [8, 8, 0, 8, 8, 0]


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_a_windowed_layer_sees_only_its_window(backend):
    """One layer with a window of 8: the logits at position p change with the token at p − 7, not
    with those before it; under flex (inference on a CPU) the same logits."""
    model = _tiny(64, sliding_window=8, attention=backend).eval()
    tokens = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        base = model(tokens)
        for back, seen in ((8, False), (7, True)):
            changed = tokens.clone()
            changed[:, 30 - back] = (changed[:, 30 - back] + 1) % 64
            gap = (model(changed)[:, 30] - base[:, 30]).abs().max().item()
            assert (gap > 1e-3) == seen, (back, gap)
        flexed = _tiny(64, sliding_window=8, attention="flex").eval()
        assert (flexed(tokens) - base).abs().max().item() <= FP32_ATTENTION * max(1.0, base.abs().max().item())


def test_the_planner_counts_a_windowed_layers_keys():
    """12 · heads × head dim · (s for a full layer, min(W, s) for a windowed one), summed over layers."""
    from types import SimpleNamespace

    shape = SimpleNamespace(n_layers=4, dim=64, n_heads=4, head_dim=0, sliding_window=100, sliding_window_pattern=2)
    assert attention_keys(shape, 1000) == 100 + 1000 + 100 + 1000
    assert attention_keys(shape, 50) == 4 * 50  # a window longer than the sequence is the whole of it
    assert attention_flops_per_token(shape, 1000) == 12 * 64 * 2200
    shape.sliding_window = 0
    assert attention_flops_per_token(shape, 1000) == 12 * 64 * 4000


def test_a_windowed_model_decodes_through_the_kv_cache_as_it_forwards_whole():
    """The KV cache hands the backend its rows' positions (`MaskSpec.rows`) and every cached key: a
    prompt of 30 tokens past a window of 8, then 10 tokens one at a time, give the logits of one
    forward of all 40 (the cache keeps every position; the window is the mask's)."""
    from ultratron.inference.kv_cache import SlotCache

    model = _tiny(64, n_layers=2, sliding_window=8, sliding_window_pattern=2).eval()
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    cache = SlotCache(model, slots=2, capacity=64)
    with torch.no_grad():
        whole = model(tokens)
        rows = cache.rows(0, 2)
        steps = [model(tokens[:, :30], cache=rows)]
        rows.advance(30)
        for i in range(30, 40):
            steps.append(model(tokens[:, i:i + 1], cache=rows))
            rows.advance(1)
    got = torch.cat(steps, dim=1)
    assert (got - whole).abs().max().item() <= FP32_ATTENTION * max(1.0, whole.abs().max().item())
