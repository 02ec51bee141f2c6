"""Curation in eight languages (issue 39), on the corpus tests/data/multilingual_corpus.py writes:
language identification, word segmentation, per-language rules, near-dedup's shingles and the
tokenizer's figures per language.

Bounds are the acceptance's: ordinary prose survives configs/data-multilingual.toml at ≥ 90 % in
each language and junk is removed at ≥ 90 %; near-dedup catches ≥ 95 % of the planted near
duplicates (one sentence of ten changed) and removes no unique document; language identification
is right on ≥ 95 % of paragraphs of ≥ 200 characters. Measured here on seeds 0–5 of the corpus
(main and held-out): 100 % in every one of those, in every language.
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from multilingual_corpus import JOIN, LANGS, TEMPLATES, build

from ultratron.curation import languages
from ultratron.curation.config import load_config
from ultratron.curation.runner import run_pipeline, run_stage
from ultratron.curation.stages.near_dedup import shingles
from ultratron.curation.stages.tokenize import language_shares, language_table
from ultratron.errors import DataError

CONFIG = Path(__file__).parents[2] / "configs" / "data-multilingual.toml"


def _write(docs: list[dict], path: Path, language: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for d in docs:
            record = {"id": d["id"], "text": d["text"]} | ({"language": d["lang"]} if language else {})
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _curate(docs: list[dict], root: Path, stages: str, *extra: str) -> tuple[dict, dict]:
    """Run the multilingual config's `stages` on `docs`; (kept records by id, the report)."""
    cfg = load_config(CONFIG, ["--pipeline.input", str(_write(docs, root / "in.jsonl")), "--pipeline.output",
                               str(root / "out"), "--pipeline.stages", stages, "--pipeline.workers", "1",
                               "--pipeline.progress", "false", *extra])
    report = run_pipeline(cfg, log=lambda line: None)
    last = sorted(p for p in (root / "out").iterdir() if p.is_dir())[-1]
    kept = {}
    for part in last.glob("part-*.jsonl"):
        for line in part.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            kept[record["id"]] = record
    return kept, report


def _scores(docs: list[dict], kept: dict) -> dict[str, dict[str, float]]:
    """Per language: prose kept (a prose document counts as kept when it or one of its planted copies
    is: dedup keeps whichever comes first), junk removed, near/exact duplicates caught, unique lost."""
    out = {}
    for lang in LANGS:
        mine = [d for d in docs if d["lang"] == lang]
        copies = defaultdict(list)
        for d in mine:
            if d.get("of"):
                copies[d["of"]].append(d["id"])
        prose = [d for d in mine if d["kind"] == "prose"]
        alive = [any(i in kept for i in [p["id"], *copies[p["id"]]]) for p in prose]
        junk = [d for d in mine if d["kind"] in ("boilerplate", "repeated")]
        near = [d for d in mine if d["kind"] == "near"]
        exact = [d for d in mine if d["kind"] == "exact"]
        out[lang] = {
            "prose_kept": sum(alive) / len(prose),
            "junk_removed": sum(d["id"] not in kept for d in junk) / len(junk),
            "near_recall": sum(not (d["id"] in kept and d["of"] in kept) for d in near) / len(near) if near else 1.0,
            "exact_recall": sum(not (d["id"] in kept and d["of"] in kept) for d in exact) / len(exact)
            if exact else 1.0,
            "unique_lost": sum(not a for p, a in zip(prose, alive, strict=True) if not copies[p["id"]]),
        }
    return out


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    docs = build(seed=0)
    return docs, *_curate(docs, tmp_path_factory.mktemp("multilingual"),
                          "read,normalize,language,exact-dedup,near-dedup,filter")


def test_prose_survives_junk_and_duplicates_go_in_every_language(main_run):
    docs, kept, _ = main_run
    scores = _scores(docs, kept)
    for lang, s in scores.items():
        assert s["prose_kept"] >= 0.9 and s["junk_removed"] >= 0.9, (lang, s)
        assert s["near_recall"] >= 0.95 and s["exact_recall"] == 1.0 and s["unique_lost"] == 0, (lang, s)
    print({lang: s["prose_kept"] for lang, s in scores.items()})


def test_held_out_prose_survives_the_filters_in_every_language(tmp_path):
    """Sentences never used to set a threshold (multilingual_corpus.HELD_OUT), through the filters."""
    docs = build(seed=7, held_out=True, near_per_language=0, exact_per_language=0)
    kept, _ = _curate(docs, tmp_path, "read,normalize,language,filter")
    for lang, s in _scores(docs, kept).items():
        assert s["prose_kept"] >= 0.9 and s["junk_removed"] >= 0.9, (lang, s)


