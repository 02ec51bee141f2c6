"""Word n-grams of evaluation items, and where a document repeats one (the `decontaminate` stage).

Words: the text lowercased, split into runs of letters and digits (`\\w+`: punctuation and
whitespace are separators, so case, punctuation and spacing changes do not hide an item). A run of
a script written without spaces (Han, kana, Thai, Lao, Khmer, Myanmar, Tibetan; the whitespace
inside it dropped first, since it carries nothing there) is cut into words by the segmenter of its
script (`curation/languages.py`): kana present → MeCab (Japanese), Thai → pythainlp, Han alone →
jieba (Chinese), the other scripts into characters. The choice depends on the run's characters
only, never on a record's `language`, so an item and a document that repeats it are cut alike.

N-grams (GPT-3, Brown et al. 2020, appendix C: 13 words) are hashed exactly, without sampling: each
word of the items gets an id (the items' vocabulary, sorted), a document's words map to those ids
(0: a word no item has, so an n-gram holding it matches nothing), and an n-gram's hash is the
polynomial Σ (id+1)·M^k mod 2^64 over its words, computed for every position at once with numpy.
A match is a document n-gram whose hash is in the index (a sorted array): two different 13-grams
share a 64-bit hash with probability ~2^-64 per pair, ~10^-8 for a 10 GB corpus against 10^5 item
n-grams. An item shorter than n words contributes nothing and is counted (`items_too_short`).
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultratron import atomic
from ultratron.curation.languages import _UNSPACED_RANGE, segment

_WORD = re.compile(r"\w+")
# A run of unspaced-script characters, whitespace inside it allowed (and dropped), or a word.
_UNSPACED_RUN = re.compile(f"[{_UNSPACED_RANGE}]+(?:\\s+[{_UNSPACED_RANGE}]+)*")
_HAS_UNSPACED = re.compile(f"[{_UNSPACED_RANGE}]")
_KANA = re.compile(r"[\u3040-\u30ff]")
_THAI = re.compile(r"[\u0e00-\u0e7f]")
_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_SPACE = re.compile(r"\s+")
MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd: every power is a different unit mod 2^64
FILTER_BITS = 22  # a 4 MB table of the index hashes' top bits answers most lookups before the search


def _run_language(run: str) -> str:
    """The segmenter for a run of unspaced-script characters, by its characters alone."""
    if _KANA.search(run):
        return "ja"
    if _THAI.search(run):
        return "th"
    if _HAN.search(run):
        return "zh"
    return "lo"  # Lao, Khmer, Myanmar, Tibetan: cut into characters (languages.segment's fallback)


def _run_words(run: str) -> list[str]:
    """The words of a run of unspaced-script characters, as written (not lowercased)."""
    joined = _SPACE.sub("", run)
    return [w for w in segment(joined, _run_language(joined)) if _WORD.fullmatch(w)]


def _plain_words(text: str) -> list[str]:
    if text.isascii():  # lowercasing ASCII keeps every word's bounds: one pass over the whole text
        return _WORD.findall(text.lower())
    return [w.lower() for w in _WORD.findall(text)]  # (e.g. "İ".lower() holds a combining mark, not \w)


def words(text: str) -> list[str]:
    """The text's words as n-grams count them (module docstring)."""
    if text.isascii() or not _HAS_UNSPACED.search(text):
        return _plain_words(text)
    out: list[str] = []
    pos = 0
    for m in _UNSPACED_RUN.finditer(text):
        out += _plain_words(text[pos:m.start()])
        out += [w.lower() for w in _run_words(m.group())]
        pos = m.end()
    out += _plain_words(text[pos:])
    return out


