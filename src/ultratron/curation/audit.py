"""Tokenizer audit: exact round trip, bytes per token and tokens per word by domain, unknown tokens.

The probe texts cover the scripts and registers a general model meets (English, accented Latin,
Cyrillic, Arabic, Chinese, Japanese, code, mathematical notation). A domain whose bytes per token
falls below `poor_compression_ratio` × the corpus's own figure is flagged: the tokenizer spends
many tokens there (expected for scripts absent from the training corpus, worth knowing before
training on them).
"""

from __future__ import annotations

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


def _measure(tokenizer, text: str) -> dict:
    ids = tokenizer.encode(text)
    n_bytes = len(text.encode("utf-8"))
    words = max(len(text.split()), 1)
    unk_id = tokenizer.hf.token_to_id("<unk>") if hasattr(tokenizer, "hf") else None
    vocab_size = tokenizer.vocab_size  # once: a property that asks the Rust tokenizer
    unknown = sum(1 for i in ids if i >= vocab_size or i == unk_id)
    return {"bytes": n_bytes, "tokens": len(ids), "bytes_per_token": round(n_bytes / max(len(ids), 1), 3),
            "tokens_per_word": round(len(ids) / words, 3), "round_trip": tokenizer.decode(ids) == text,
            "unknown_tokens": unknown}


def audit_tokenizer(tokenizer, corpus_sample: list[str], poor_compression_ratio: float = 0.5,
                    probes: dict[str, str] | None = None) -> dict:
    """Per-domain figures, the corpus's own, and warnings (one line each)."""
    domains = {name: _measure(tokenizer, text) for name, text in (probes or PROBES).items()}
    corpus = _measure(tokenizer, "\n".join(corpus_sample)) if corpus_sample else None
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
