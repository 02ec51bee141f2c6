"""Near-dedup against brute-force Jaccard on a corpus with planted near-duplicates."""

from __future__ import annotations

import itertools
import json
import random

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_stage
from ultratron.curation.stages.near_dedup import shingles


def _vocab(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(n)]


def _doc(rng: random.Random, vocab: list[str], n_lines: int = 12, words_per_line: int = 20) -> list[str]:
    return [" ".join(rng.choice(vocab) for _ in range(words_per_line)) for _ in range(n_lines)]


def _edit(rng: random.Random, lines: list[str], vocab: list[str], rate: float, reorder: bool) -> list[str]:
    """Substitute, insert or delete `rate` of the words; optionally swap two lines."""
    words = [line.split() for line in lines]
    flat = [(i, j) for i, ws in enumerate(words) for j in range(len(ws))]
    for i, j in rng.sample(flat, max(1, round(rate * len(flat)))):
        op = rng.random()
        if op < 0.5:
            words[i][j] = rng.choice(vocab)
        elif op < 0.75:
            words[i][j] = words[i][j] + " " + rng.choice(vocab)
        else:
            words[i][j] = ""
    out = [" ".join(w for w in ws if w) for ws in words]
    if reorder:
        a, b = rng.sample(range(len(out)), 2)
        out[a], out[b] = out[b], out[a]
    return out


def _corpus(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    vocab = _vocab(rng, 3000)
    docs = []
    for k in range(150):  # originals with 1–3 near-duplicates each
        base = _doc(rng, vocab)
        docs.append({"id": f"orig{k}", "text": "\n".join(base)})
        for v in range(rng.randint(1, 3)):
            edited = _edit(rng, base, vocab, rate=rng.uniform(0.01, 0.05), reorder=rng.random() < 0.5)
            docs.append({"id": f"orig{k}-v{v}", "text": "\n".join(edited)})
    for k in range(40):  # hard negatives: pairs sharing a third of their lines (J ≈ 0.2–0.3)
        shared = _doc(rng, vocab, n_lines=4)
        for side in ("a", "b"):
            docs.append({"id": f"half{k}{side}", "text": "\n".join(shared + _doc(rng, vocab, n_lines=8))})
    for k in range(200):  # true non-duplicates
        docs.append({"id": f"uniq{k}", "text": "\n".join(_doc(rng, vocab))})
    rng.shuffle(docs)
    return docs


def test_near_dedup_recall_and_false_removal(tmp_path):
    docs = _corpus()
    src = tmp_path / "in"
    src.mkdir()
    for p in range(3):  # three parts, so clusters span parts
        with open(src / f"part-{p:05d}.jsonl", "w") as fh:
            for d in docs[p::3]:
                fh.write(json.dumps(d) + "\n")
    cfg = from_dict({"pipeline": {"workers": 1, "progress": False}})
    summary = run_stage("near-dedup", cfg, src, tmp_path / "out")

    label = {d["id"]: d["id"] for d in docs}
    removed = set()
    for path in (tmp_path / "out" / "_decisions").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["cluster"]:
                label[entry["id"]] = entry["cluster"]
            if entry["decision"] == "removed":
                removed.add(entry["id"])
                assert entry["reason"] == "near_duplicate"
    assert summary["docs_out"] == len(docs) - len(removed)

    sets = {d["id"]: set(shingles(d["text"], 5)) for d in docs}
    best = dict.fromkeys(sets, 0.0)
    high_pairs = []
    for a, b in itertools.combinations(sets, 2):
        inter = len(sets[a] & sets[b])
        if not inter:
            continue
        j = inter / (len(sets[a]) + len(sets[b]) - inter)
        best[a], best[b] = max(best[a], j), max(best[b], j)
        if j >= 0.8:
            high_pairs.append((a, b))
    found = sum(label[a] == label[b] for a, b in high_pairs)
    recall = found / len(high_pairs)
    isolated = [d for d, j in best.items() if j <= 0.5]
    false_removal = sum(d in removed for d in isolated) / len(isolated)
    print(f"\nnear-dedup: {len(high_pairs)} pairs with Jaccard >= 0.8, recall {recall:.4f}; "
          f"{len(isolated)} documents with Jaccard <= 0.5 to all others, false removal {false_removal:.4f}")
    assert len(high_pairs) >= 50 and len(isolated) >= 250  # the corpus holds what the test needs
    assert recall >= 0.95
    assert false_removal <= 0.02
    # one survivor per cluster: every removed document's cluster id is a kept document
    assert all(label[d] not in removed for d in removed)


def test_shingle_words_are_the_plain_definition_on_random_unicode():
    """The fast word split (one \\w+ pass, combining marks removed by one regex) gives the words
    of the plain definition: lowercase, NFD without combining marks, punctuation → space, split."""
    import re
    import unicodedata

    from ultratron.curation.stages.near_dedup import shingle_normalize

    def plain(text: str) -> list[str]:
        text = "".join(ch for ch in unicodedata.normalize("NFD", text.lower()) if not unicodedata.combining(ch))
        return re.sub(r"[^\w\s]+", " ", text).split()

    rng = random.Random(5)
    alphabet = ("abcXYZ éÅñçǅß ДЖи ΣΩ 東京 عربي ०१२ ½² _-.,;!?'\"()[]{}#…–—\t\n\u00a0\u2003\u3000\x1c\x85"
                "\u0301\u0308\u0327\u20dd\u0f71\u1ab0\U0001d165\u200d")
    texts = ["".join(rng.choices(alphabet, k=rng.randint(0, 300))) for _ in range(3000)] + ["", "plain ascii, text."]
    assert [shingle_normalize(t) for t in texts] == [plain(t) for t in texts]
    assert shingles("a b c d e f", 5) == ["a b c d e", "b c d e f"] and shingles("a b", 5) == ["a b"]
