"""Stage `filter`: heuristic quality rules, every threshold in `[filter]` of data.toml.

Groups (enable any subset with `filter.enabled`), with their sources:

- `length` — plain bounds on the characters of the text (`min_chars`, `max_chars`; off by
  default): the filter that fits conversations, which the prose rules below were not made for.
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

Languages: a record with a `language` (the `language` stage writes it) is judged in that
language's words (`curation/languages.py`: whitespace, or a segmenter for Chinese, Japanese and
Thai), stop words and rule settings; sentences end with its own marks. A rule that cannot apply
(no stop-word list for the language; line punctuation in Thai) is skipped and counted among the
stage's notes as `GROUP:skipped_RULE_LANG`. Records without a language, and English ones, take
the English rules exactly as before.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

import numpy as np

from ultratron.curation import languages
from ultratron.curation.frame import NOTE, StageContext

STOP_WORDS = languages.STOP_WORDS["en"]  # Gopher's list
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？")
BULLETS = ("•", "●", "‣", "–", "-", "*", "·")
ELLIPSES = ("...", "…")
C4_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
             "use cookies")
_PARAGRAPHS = re.compile(r"\n{2,}")
_SENTENCE_END = re.compile(r"[.!?。！？]+(?:\s|$)")
# other languages: CJK, Devanagari, Arabic, Khmer and Myanmar marks end a sentence with or without a space after
_SENTENCE_END_ANY = re.compile(r"[.!?]+(?:\s|$)|[。！？।॥؟۔។။]+")
TERMINAL_ANY = TERMINAL_PUNCT + languages.EXTRA_TERMINAL

Verdict = tuple[str | None, object]  # (failed rule or None, measured value)


# ---- Gopher repetition ------------------------------------------------------------------------
#
# The n-gram rules run on integer ids, in numpy: each word gets an id (its first position), and
# the n-grams get exact ids one n at a time — the n-gram at i is the pair (its (n-1)-gram id, the
# id of word i+n-1), packed into one int64 and numbered by np.unique. No hashing, so no
# collisions: two n-grams share an id exactly when their word tuples are equal.

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


class _NGrams:
    """Exact n-gram ids over one document's words, built up n by n as the rules ask for them."""

    def __init__(self, words: list[str]):
        m = len(words)
        first = dict(zip(reversed(words), range(m - 1, -1, -1), strict=True))  # word → first position
        self.word_ids = np.fromiter(map(first.__getitem__, words), dtype=np.int64, count=m)
        self.lengths = np.fromiter(map(len, words), dtype=np.int64, count=m)
        self.cum = np.concatenate([[0], np.cumsum(self.lengths)])
        self.total_chars = int(self.cum[-1])
        self.m = m
        self._n, self._ids = 1, self.word_ids
        self._stats: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._distinct_from = m + 1  # every n-gram with n ≥ this is unique in the document

    @staticmethod
    def _group(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """np.unique(keys, return_index, return_inverse, return_counts) without the sorted
        values: (id per position, count per id, first position per id)."""
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        new = np.empty(len(keys), dtype=bool)
        new[0] = True
        np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
        heads = np.nonzero(new)[0]
        ids = np.empty(len(keys), dtype=np.int64)
        ids[order] = np.cumsum(new) - 1
        return ids, np.diff(heads, append=len(keys)), order[heads]  # stable: heads are first seen

    def repeats(self, n: int) -> bool:
        """Whether some n-gram occurs twice. Once no k-gram repeats, no longer one can."""
        if n >= self._distinct_from or self.m < n:
            return False
        _, counts, _ = self.stats(n)
        if len(counts) == self.m - n + 1:
            self._distinct_from = min(self._distinct_from, n)
            return False
        return True

    def stats(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(id per n-gram position, count per id, first position per id)."""
        if n == 1 and 1 not in self._stats:
            self._stats[1] = self._group(self.word_ids)
        while self._n < n:
            k = self._n + 1  # grams of length k start at 0 … m-k
            pairs = (self._ids[:self.m - k + 1] << np.int64(32)) | self.word_ids[k - 1:]
            self._stats[k] = self._group(pairs)
            self._n, self._ids = k, self._stats[k][0]
        return self._stats[n]

    def gram_chars(self, start: int, n: int) -> int:
        return int(self.cum[start + n] - self.cum[start])


def _top_ngram_char_frac(words: list[str] | _NGrams, n: int) -> float:
    """Characters of the most common n-gram (first seen wins a tie) × its count, over all
    word characters; 0 when no n-gram repeats."""
    grams = words if isinstance(words, _NGrams) else _NGrams(words)
    if not grams.repeats(n):
        return 0.0
    _, counts, first = grams.stats(n)
    best = int(counts.max())
    if best < 2:
        return 0.0
    start = int(first[counts == best].min())  # Counter.most_common(1): earliest among equals
    return grams.gram_chars(start, n) * best / max(grams.total_chars, 1)


def _dup_ngram_char_frac(words: list[str] | _NGrams, n: int) -> float:
    """Share of word characters covered by an n-gram that occurs more than once."""
    grams = words if isinstance(words, _NGrams) else _NGrams(words)
    if not grams.repeats(n):
        return 0.0
    ids, counts, _ = grams.stats(n)
    starts = np.nonzero(counts[ids] > 1)[0]
    if not len(starts):
        return 0.0
    edges = np.zeros(grams.m + 1, dtype=np.int64)
    edges[starts] += 1  # starts are distinct, so plain fancy-index updates are exact
    edges[starts + n] -= 1
    repeated = np.cumsum(edges[:grams.m]) > 0
    dup = int(grams.lengths[repeated].sum())
    return dup / max(grams.total_chars, 1)


def _english(lang: str | None) -> bool:
    return lang in (None, "en")


def gopher_repetition(text: str, f, lang: str | None = None) -> Verdict:
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
    grams = _NGrams(text.lower().split() if lang not in languages.UNSPACED else
                    [w.lower() for w in languages.words(text, lang)])
    for n, limit in sorted(f.top_ngram_char_frac.items(), key=lambda kv: int(kv[0])):
        value = _top_ngram_char_frac(grams, int(n))
        if value > limit:
            return f"top_{n}gram_char_frac", round(value, 3)
    for n, limit in sorted(f.dup_ngram_char_frac.items(), key=lambda kv: int(kv[0])):
        value = _dup_ngram_char_frac(grams, int(n))
        if value > limit:
            return f"dup_{n}gram_char_frac", round(value, 3)
    return None, None


# ---- Gopher quality ---------------------------------------------------------------------------

# whole whitespace-separated tokens with no ASCII letter ((?<!\S) … (?!\S) are token edges; \s
# and str.split() agree on what whitespace is). Only these can lack a letter or an alphanumeric
# character, so only they are checked one by one: in Latin-script text, a few punctuation and
# number tokens.
_NO_ASCII_ALPHA = re.compile(r"(?<!\S)[^\sA-Za-z]++(?!\S)")
_ASCII_DIGIT = re.compile(r"[0-9]")


def _tokens_without_alpha_or_alnum(text: str) -> tuple[list[str], list[str]]:
    """(tokens without an alphabetic character, tokens without an alphanumeric one)."""
    candidates = _NO_ASCII_ALPHA.findall(text)
    no_alpha = [tok for tok in candidates if not any(ch.isalpha() for ch in tok)]
    no_alnum = [tok for tok in no_alpha if not _ASCII_DIGIT.search(tok) and not any(ch.isalnum() for ch in tok)]
    return no_alpha, no_alnum


def gopher_quality(text: str, f, lang: str | None = None) -> Verdict:
    if lang in languages.UNSPACED:  # a segmenter's tokens; those without a letter or digit are no words
        words = [t for t in languages.segment(text, lang) if any(ch.isalnum() for ch in t)]
        n_real, chars, with_letter = len(words), sum(map(len, words)), sum(any(c.isalpha() for c in w) for w in words)
    else:
        words = text.split()
        # punctuation-only tokens are not words; counts and characters of the rest by subtraction
        no_alpha, not_real = _tokens_without_alpha_or_alnum(text)
        n_real, chars, with_letter = len(words) - len(not_real), len("".join(words)) - len("".join(not_real)), \
            len(words) - len(no_alpha)
    if n_real < f.min_words:
        return "min_words", n_real
    if n_real > f.max_words:
        return "max_words", n_real
    mean_len = chars / n_real
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
    alpha = with_letter / len(words)
    if alpha < f.min_alpha_words_frac:
        return "min_alpha_words_frac", round(alpha, 3)
    return _stop_words(words, f, lang)


def _stop_words(words: list[str], f, lang: str | None) -> Verdict:
    stop_words = languages.STOP_WORDS.get(lang or "en")
    if stop_words is None:
        return f"{NOTE}skipped_min_stop_words_{lang}", None
    stops = 0
    strip = ".,;:!?\"'()" if _english(lang) else ".,;:!?\"'()«»“”„。、，！？：；「」।؟،"
    for w in words:  # stop at the minimum: the count is reported only when it falls short
        if w.lower().strip(strip) in stop_words:
            stops += 1
            if stops >= f.min_stop_words:
                break
    if stops < f.min_stop_words:
        return "min_stop_words", stops
    return None, None


# ---- C4 -------------------------------------------------------------------------------------------

def c4_clean(text: str, f, lang: str | None = None) -> tuple[str | None, str | None, object]:
    """(cleaned text or None, failed rule, value). Removes lines; drops the document if needed.
    In another language than English: its words and sentence marks; in one that ends sentences
    without a mark (Thai), lines are not judged by their last character and sentences are the
    space-separated runs."""
    lower = text.lower()
    if "lorem ipsum" in lower:
        return None, "lorem_ipsum", None
    if "{" in text:
        return None, "curly_bracket", None
    marks = lang not in languages.NO_SENTENCE_MARK
    terminal = TERMINAL_PUNCT if _english(lang) else TERMINAL_ANY
    kept = []
    for line in text.split("\n"):
        stripped = line.strip()
        low = stripped.lower()
        if stripped and ((marks and not stripped.endswith(terminal))
                         or len(languages.words(stripped, lang)) < f.c4_min_words_per_line
                         or "javascript" in low or any(p in low for p in C4_POLICY)):
            continue  # blank lines stay: they separate paragraphs
        kept.append(line)
    cleaned = "\n".join(kept)
    if not marks:
        sentences = len(cleaned.split())
    else:
        sentences = len((_SENTENCE_END if _english(lang) else _SENTENCE_END_ANY).findall(cleaned))
    if sentences < f.c4_min_sentences:
        return None, "min_sentences", sentences
    return cleaned, None, len(text.split("\n")) - len(kept)  # lines removed


# ---- FineWeb ------------------------------------------------------------------------------------

def fineweb(text: str, f, lang: str | None = None) -> Verdict:
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if not lines:
        return "no_lines", 0
    skipped = None
    if lang in languages.NO_SENTENCE_MARK:
        skipped = f"{NOTE}skipped_min_line_punct_ratio_{lang}"
    else:
        punct = sum(ln.endswith(TERMINAL_PUNCT if _english(lang) else TERMINAL_ANY) for ln in lines) / len(lines)
        if punct < f.min_line_punct_ratio:
            return "min_line_punct_ratio", round(punct, 3)
    short = sum(len(ln) <= f.short_line_chars for ln in lines) / len(lines)
    if short > f.max_short_line_frac:
        return "max_short_line_frac", round(short, 3)
    _, dup_chars = _dup_stats(lines)
    if dup_chars > f.max_dup_char_line_frac:
        return "max_dup_char_line_frac", round(dup_chars, 3)
    words = len(languages.words(text, lang))
    ratio = text.count("\n") / max(words, 1)
    if ratio > f.max_newline_ratio:
        return "max_newline_ratio", round(ratio, 3)
    return skipped, None


# ---- punctuation density ---------------------------------------------------------------------------

def punctuation(text: str, f, lang: str | None = None) -> Verdict:
    counts = Counter(text)  # per distinct character: a document has few of them
    n_chars = n_punct = 0
    for ch, count in counts.items():
        if not ch.isspace():
            n_chars += count
            if unicodedata.category(ch)[0] in "PS":
                n_punct += count
    if not n_chars:
        return "no_characters", 0
    share = n_punct / n_chars
    if share > f.max_punct_frac:
        return "max_punct_frac", round(share, 3)
    return None, None


def length(text: str, f, lang: str | None = None) -> Verdict:
    if len(text) < f.min_chars:
        return "min_chars", len(text)
    if f.max_chars and len(text) > f.max_chars:
        return "max_chars", len(text)
    return None, None


CHECKS = {"length": length, "gopher_repetition": gopher_repetition, "gopher_quality": gopher_quality,
          "fineweb": fineweb, "punctuation": punctuation}


def apply_filters(text: str, f, lang: str | None = None) -> tuple[str | None, str | None, object]:
    """(text to keep or None, reason like 'gopher_quality:min_words' or 'c4:lines_removed', value).
    `lang`: the document's language (None: English rules). A kept document's skipped rules come
    back as the reason when nothing modified it: `frame.NOTE` + 'GROUP:skipped_...'."""
    return _apply(text, languages.settings(f, lang), lang)


def _apply(text: str, f, lang: str | None) -> tuple[str | None, str | None, object]:
    """`apply_filters` with `f` already the language's settings."""
    modified: tuple[str, object] | None = None
    notes = []
    for group in f.enabled:
        if group == "c4":
            cleaned, rule, value = c4_clean(text, f, lang)
            if cleaned is None:
                return None, f"c4:{rule}", value
            if cleaned != text:
                text, modified = cleaned, ("c4:lines_removed", value)
            continue
        rule, value = CHECKS[group](text, f, lang)
        if rule is not None and rule.startswith(NOTE):
            notes.append(f"{NOTE}{group}:{rule.removeprefix(NOTE)}")
        elif rule is not None:
            return None, f"{group}:{rule}", value
    if modified:
        return text, *modified
    if notes:
        return text, ",".join(notes), None
    return text, None, None


def make_doc_fn(cfg, side):
    f = cfg.filter
    by_language: dict[str | None, object] = {}  # each language's settings (languages.settings), made once

    def fn(record: dict, index: int):
        lang = record.get("language")
        if lang not in by_language:
            by_language[lang] = languages.settings(f, lang)
        text, reason, value = _apply(record["text"], by_language[lang], lang)
        if text is None:
            return None, reason, None, value
        if reason:
            return {**record, "text": text}, reason, None, value
        return record, None, None, None

    return fn


def run(ctx: StageContext) -> dict:
    ctx.map_parts(make_doc_fn)
    return {"enabled": list(ctx.cfg.filter.enabled)}
