"""Stage `perplexity`: score each document with a small reference model, keep the likely ones.

The scorer is any callable `texts -> perplexities` (a `Scorer`), handed to the stage as
`run_stage(..., scorer=...)`, so the stage is tested with a tiny model built in the test;
without one, `load_scorer` builds one from `perplexity.checkpoint`, an ultratron checkpoint (the
trainer's `model.pt` + `config.toml` + `tokenizer.json`, e.g. a quickstart run). Perplexity is
exp(mean next-token negative log-likelihood) over the first `max_tokens` tokens of a document.

Phases: (1) score every part in the driver (torch uses the cores itself), caching the scores
per part in `_index/` (resumable); (2) the cutoff: `max_perplexity` and/or the
`keep_percentile`-th percentile of all scores (the stricter wins); (3) per part, in parallel,
drop documents above the cutoff (reason `perplexity`, the score in `detail`) and add a
`perplexity` field to the kept ones. The idea follows CCNet (Wenzek et al. 2020), which keeps
documents by perplexity under a reference language model.
"""

from __future__ import annotations

import json
import math

from ultratron.curation.frame import Scorer, StageContext, iter_records, write_json


class ModelScorer:
    """Perplexity of texts under a causal LM `model(tokens) -> logits` and a Tokenizer."""

    def __init__(self, model, tokenizer, max_tokens: int = 512, batch_size: int = 8):
        self.model, self.tokenizer = model.eval(), tokenizer
        limit = getattr(getattr(model, "args", None), "max_seq_len", None)
        self.max_tokens = min(max_tokens, limit) if limit else max_tokens
        self.batch_size = batch_size

    def __call__(self, texts: list[str]) -> list[float]:
        # torch inside functions only: it is heavy (seconds of startup), and the local executor
        # forks its workers from the driver, which must not have imported torch before then.
        import torch
        import torch.nn.functional as F

        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            seqs = [[self.tokenizer.eos_id] + ids[: self.max_tokens - 1]
                    for ids in self.tokenizer.encode_batch(texts[start:start + self.batch_size])]
            width = max(len(s) for s in seqs)
            tokens = torch.full((len(seqs), width), self.tokenizer.eos_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width - 1))
            for i, s in enumerate(seqs):
                tokens[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s) - 1] = 1
            with torch.no_grad():
                logits = self.model(tokens[:, :-1]).float()
                nll = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
            per_doc = (nll * mask).sum(1) / mask.sum(1).clamp(min=1)
            out += [math.exp(min(v, 50.0)) for v in per_doc.tolist()]
        return out


def load_scorer(checkpoint: str, tokenizer_path: str = "", max_tokens: int = 512, batch_size: int = 8) -> Scorer:
    """A ModelScorer from an ultratron checkpoint (a step directory, or a run whose latest is meant)."""
    # imported here, not at the top: it imports torch (see ModelScorer.__call__)
    from ultratron.checkpoint.inference import load_for_inference
    from ultratron.data.tokenizer import Tokenizer

    loaded = load_for_inference(checkpoint)
    model = loaded.model
    tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path else loaded.tokenizer
    return ModelScorer(model, tokenizer, max_tokens, batch_size)


def _score_parts(ctx: StageContext, scorer: Scorer) -> dict[str, list[float]]:
    from tqdm import tqdm

    scores = {}
    for part in tqdm(ctx.parts(), desc="perplexity scores", unit="part", disable=not ctx.cfg.pipeline.progress):
        cache = ctx.index_dir / f"{part.stem}.json"
        if not cache.is_file():
            texts = [r["text"] for _, r, _ in iter_records(part) if r is not None]
            write_json(cache, scorer(texts) if texts else [])
        scores[part.stem] = json.loads(cache.read_text())
    return scores


def cutoff(all_scores: list[float], max_perplexity: float, keep_percentile: float) -> float:
    """The largest perplexity kept."""
    limit = max_perplexity if max_perplexity > 0 else math.inf
    if keep_percentile > 0 and all_scores:
        ranked = sorted(all_scores)
        index = max(0, math.ceil(len(ranked) * keep_percentile / 100) - 1)
        limit = min(limit, ranked[index])
    return limit


def make_doc_fn(cfg, side: tuple[list[float], float]):
    """side: (the part's scores in document order, the cutoff)."""
    scores, limit = side

    # The score is stored exactly as it was compared with the cutoff: a rounded one could lie
    # above the cutoff for the document at the cutoff itself (JSON keeps a float exactly).
    def fn(record: dict, index: int):
        score = scores[index]
        if score > limit:
            return None, "perplexity", None, score
        return {**record, "perplexity": score}, None, None, None

    return fn


def run(ctx: StageContext) -> dict:
    p = ctx.cfg.perplexity
    scorer = ctx.scorer or load_scorer(p.checkpoint, p.tokenizer, p.max_tokens, p.batch_size)
    scores = _score_parts(ctx, scorer)
    limit = cutoff([s for v in scores.values() for s in v], p.max_perplexity, p.keep_percentile)
    ctx.map_parts(make_doc_fn, {name: (v, limit) for name, v in scores.items()})
    return {"cutoff": limit}