def word_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) in `text` of each of `words(text)`, in order (for cutting matched spans)."""
    spans: list[tuple[int, int]] = []

    def plain(start: int, end: int) -> None:
        spans.extend((start + m.start(), start + m.end()) for m in _WORD.finditer(text[start:end]))

    pos = 0
    for m in _UNSPACED_RUN.finditer(text) if _HAS_UNSPACED.search(text) else ():
        plain(pos, m.start())
        at = m.start()  # walk the run's characters, skipping the whitespace the words were made without
        for word in _run_words(m.group()):
            begin = None
            for _ in word:
                while text[at].isspace():
                    at += 1
                begin = at if begin is None else begin
                at += 1
            spans.append((begin, at))
        pos = m.end()
    plain(pos, len(text))
    return spans


def ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """The hash of every n-gram of a sequence of word ids (uint64, len(ids) - n + 1 of them)."""
    if len(ids) < n:
        return np.zeros(0, np.uint64)
    ids = ids.astype(np.uint64)
    h = np.zeros(len(ids) - n + 1, np.uint64)
    for k in range(n):
        h = h * MULTIPLIER + ids[k: len(ids) - n + 1 + k]
    return h


@dataclass
class Index:
    """The items' vocabulary and their n-grams' hashes (sorted) with the task each came from."""

    n: int
    vocab: dict[str, int]
    hashes: np.ndarray  # uint64, sorted, distinct
    task_of: np.ndarray  # int32, the first task (in `tasks` order) holding each n-gram
    tasks: list[str]

    def __post_init__(self):
        self._filter = np.zeros(1 << FILTER_BITS, bool)
        self._filter[self.hashes >> np.uint64(64 - FILTER_BITS)] = True

    def ids(self, text: str) -> np.ndarray:
        ws = words(text)
        return np.fromiter(map(self.vocab.get, ws, itertools.repeat(0)), dtype=np.int64, count=len(ws))

    def matches(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(word positions where a matching n-gram starts, the index of its task in `tasks`)."""
        h = ngram_hashes(self.ids(text), self.n)
        maybe = np.flatnonzero(self._filter[h >> np.uint64(64 - FILTER_BITS)])
        if not len(maybe):
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        where = np.minimum(np.searchsorted(self.hashes, h[maybe]), len(self.hashes) - 1)
        found = self.hashes[where] == h[maybe]
        return maybe[found], self.task_of[where[found]]

    def save(self, path: Path) -> None:
        words_sorted = sorted(self.vocab, key=self.vocab.get)
        with atomic.atomic_open(path, "wb") as fh:  # (a file object: np.savez names it as given)
            np.savez(fh, n=self.n, vocab=np.array(words_sorted, dtype=str), hashes=self.hashes,
                     task_of=self.task_of, tasks=np.array(self.tasks, dtype=str))


def build_index(items: dict[str, list[str]], n: int) -> tuple[Index, dict[str, dict[str, int]]]:
    """The index of every item of every task (task name → its items' texts), and per task its
    number of items, of items too short for one n-gram, and of distinct n-grams."""
    tokenized = {task: [words(t) for t in texts] for task, texts in items.items()}
    vocab = {w: i + 1 for i, w in enumerate(sorted({w for ws in tokenized.values() for item in ws for w in item}))}
    hashes, owners, counts = [], [], {}
    for t, (task, item_words) in enumerate(tokenized.items()):
        mine = [ngram_hashes(np.array([vocab[w] for w in ws], np.int64), n) for ws in item_words]
        mine = np.unique(np.concatenate(mine)) if mine else np.zeros(0, np.uint64)
        counts[task] = {"items": len(item_words), "items_too_short": sum(len(ws) < n for ws in item_words),
                        "ngrams": len(mine)}
        hashes.append(mine)
        owners.append(np.full(len(mine), t, np.int32))
    all_hashes = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    all_owners = np.concatenate(owners) if owners else np.zeros(0, np.int32)
    order = np.argsort(all_hashes, kind="stable")  # the first task of an n-gram two tasks share wins
    all_hashes, all_owners = all_hashes[order], all_owners[order]
    first = np.ones(len(all_hashes), bool)
    first[1:] = all_hashes[1:] != all_hashes[:-1]
    return Index(n, vocab, all_hashes[first], all_owners[first], list(items)), counts


@functools.lru_cache(maxsize=2)
def load_index(path: str) -> Index:
    """An index saved by `Index.save` (once per worker process)."""
    with np.load(path) as z:
        vocab = {w: i + 1 for i, w in enumerate(z["vocab"].tolist())}
        return Index(int(z["n"]), vocab, z["hashes"], z["task_of"], z["tasks"].tolist())


def matched_spans(text: str, starts: np.ndarray, n: int) -> list[tuple[int, int]]:
    """Character spans covered by the n-grams starting at word positions `starts`, merged."""
    spans = word_spans(text)
    out: list[tuple[int, int]] = []
    for s in sorted(starts.tolist()):
        begin, end = spans[s][0], spans[s + n - 1][1]
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out
