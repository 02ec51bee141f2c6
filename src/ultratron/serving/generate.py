"""Autoregressive sampling from a model (temperature and top-k)."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 50, stop_id: int | None = None, seed: int = 0) -> list[int]:
    """New token ids after the prompt. Recomputes the full context each step: enough for short
    samples; the server's generator keeps a KV cache."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    context = model.args.max_seq_len
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if stop_id is not None and next_id == stop_id:
            break
        out.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
    return out
