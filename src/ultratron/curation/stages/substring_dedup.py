"""Stage `substring-dedup`: remove every byte span of ≥ `min_bytes` that occurs more than once.

Exact-substring dedup after Lee et al. 2022 ("Deduplicating Training Data Makes Language
Models Better"): the UTF-8 bytes of all documents are joined with a 0xFF separator (a byte that
never occurs in UTF-8, so no match can run across two documents), a suffix array and its LCP
array are built, and every pair of suffixes adjacent in the array that share ≥ `min_bytes`
bytes marks both spans. All occurrences are removed, as in Lee et al.'s tool; a span repeated
inside one document counts too. Span edges are widened to whole UTF-8 characters.

Suffix array: `pydivsufsort` (libdivsufsort, MIT; O(n log n), ~2 s for 30 MB here), with
Kasai's LCP. Memory in the driver, for a corpus of n bytes (n < 2 GiB, so int32 indices): the
corpus n + suffix array 4n + LCP 4n + Kasai's rank array 4n + a coverage counter 4n ≈ 17n bytes
(≈ 0.5 GB per 30 MB of text); beyond 2 GiB the indices are int64 (≈ 33n). The per-document
removal (phase 3) streams and runs in parallel.
"""

from __future__ import annotations

import numpy as np

from ultratron.curation.frame import StageContext, iter_records

SEPARATOR = 0xFF


def repeated_spans(corpus: np.ndarray, min_bytes: int) -> np.ndarray:
    """Boolean mask over `corpus` (uint8, documents separated by 0xFF): bytes inside a span of
    ≥ min_bytes that occurs at least twice."""
    from pydivsufsort import divsufsort, kasai

    n = len(corpus)
    covered = np.zeros(n + 1, dtype=np.int32)
    if n < 2 * min_bytes:
        return covered[:n] > 0
    sa = divsufsort(corpus)
    lcp = kasai(corpus, sa)  # lcp[i] = common prefix of suffixes sa[i] and sa[i + 1]
    candidates = np.nonzero(lcp[:-1] >= min_bytes)[0]
    if len(candidates):
        seps = np.nonzero(corpus == SEPARATOR)[0]
        a, b = sa[candidates].astype(np.int64), sa[candidates + 1].astype(np.int64)
        # Clip each match at the next separator (the same offset in both suffixes when the
        # separator lies inside the match, because the bytes there are equal).
        to_sep = seps[np.minimum(np.searchsorted(seps, a), len(seps) - 1)] - a
        length = np.minimum(lcp[candidates].astype(np.int64), np.where(to_sep >= 0, to_sep, n))
        keep = length >= min_bytes
        a, b, length = a[keep], b[keep], length[keep]
        np.add.at(covered, a, 1)
        np.add.at(covered, a + length, -1)
        np.add.at(covered, b, 1)
        np.add.at(covered, b + length, -1)
    return np.cumsum(covered[:n]) > 0


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the True runs of a boolean array."""
    edges = np.diff(np.concatenate([[0], mask.view(np.int8), [0]]))
    return np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]


def find_removals(ctx: StageContext) -> tuple[dict[str, dict[int, list[tuple[int, int]]]], dict]:
    """Per part, per document index: byte ranges to remove."""
    corpus = bytearray()
    owners: list[tuple[str, int]] = []
    starts: list[int] = []
    for part in ctx.parts():
        index = 0
        for _, record, _problem in iter_records(part):
            if record is None:
                continue
            starts.append(len(corpus))
            owners.append((part.stem, index))
            corpus += record["text"].encode("utf-8")
            corpus.append(SEPARATOR)
            index += 1
    data = np.frombuffer(corpus, dtype=np.uint8).copy()  # pydivsufsort needs a writable array
    del corpus
    mask = repeated_spans(data, ctx.cfg.substring_dedup.min_bytes)
    run_starts, run_ends = _runs(mask)
    doc_starts = np.asarray(starts, dtype=np.int64)
    sides: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for s, e in zip(run_starts.tolist(), run_ends.tolist(), strict=True):
        doc = int(np.searchsorted(doc_starts, s, side="right") - 1)
        part, i = owners[doc]
        base = starts[doc]
        sides.setdefault(part, {}).setdefault(i, []).append((s - base, e - base))
    return sides, {"corpus_bytes": int(len(data)), "repeated_bytes": int(mask.sum()),
                   "index_bytes_estimate": int(17 * len(data))}


def remove_ranges(text: str, ranges: list[tuple[int, int]]) -> tuple[str, int]:
    """The text without the byte ranges (widened to whole UTF-8 characters), and bytes removed."""
    raw = text.encode("utf-8")
    pieces, cursor, removed = [], 0, 0
    for start, end in ranges:
        while start > 0 and (raw[start] & 0xC0) == 0x80:  # back to the character's first byte
            start -= 1
        while end < len(raw) and (raw[end] & 0xC0) == 0x80:
            end += 1
        start = max(start, cursor)
        if end <= start:
            continue
        pieces.append(raw[cursor:start])
        removed += end - start
        cursor = end
    pieces.append(raw[cursor:])
    return b"".join(pieces).decode("utf-8"), removed


def make_doc_fn(cfg, side: dict[int, list[tuple[int, int]]] | None):
    """side: document index → byte ranges to remove."""
    side = side or {}
    min_chars = cfg.substring_dedup.min_doc_chars

    def fn(record: dict, index: int):
        ranges = side.get(index)
        if not ranges:
            return record, None, None, None
        text, removed = remove_ranges(record["text"], ranges)
        if len(text.strip()) < min_chars:
            return None, "substring_emptied", None, {"bytes_removed": removed}
        return {**record, "text": text}, "substring_removed", None, {"bytes_removed": removed}

    return fn


def run(ctx: StageContext) -> dict:
    sides, info = find_removals(ctx)
    ctx.map_parts(make_doc_fn, sides)
    return info