def test_the_report_counts_documents_and_bytes_per_language_at_every_stage(main_run):
    docs, kept, report = main_run
    stages = {s["stage"]: s for s in report["stages"]}
    assert "languages" not in stages["read"] or not stages["read"]["languages"]  # no language yet
    counted = stages["language"]["languages"]
    want = Counter(d["lang"] for d in docs)
    assert {lang: row[0] for lang, row in counted.items()} == dict(want)  # identified right, every one
    assert {lang: row[2] for lang, row in counted.items()} == \
        {lang: sum(len(d["text"].encode()) for d in docs if d["lang"] == lang) for lang in want}
    final = stages["filter"]["languages"]
    assert {lang: row[1] for lang, row in final.items() if row[1]} == \
        dict(Counter(r["language"] for r in kept.values()))
    for stage in ("exact-dedup", "near-dedup", "filter"):  # docs in = the previous stage's docs out, per language
        assert all(row[0] <= counted[lang][0] for lang, row in stages[stage]["languages"].items())


def test_the_issue_s_korean_paragraphs_are_kept_in_their_own_language(tmp_path):
    """Issue 39's report: Korean prose through Gopher quality, C4, FineWeb and Gopher repetition was
    10 in, 0 out (English stop words). With the language stage first, every one is kept; without it
    the English rules still apply, as before (records carry no language)."""
    docs = [d for d in build(seed=3) if d["lang"] == "ko" and d["kind"] == "prose"][:10]
    groups = ["--filter.enabled", "gopher_quality,c4,fineweb,gopher_repetition"]
    kept, _ = _curate(docs, tmp_path / "with", "read,normalize,language,filter", *groups)
    assert len(kept) == 10 and {r["language"] for r in kept.values()} == {"ko"}
    kept, report = _curate(docs, tmp_path / "without", "read,normalize,filter", *groups)
    removed = report["stages"][-1]["removed"]  # English stop words, and eojeols "too short" for English
    assert len(kept) == 0 and set(removed) <= {"gopher_quality:min_stop_words", "gopher_quality:min_mean_word_len"}


def test_language_identification_on_paragraphs_of_200_characters():
    correct, total = Counter(), Counter()
    for held in (False, True):
        for d in build(seed=11, held_out=held, near_per_language=0, exact_per_language=0, junk_per_language=0):
            paragraphs = d["text"].split("\n\n")
            if min(map(len, paragraphs)) < 200:  # Chinese and Japanese: both paragraphs make one of ≥ 200
                paragraphs = [d["text"].replace("\n\n", JOIN.get(d["lang"], " "))]
            for paragraph in paragraphs:
                if len(paragraph) >= 200:
                    total[d["lang"]] += 1
                    correct[d["lang"]] += languages.identify(paragraph)[0] == d["lang"]
    assert set(total) == set(LANGS), total
    for lang in LANGS:
        assert total[lang] >= 10 and correct[lang] / total[lang] >= 0.95, (lang, correct[lang], total[lang])


def test_words_come_from_a_segmenter_where_a_language_has_no_spaces():
    text = {"zh": "研究人员为了减少数据中的噪声，重新整理了规则。",
            "ja": "研究チームはデータに混じった雑音を減らした。",
            "th": "ทีมนักวิจัยได้จัดระเบียบกฎใหม่เพื่อลดสัญญาณรบกวนในข้อมูล"}
    for lang, sentence in text.items():
        assert len(sentence.split()) == 1  # what every word rule saw before
        words = languages.words(sentence, lang)
        assert len(words) >= 6 and "".join(words) == "".join(ch for ch in sentence if ch.isalnum()
                                                            or unicodedata.category(ch)[0] == "M"), (lang, words)
    assert languages.words("Это предложение, оно простое.", "ru") == ["Это", "предложение,", "оно", "простое."]
    assert languages.segment("ສະບາຍດີ", "lo") == list("ສະບາຍດີ")  # an unspaced script without a segmenter: characters


def test_near_dedup_tells_two_chinese_documents_apart_by_their_shingles():
    """Before, a paragraph of Chinese was one \\w+ run: one shingle, so any two documents had Jaccard
    0 or 1. Segmented (with its language) or, without one, by characters, they have many."""
    zh = [d for d in build(seed=0) if d["lang"] == "zh"]
    a, b = [d for d in zh if d["kind"] == "prose" and not any(e.get("of") == d["id"] for e in zh)][:2]
    near = next(d for d in zh if d["kind"] == "near")
    original = next(d for d in zh if d["id"] == near["of"])
    for lang in ("zh", None):
        sa, sb = set(shingles(a["text"], 5, lang)), set(shingles(b["text"], 5, lang))
        sn, so = set(shingles(near["text"], 5, lang)), set(shingles(original["text"], 5, lang))
        assert len(sa) > 50 and len(sa & sb) / len(sa | sb) < 0.4, lang
        assert len(sn & so) / len(sn | so) > 0.65, lang
    assert shingles("plain english words only here", 5, None) == ["plain english words only here"]  # as before


def test_stop_words_rule_is_skipped_and_counted_for_a_language_without_a_list(tmp_path):
    """Esperanto has no stop-word list here: the rule is skipped with a counted note, not a removal."""
    sentence = "La esploristoj trovis novan vojon tra la montaro kaj revenis hejmen antaŭ la vintro."
    docs = [{"id": f"eo-{i}", "lang": "eo", "kind": "prose",
             "text": " ".join(sentence.replace("novan", f"{n}-an") for n in range(i, i + 6))} for i in range(4)]
    root = tmp_path
    cfg = load_config(CONFIG, ["--pipeline.workers", "1", "--pipeline.progress", "false",
                               "--filter.enabled", "gopher_quality"])
    summary = run_stage("filter", cfg, _write(docs, root / "in.jsonl", language=True), root / "out")
    assert summary["docs_out"] == 4 and summary["notes"] == {"gopher_quality:skipped_min_stop_words_eo": 4}


