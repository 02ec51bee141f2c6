"""Every heuristic rule keeps a clean document and drops one that breaks it, at the defaults."""

from __future__ import annotations

import random

import pytest

from ultratron.curation.config import FilterSection
from ultratron.curation.stages.filters import (
    apply_filters,
    c4_clean,
    fineweb,
    gopher_quality,
    gopher_repetition,
    punctuation,
)

F = FilterSection()
WORDS = ("the and of to with that have be river mountain garden window letter morning evening village teacher "
         "student market harbor winter summer autumn spring bridge castle forest meadow captain doctor farmer "
         "painter singer writer reader kitchen library station theater museum silver golden quiet gentle "
         "bright narrow ancient modern simple careful honest patient curious friendly walked carried opened "
         "closed watched painted wrote read built found lost remembered forgot visited crossed followed "
         "answered asked brought bought cooked cleaned counted measured planted gathered stories lessons "
         "letters pictures songs questions answers journeys dreams promises").split()


def sentence(rng: random.Random, n: int | None = None, vocab=WORDS) -> str:
    words = [rng.choice(vocab) for _ in range(n or rng.randint(8, 13))]
    return " ".join(words).capitalize() + "."


def good_doc(seed: int = 0, paragraphs: int = 6) -> str:
    rng = random.Random(seed)
    return "\n\n".join("\n".join(sentence(rng) + " " + sentence(rng) for _ in range(3)) for _ in range(paragraphs))


def lines_doc(lines: list[str]) -> str:
    return "\n".join(lines)


def test_good_document_passes_every_rule():
    text = good_doc()
    assert apply_filters(text, F) == (text, None, None)


def _bad_documents():
    rng = random.Random(1)
    uniq = [sentence(rng) + " " + sentence(rng) for _ in range(40)]
    paras = [p for p in good_doc(2, 10).split("\n\n")]
    long_line = " ".join(sentence(rng) for _ in range(12))
    long_para = " ".join(sentence(rng) for _ in range(20))
    repeated = " ".join(rng.choice(WORDS) for _ in range(40))
    return {
        # gopher repetition
        ("gopher_repetition", "dup_para_frac"): "\n\n".join(paras[:6] + [paras[0]] * 4),
        ("gopher_repetition", "dup_para_char_frac"): "\n\n".join(paras[:8] + [long_para] * 3),
        ("gopher_repetition", "dup_line_frac"): lines_doc(uniq[:12] + [uniq[0]] * 8),
        ("gopher_repetition", "dup_line_char_frac"): lines_doc(uniq[:17] + [long_line] * 3),
        ("gopher_repetition", "top_2gram_char_frac"): " ".join(
            w + (" ancient harbor" if i % 3 == 0 else "") for i, w in enumerate(good_doc(3).split())),
        ("gopher_repetition", "dup_5gram_char_frac"): " ".join(uniq[:8]) + " " + repeated + " "
        + " ".join(uniq[8:14]) + " " + repeated,
        # gopher quality
        ("gopher_quality", "min_words"): sentence(rng, 20) + " " + sentence(rng, 20),
        ("gopher_quality", "max_words"): " ".join(rng.choice(WORDS) for _ in range(100_001)),
        ("gopher_quality", "min_mean_word_len"): " ".join(rng.choice(["a", "an", "to", "of", "be", "is"])
                                                          for _ in range(200)),
        ("gopher_quality", "max_mean_word_len"): " ".join(w * 3 for w in good_doc(4).split()),
        ("gopher_quality", "max_symbol_word_ratio"): " ".join(w + (" #" if i % 5 == 0 else "")
                                                               for i, w in enumerate(good_doc(5).split())),
        ("gopher_quality", "max_bullet_lines_frac"): lines_doc(["- " + u for u in uniq[:20]]),
        ("gopher_quality", "max_ellipsis_lines_frac"): lines_doc(
            [u[:-1] + "..." if i % 2 else u for i, u in enumerate(uniq[:20])]),
        ("gopher_quality", "min_alpha_words_frac"): " ".join(w + (" 1234" if i % 3 == 0 else "")
                                                              for i, w in enumerate(good_doc(6).split())),
        ("gopher_quality", "min_stop_words"): lines_doc([sentence(rng, 12, WORDS[8:]) for _ in range(20)]),
        # C4
        ("c4", "lorem_ipsum"): good_doc(7) + "\nLorem ipsum dolor sit amet.",
        ("c4", "curly_bracket"): good_doc(8) + "\nfunction f() { return 1; }.",
        ("c4", "min_sentences"): lines_doc([sentence(rng) for _ in range(4)] + ["no terminal punctuation here"] * 6),
        # FineWeb
        ("fineweb", "min_line_punct_ratio"): lines_doc([u[:-1] for u in uniq[:20]]),
        ("fineweb", "max_short_line_frac"): lines_doc(uniq[:5] + [f"Item {i} here." for i in range(15)]),
        ("fineweb", "max_dup_char_line_frac"): lines_doc(uniq[:30] + [uniq[3]]),
        ("fineweb", "max_newline_ratio"): lines_doc([f"Extraordinarily{i} supercalifragilistically{i}."
                                                      for i in range(30)]),
        # punctuation density
        ("punctuation", "max_punct_frac"): good_doc(9).replace(" ", " ~!@#$% "),
    }


CHECK = {"gopher_repetition": gopher_repetition, "gopher_quality": gopher_quality, "fineweb": fineweb,
         "punctuation": punctuation, "c4": lambda text, f: c4_clean(text, f)[1:]}


@pytest.mark.parametrize("group,rule", list(_bad_documents()))
def test_rule_drops_its_bad_document_and_keeps_the_good_one(group, rule):
    assert CHECK[group](good_doc(), F)[0] is None  # the good document passes this group
    failed, value = CHECK[group](_bad_documents()[(group, rule)], F)
    assert failed == rule, f"expected {rule}, got {failed} (value {value})"


def test_c4_removes_boilerplate_lines_and_keeps_the_document():
    text = good_doc() + "\nPlease enable JavaScript to view this page.\nThis site uses cookies to work properly."
    kept, reason, value = apply_filters(text, F)
    assert kept == good_doc() and reason == "c4:lines_removed" and value == 2


def test_thresholds_come_from_config():
    text = good_doc()
    strict = FilterSection(min_words=10_000)
    assert apply_filters(text, strict)[1] == "gopher_quality:min_words"
    assert apply_filters(text, FilterSection(enabled=["fineweb"]))[1] is None
