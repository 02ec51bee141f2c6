"""Tokenizer audit: exact round trip, bytes per token and tokens per word by domain, unknown tokens.

The probe texts cover the scripts and registers a general model meets (English, accented Latin,
Cyrillic, Arabic, Chinese, Japanese, code, mathematical notation). A domain whose bytes per token
falls below `poor_compression_ratio` × the corpus's own figure is flagged: the tokenizer spends
many tokens there (expected for scripts absent from the training corpus, worth knowing before
training on them).
"""

from __future__ import annotations

import numpy as np

PROBES: dict[str, str] = {
    "english": "The committee reviewed the proposal carefully and decided to postpone the vote "
               "until every member had read the final report.",
    "accented_latin": "Le garçon a déjà mangé la crème brûlée; über die Straße gehen; "
                      "São Paulo é uma cidade enorme; Tiếng Việt có dấu.",
    "cyrillic": "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва — столица России.",
    "arabic": "اللغة العربية هي إحدى أكثر اللغات انتشارا في العالم، ويتحدث بها الملايين.",
    "chinese": "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。",
    "japanese": "東京は日本の首都であり、世界で最も人口の多い都市の一つです。",
    "code": "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n"
            "    for _ in range(n):\n        out.append(a)\n        a, b = b, a + b\n    return out\n",
    "math": "∀ε>0 ∃δ>0: |x−a|<δ ⇒ |f(x)−f(a)|<ε;  ∑_{k=1}^{n} k² = n(n+1)(2n+1)/6,  ∫₀^∞ e^{−x²} dx = √π/2",
}


def _measure(tokenizer, texts: list[str], ids: list[list[int]] | None = None) -> dict:
    """Figures over `texts` together; `ids`: their token ids, if already encoded."""
    if ids is None:
        ids = [tokenizer.encode(text) for text in texts]
    n_bytes = sum(len(text.encode("utf-8")) for text in texts)
    n_tokens = sum(len(i) for i in ids)
    words = max(sum(len(text.split()) for text in texts), 1)
    unk_id = tokenizer.hf.token_to_id("<unk>") if hasattr(tokenizer, "hf") else None
    vocab_size = tokenizer.vocab_size  # once: a property that asks the Rust tokenizer
    flat = np.concatenate([np.asarray(doc, dtype=np.int64) for doc in ids]) if ids else np.zeros(0, np.int64)
    unknown = int(np.count_nonzero((flat >= vocab_size) | (flat == (-1 if unk_id is None else unk_id))))
    round_trip = all(tokenizer.decode(i) == text for text, i in zip(texts, ids, strict=True))
    return {"bytes": n_bytes, "tokens": n_tokens, "bytes_per_token": round(n_bytes / max(n_tokens, 1), 3),
            "tokens_per_word": round(n_tokens / words, 3), "round_trip": round_trip,
            "unknown_tokens": unknown}


def audit_tokenizer(tokenizer, corpus_sample: list[str], poor_compression_ratio: float = 0.5,
                    probes: dict[str, str] | None = None, corpus_ids: list[list[int]] | None = None) -> dict:
    """Per-domain figures, the corpus's own (over the sample's documents; `corpus_ids`: their
    ids, when the caller has encoded them already), and warnings (one line each)."""
    domains = {name: _measure(tokenizer, [text]) for name, text in (probes or PROBES).items()}
    corpus = _measure(tokenizer, corpus_sample, corpus_ids) if corpus_sample else None
    warnings = []
    for name, m in domains.items():
        if not m["round_trip"]:
            warnings.append(f"{name}: decode(encode(text)) != text")
        if m["unknown_tokens"]:
            warnings.append(f"{name}: {m['unknown_tokens']} unknown tokens")
        if corpus and m["bytes_per_token"] < poor_compression_ratio * corpus["bytes_per_token"]:
            warnings.append(f"{name}: compresses poorly ({m['bytes_per_token']} bytes/token vs "
                            f"{corpus['bytes_per_token']} on the corpus)")
    return {"corpus": corpus, "domains": domains, "warnings": warnings,
            "all_round_trip": all(m["round_trip"] for m in domains.values()),
            "unknown_tokens": sum(m["unknown_tokens"] for m in domains.values())}
