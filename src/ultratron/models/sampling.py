"""Autoregressive sampling from a model (temperature and top-k), for short samples during training."""

from __future__ import annotations

import torch

from ultratron.models.registry import model_args


def keep_top_k(scores: torch.Tensor, k: int | None) -> torch.Tensor:
    """`scores` (vocab,) with all but the k highest set to -inf (ties with the k-th kept); k ≤ 0 or
    None: all of them (OpenAI's top_k is absent, vLLM's -1 means off)."""
    if not k or k <= 0 or k >= scores.shape[-1]:
        return scores
    kth = torch.topk(scores, k).values[..., -1:]
    return scores.masked_fill(scores < kth, float("-inf"))


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 50, stop_id: int | None = None, seed: int = 0, length_multiple: int = 1) -> list[int]:
    """New token ids after the prompt. Recomputes the full context each step (the server's engine
    keeps a KV cache). `length_multiple`: the model needs sequence lengths divisible by it (sequence
    parallel splits the sequence over ranks), so the context is padded on the right, which a
    causal model's logits at the last real token never see."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    context = model_args(model).max_seq_len // length_multiple * length_multiple
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = ids[:, -context:]
        length = window.shape[1]
        padding = -length % length_multiple
        if padding:
            window = torch.cat([window, window.new_zeros(1, padding)], dim=1)
        logits = model(window)[0, length - 1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = keep_top_k(logits / temperature, top_k)
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if stop_id is not None and next_id == stop_id:
            break
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    return out
