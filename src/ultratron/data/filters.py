"""Stage `filter`: heuristic quality rules, every threshold in `[filter]` of data.toml.

Groups (enable any subset with `filter.enabled`), with their sources (REFERENCES.md):

- `gopher_repetition` — Rae et al. 2021 (Gopher, App. A Table A1), as in datatrove's
  GopherRepetitionFilter: duplicate line/paragraph fractions (by count and by characters),
  the most common 2/3/4-gram's character share, the share of characters in duplicated
  5…10-grams.
- `gopher_quality` — Rae et al. 2021: 50–100,000 words, mean word length 3–10, symbol/word
  ratio, bullet and ellipsis lines, words with a letter, stop words.
- `c4` — Raffel et al. 2020 (C4): lines without terminal punctuation, with < 3 words, with
  "javascript" or cookie/policy boilerplate are removed (the document is kept, modified);
  documents with "lorem ipsum" or "{" are dropped, and so are those left with < 5 sentences.
- `fineweb` — Penedo et al. 2024 (FineWeb): line-punctuation ratio, short-line share,
  characters in duplicated lines, newlines per word.
- `punctuation` — share of non-space characters that are punctuation or symbols.

Every document removed says which rule and the measured value (`detail`) in the decision log.
The defaults suit prose; for code corpora (the built-in corpus) enable only what fits.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

from ultratron.data.pipeline import StageContext

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})  # Gopher's list
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？")
BULLETS = ("•", "●", "‣", "–", "-", "*", "·")
ELLIPSES = ("...", "…")
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
             "use cookies")
_PARAGRAPHS = re.compile(r"\n{2,}")
_SENTENCE_END = re.compile(r"[.!?。！？]+(?:\s|$)")

Verdict = tuple[str | None, object]  # (failed rule or None, measured value)


# ---- Gopher repetition ------------------------------------------------------------------------

def _dup_stats(items: list[str]) -> tuple[float, float]:
    """(share of items that repeat an earlier one, share of characters in such repeats)."""
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_count = dup_chars = 0
    for item in items:
        if item in seen:
            dup_count += 1
            dup_chars += len(item)
        seen.add(item)
    total_chars = sum(len(i) for i in items)
    return dup_count / len(items), dup_chars / max(total_chars, 1)


def _top_ngram_char_frac(words: list[str], n: int) -> float:
    if len(words) < n:
        return 0.0
    counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    gram, count = counts.most_common(1)[0]
    if count < 2:
        return 0.0
    return sum(len(w) for w in gram) * count / max(sum(len(w) for w in words), 1)


def _dup_ngram_char_frac(words: list[str], n: int) -> float:
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i:i + n] = [True] * n
    dup = sum(len(w) for w, c in zip(words, covered, strict=True) if c)
    return dup / max(sum(len(w) for w in words), 1)


def gopher_repetition(text: str, f) -> Verdict:
    lines = [ln for ln in text.split("\n") if ln.strip()]
    paragraphs = [p for p in _PARAGRAPHS.split(text.strip()) if p.strip()]
    para_frac, para_chars = _dup_stats(paragraphs)
    if para_frac > f.dup_para_frac:
        return "dup_para_frac", round(para_frac, 3)
    if para_chars > f.dup_para_char_frac:
        return "dup_para_char_frac", round(para_chars, 3)
    line_frac, line_chars = _dup_stats(lines)
    if line_frac > f.dup_line_frac:
        return "dup_line_frac", round(line_frac, 3)
    if line_chars > f.dup_line_char_frac:
        return "dup_line_char_frac", round(line_chars, 3)
    words = text.lower().split()
    for n, limit in sorted(f.top_ngram_char_frac.items(), key=lambda kv: int(kv[0])):
        value = _top_ngram_char_frac(words, int(n))
        if value > limit:
            return f"top_{n}gram_char_frac", round(value, 3)
    for n, limit in sorted(f.dup_ngram_char_frac.items(), key=lambda kv: int(kv[0])):
        value = _dup_ngram_char_frac(words, int(n))
        if value > limit:
            return f"dup_{n}gram_char_frac", round(value, 3)
    return None, None


# ---- Gopher quality ---------------------------------------------------------------------------

def gopher_quality(text: str, f) -> Verdict:
    words = text.split()
    real = [w for w in words if any(ch.isalnum() for ch in w)]  # punctuation-only tokens are not words
    if len(real) < f.min_words:
        return "min_words", len(real)
    if len(real) > f.max_words:
        return "max_words", len(real)
    mean_len = sum(len(w) for w in real) / len(real)
    if mean_len < f.min_mean_word_len:
        return "min_mean_word_len", round(mean_len, 2)
    if mean_len > f.max_mean_word_len:
        return "max_mean_word_len", round(mean_len, 2)
    symbols = text.count("#") + text.count("...") + text.count("…")
    if symbols / len(words) > f.max_symbol_word_ratio:
        return "max_symbol_word_ratio", round(symbols / len(words), 3)
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if lines:
        bullets = sum(ln.startswith(BULLETS) for ln in lines) / len(lines)
        if bullets > f.max_bullet_lines_frac:
            return "max_bullet_lines_frac", round(bullets, 3)
        ellipsis = sum(ln.endswith(ELLIPSES) for ln in lines) / len(lines)
        if ellipsis > f.max_ellipsis_lines_frac:
            return "max_ellipsis_lines_frac", round(ellipsis, 3)
    alpha = sum(any(ch.isalpha() for ch in w) for w in words) / len(words)
    if alpha < f.min_alpha_words_frac:
        return "min_alpha_words_frac", round(alpha, 3)
    stops = sum(w.lower().strip(".,;:!?\"'()") in STOP_WORDS for w in words)
    if stops < f.min_stop_words:
        return "min_stop_words", stops
    return None, None


# ---- C4 -------------------------------------------------------------------------------------------

def c4_clean(text: str, f) -> tuple[str | None, str | None, object]:
    """(cleaned text or None, failed rule, value). Removes lines; drops the document if needed."""
    lower = text.lower()
    if "lorem ipsum" in lower:
        return None, "lorem_ipsum", None
    if "{" in text:
        return None, "curly_bracket", None
    kept = []
    for line in text.split("\n"):
        stripped = line.strip()
        low = stripped.lower()
        if stripped and (not stripped.endswith(TERMINAL_PUNCT) or len(stripped.split()) < f.c4_min_words_per_line
                or "javascript" in low or any(p in low for p in C4_POLICY)):
            continue  # blank lines stay: they separate paragraphs
        kept.append(line)
    cleaned = "\n".join(kept)
    sentences = len(_SENTENCE_END.findall(cleaned))
    if sentences < f.c4_min_sentences:
        return None, "min_sentences", sentences
    return cleaned, None, len(text.split("\n")) - len(kept)  # lines removed


# ---- FineWeb ------------------------------------------------------------------------------------

def fineweb(text: str, f) -> Verdict:
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if not lines:
        return "no_lines", 0
    punct = sum(ln.endswith(TERMINAL_PUNCT) for ln in lines) / len(lines)
    if punct < f.min_line_punct_ratio:
        return "min_line_punct_ratio", round(punct, 3)
    short = sum(len(ln) <= f.short_line_chars for ln in lines) / len(lines)
    if short > f.max_short_line_frac:
        return "max_short_line_frac", round(short, 3)
    _, dup_chars = _dup_stats(lines)
    if dup_chars > f.max_dup_char_line_frac:
        return "max_dup_char_line_frac", round(dup_chars, 3)
    words = len(text.split())
    ratio = text.count("\n") / max(words, 1)
    if ratio > f.max_newline_ratio:
        return "max_newline_ratio", round(ratio, 3)
    return None, None


# ---- punctuation density ---------------------------------------------------------------------------

def punctuation(text: str, f) -> Verdict:
    chars = [ch for ch in text if not ch.isspace()]
    if not chars:
        return "no_characters", 0
    share = sum(unicodedata.category(ch)[0] in "PS" for ch in chars) / len(chars)
    if share > f.max_punct_frac:
        return "max_punct_frac", round(share, 3)
    return None, None


CHECKS = {"gopher_repetition": gopher_repetition, "gopher_quality": gopher_quality,
          "fineweb": fineweb, "punctuation": punctuation}


def apply_filters(text: str, f) -> tuple[str | None, str | None, object]:
    """(text to keep or None, reason like 'gopher_quality:min_words' or 'c4:lines_removed', value)."""
    modified: tuple[str, object] | None = None
    for group in f.enabled:
        if group == "c4":
            cleaned, rule, value = c4_clean(text, f)
            if cleaned is None:
                return None, f"c4:{rule}", value
            if cleaned != text:
                text, modified = cleaned, ("c4:lines_removed", value)
            continue
        rule, value = CHECKS[group](text, f)
        if rule is not None:
            return None, f"{group}:{rule}", value
    if modified:
        return text, *modified
    return text, None, None


def make_doc_fn(stage, cfg, side):
    f = cfg.filter

    def fn(record: dict, index: int):
        text, reason, value = apply_filters(record["text"], f)
        if text is None:
            return None, reason, None, value
        if reason:
            return {**record, "text": text}, reason, None, value
        return record, None, None, None

    return fn


def run_stage(ctx: StageContext) -> dict:
    ctx.map_parts()
    return {"enabled": list(ctx.cfg.filter.enabled)}
