"""Stage `near-dedup`: MinHash signatures, LSH banding, one survivor per cluster.

Three phases, as in `exact-dedup`: (1) per part, in parallel and resumable, a MinHash
signature per document; (2) in the driver, over all signatures, which documents are near
duplicates of which (union-find over band collisions); (3) per part, in parallel, drop them.
The survivor of a cluster is always its first document in corpus order (part name, then
position), so the result does not depend on the number of workers or on the executor.

Memory in phase (2): the signature matrix, 4·bands·rows bytes per document (448 B with the
defaults: 1 GB per ~2.3 M documents), plus one uint64 key per document per band while that
band is grouped.

MinHash library: `rensa` (Rust, MIT, maintained; https://github.com/beowolx/rensa). Measured
here on the built-in corpus, its `RMinHash` hashes 112 permutations at ~350 MB/s of shingle
input against ~6 MB/s for `datasketch.MinHash.update_batch`, so the stage's cost is our
(Python) shingling, not the hashing. RMinHash values are 32-bit; that is enough for banding:
a band key is 8 of them (256 bits) hashed to 64 bits, far from collision at corpus scale.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import numpy as np

from ultratron.atomic import atomic_path
from ultratron.curation import languages
from ultratron.curation.frame import StageContext, iter_records, write_json

# A word is a maximal run of \w characters. (Replacing [^\w\s] by spaces and splitting on
# whitespace gives the same words: re's \s and str.isspace() agree on every code point, and no
# character is both \w and \s.)
_WORD = re.compile(r"\w+")

# ---- near dedup -----------------------------------------------------------------------------------


def shingle_normalize(text: str) -> list[str]:
    """Words for MinHash: lowercase, no diacritics, no punctuation (as datatrove normalizes text for MinHash)."""
    text = text.lower()
    if not text.isascii():
        text = unicodedata.normalize("NFD", text)
        # the combining marks among the text's distinct characters, removed in one regex pass
        # (no combining mark is a regex metacharacter)
        marks = "".join(sorted(ch for ch in set(text) if unicodedata.combining(ch)))
        if marks:
            text = re.sub(f"[{marks}]+", "", text)
    return _WORD.findall(text)


def shingles(text: str, n: int, lang: str | None = None) -> list[str]:
    """Word n-grams as strings; a document shorter than n words is one shingle. A language written
    without spaces (or, with no language given, a text mostly in such scripts) is first segmented
    into words (`curation/languages.py`): otherwise a paragraph of Chinese would be one "word"."""
    words = languages.shingle_words(text, lang)
    if words is None:
        words = shingle_normalize(text)
    if len(words) <= n:
        return [" ".join(words)]
    # the i-th n-gram is word i of each shifted list; the shortest list ends it (no per-gram slice)
    return list(map(" ".join, zip(*(words[i:] for i in range(n)), strict=False)))


def signatures(texts: list[str], ngram: int, num_perm: int, seed: int,
               langs: list[str | None] | None = None) -> np.ndarray:
    """MinHash signatures, shape (len(texts), num_perm), uint32; `langs`: each text's language."""
    from rensa import RMinHash

    if not texts:
        return np.zeros((0, num_perm), dtype=np.uint32)
    sets = [shingles(t, ngram, lang) for t, lang in zip(texts, langs or [None] * len(texts), strict=True)]
    return np.asarray(RMinHash.digests_from_token_sets(sets, num_perm, seed), dtype=np.uint32)