def test_tokenizer_trained_on_a_balanced_mix_is_fair_to_every_language(tmp_path):
    """32,000 entries trained with language_alpha 0.3 on a mix where English has 4× the documents;
    on held-out text in every language bytes per token within 2× of English's (measured 0.93–1.82×
    of it) and decoding gives back every document."""
    docs = [d for seed in range(4) for d in build(seed=seed, near_per_language=0, exact_per_language=0,
                                                  junk_per_language=0, docs_per_language=24)
            if d["lang"] == "en" or seed == 0]
    for i, d in enumerate(docs):
        d["id"] = f"{i}-{d['id']}"
    cfg = load_config(CONFIG, ["--pipeline.workers", "1", "--pipeline.progress", "false"])
    summary = run_stage("tokenize", cfg, _write(docs, tmp_path / "in.jsonl", language=True), tmp_path / "tok")
    assert set(summary["tokenizer_languages"]) == set(LANGS)
    rows = summary["tokenizer_languages"].values()
    assert all(row["round_trip"] and row["measured_on"] in ("held-out", "all (none held out)") for row in rows)
    assert any(row["measured_on"] == "held-out" for row in rows)
    plan = json.loads((tmp_path / "tok" / "language_plan.json").read_text())
    total = sum(p["corpus_bytes"] for p in plan.values())
    norm = sum((p["corpus_bytes"] / total) ** 0.3 for p in plan.values())
    for lang, p in plan.items():  # each share ∝ (corpus share)^0.3, and the text drawn follows it
        assert p["share"] == pytest.approx((p["corpus_bytes"] / total) ** 0.3 / norm, abs=1e-4), (lang, p)
    smallest = min(plan, key=lambda lang: plan[lang]["corpus_bytes"])
    assert plan["en"]["share"] < plan["en"]["corpus_bytes"] / total  # the largest language gave way
    assert plan[smallest]["share"] > 1.5 * plan[smallest]["corpus_bytes"] / total, smallest
    drawn = sum(p["train_bytes"] for p in plan.values())
    for lang, p in plan.items():
        assert p["train_bytes"] == pytest.approx(p["share"] * drawn, rel=0.05), (lang, p, drawn)

    from ultratron.curation.frame import pack_tokens
    from ultratron.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tmp_path / "tok" / "tokenizer.json")
    held = build(seed=9, held_out=True, near_per_language=0, exact_per_language=0, junk_per_language=0)
    table = language_table(tokenizer, [{"text": d["text"], "language": d["lang"],
                                        "tokens": pack_tokens(tokenizer.encode(d["text"]), "uint16")} for d in held])
    english = table["en"]["bytes_per_token"]
    for lang, row in table.items():
        assert 0.5 <= row["bytes_per_token"] / english <= 2.0 and row["round_trip"], (lang, row, english)


def test_language_shares_follow_alpha_and_weights():
    corpus = {"en": 900, "ko": 100}
    assert language_shares(corpus, 1.0, {}) == {"en": 0.9, "ko": 0.1}
    shares = language_shares(corpus, 0.3, {})
    assert shares["ko"] == pytest.approx(0.1**0.3 / (0.1**0.3 + 0.9**0.3)) and shares["ko"] > 0.3
    assert language_shares(corpus, 1.0, {"ko": 3, "en": 1}) == {"en": 0.25, "ko": 0.75}
    with pytest.raises(DataError, match="weight of 0"):
        language_shares(corpus, 1.0, {"fr": 1})


def test_nfkc_leaves_hangul_syllables_and_folds_compatibility_jamo():
    """What docs/data.md says normalize.form = NFKC does to Korean text."""
    assert unicodedata.normalize("NFKC", "한국어") == "한국어"  # precomposed syllables stay
    assert unicodedata.normalize("NFC", "\u1112\u1161\u11ab") == "한"  # conjoining jamo compose under NFC too
    assert unicodedata.normalize("NFKC", "ㅋㅋㅋ") == "\u110f" * 3  # compatibility jamo → leading consonants
    assert unicodedata.normalize("NFKC", "ㅎㅏㄴ") == "하\u1102"  # … which then compose with a vowel
    assert unicodedata.normalize("NFKC", "ＡＢ１２") == "AB12"


def test_corpus_is_what_the_tests_assume():
    docs = build(seed=0)
    assert {d["lang"] for d in docs} == set(LANGS) and all(len(TEMPLATES[lang]) == 20 for lang in LANGS)
    for d in docs:
        if d["kind"] == "prose":
            assert d["text"].count("\n\n") == 1 and len(d["text"]) >= 200, d["id"]
    assert JOIN == {"zh": "", "ja": ""}