def _near_index(args: tuple[str, str, int, int, int]) -> str:
    in_path, out_path, ngram, num_perm, seed = args
    if not Path(out_path + ".npy").is_file():
        ids, texts, langs = [], [], []
        for _, record, _problem in iter_records(Path(in_path)):
            if record is not None:
                ids.append(record["id"])
                texts.append(record["text"])
                langs.append(record.get("language"))
        sig = signatures(texts, ngram, num_perm, seed, langs)
        write_json(Path(out_path + ".ids.json"), ids)
        with atomic_path(out_path + ".npy", keep_suffix=True) as tmp:  # np.save appends .npy to other names
            np.save(tmp, sig)
    return out_path


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One uint64 key per (document, band): the band's `rows` values mixed (splitmix64-style)."""
    n = sig.shape[0]
    keys = np.zeros((n, bands), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for r in range(rows):
            column = sig[:, np.arange(bands) * rows + r].astype(np.uint64)
            keys = (keys ^ column) * np.uint64(0x9E3779B97F4A7C15)
            keys ^= keys >> np.uint64(29)
    return keys


def lsh_clusters(sig: np.ndarray, bands: int, rows: int, min_jaccard: float = 0.0) -> np.ndarray:
    """Cluster label per document: the smallest index in its connected component, where two
    documents are connected when any band's `rows` values are all equal and, with `min_jaccard`,
    their signatures agree in at least that share of all positions (the MinHash estimate of
    their Jaccard similarity: with 120 values its standard error is at most 0.046)."""
    n = sig.shape[0]
    parent = np.arange(n)

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    keys = band_keys(sig, bands, rows)
    for b in range(bands):
        column = keys[:, b]
        order = np.argsort(column, kind="stable")
        sorted_keys = column[order]
        same = np.nonzero(sorted_keys[1:] == sorted_keys[:-1])[0]
        if min_jaccard > 0 and len(same):  # verify each candidate pair on the whole signature
            agree = (sig[order[same]] == sig[order[same + 1]]).mean(axis=1)
            same = same[agree >= min_jaccard]
        for k in same:  # only candidate pairs reach Python: few, unless the corpus is very redundant
            a, c = find(int(order[k])), find(int(order[k + 1]))
            if a != c:
                parent[max(a, c)] = min(a, c)
    return np.array([find(i) for i in range(n)], dtype=np.int64)


def run(ctx: StageContext) -> dict:
    nd = ctx.cfg.near_dedup
    parts = ctx.parts()
    tasks = [(str(p), str(ctx.index_dir / p.stem), nd.ngram, nd.bands * nd.rows, nd.seed) for p in parts]
    paths = ctx.executor.map(_near_index, tasks, desc="near-dedup signatures")
    ids: list[str] = []
    owners: list[tuple[str, int]] = []
    sigs = []
    for part, path in zip(parts, paths, strict=True):
        part_ids = json.loads(Path(path + ".ids.json").read_text(encoding="utf-8"))
        ids += part_ids
        owners += [(part.stem, i) for i in range(len(part_ids))]
        sigs.append(np.load(path + ".npy"))
    sig = np.concatenate(sigs) if sigs else np.zeros((0, nd.bands * nd.rows), dtype=np.uint32)
    labels = lsh_clusters(sig, nd.bands, nd.rows, nd.min_jaccard)
    sizes = np.bincount(labels, minlength=len(labels)) if len(labels) else np.zeros(0, dtype=np.int64)
    sides: dict[str, dict[int, tuple[bool, str]]] = {p.stem: {} for p in parts}
    for g, label in enumerate(labels):
        if sizes[label] > 1:
            part, i = owners[g]
            sides[part][i] = (label != g, ids[label])  # (removed?, cluster id = the survivor's id)
    n_clusters = int(np.count_nonzero(sizes > 1))
    ctx.map_parts(make_doc_fn, sides)
    return {"clusters_with_duplicates": n_clusters, "signature_bytes": int(sig.nbytes),
            "params": {"ngram": nd.ngram, "bands": nd.bands, "rows": nd.rows, "min_jaccard": nd.min_jaccard,
                       "threshold_approx": round((1 / nd.bands) ** (1 / nd.rows), 3)}}


def make_doc_fn(cfg, side: dict[int, tuple[bool, str]] | None):
    """side: document index → (removed?, cluster id) for documents in a cluster of ≥ 2."""
    side = side or {}

    def near(record: dict, index: int):
        entry = side.get(index)
        if entry is None:
            return record, None, None, None
        removed, cluster = entry
        return (None, "near_duplicate", cluster, None) if removed else (record, None, cluster, None)

    return near
