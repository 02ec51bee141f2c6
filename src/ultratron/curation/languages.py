"""Languages for curation: identification, word segmentation, stop words and per-language rule settings.

- Identification: py3langid (a fork of langid.py, Lui & Baldwin 2012: 97 languages, a naive Bayes
  model over byte n-grams that ships inside the package; nothing is downloaded), with its
  probabilities normalised so the score is the winning language's probability.
- Words: whitespace for the languages that put spaces between words; a real segmenter for those
  that do not — Chinese `jieba`, Japanese `fugashi` (MeCab) with the `unidic-lite` dictionary,
  Thai `pythainlp`'s dictionary-based `newmm`; characters for any other script written without
  spaces (Lao, Khmer, Myanmar, Tibetan), whose shingles then are character n-grams. Each segmenter
  is imported the first time a document of its language needs it.
- Stop words: the few most frequent function words of each language (FineWeb-2 derives its lists
  from word frequencies per language; these are short hand-written lists of such words). English
  keeps Gopher's eight, so English results do not change. A language without a list skips the
  stop-word rule (counted among the filter stage's notes as
  `gopher_quality:skipped_min_stop_words_LANG`, never a removal).
- Rule settings: `RULES[lang]` overrides `FilterSection` fields with FineWeb-2's published
  per-language thresholds (repeated lines and n-grams, line punctuation, newlines per word, words
  with a letter, mean word length); sentence marks per script; every other threshold keeps its
  English default.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata

# Languages written without spaces between words (ISO 639-1): zh, ja and th have a segmenter here,
# the others are cut into characters.
UNSPACED = frozenset({"zh", "ja", "th", "lo", "km", "my", "bo"})

# Characters of scripts written without spaces: Han, kana, Thai, Lao, Khmer, Myanmar, Tibetan.
_UNSPACED_RANGE = (r"\u0e00-\u0eff\u0f00-\u0fff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf"
                   r"\u4e00-\u9fff\uf900-\ufaff")
_UNSPACED_CHARS = re.compile(f"[{_UNSPACED_RANGE}]")
_CHAR_OR_WORD = re.compile(f"[{_UNSPACED_RANGE}]|\\w+")  # a character of those scripts, or a word of others
_WORDISH = re.compile(r"\w")

# The most frequent function words of each language (see the module docstring).
STOP_WORDS: dict[str, frozenset[str]] = {
    "en": frozenset({"the", "be", "to", "of", "and", "that", "have", "with"}),  # Gopher's list
    "ko": frozenset({"그리고", "그", "이", "수", "것", "있다", "있는", "하는", "및", "등", "더", "또한", "또는",
                     "위해", "통해", "때", "위한", "대한", "한다", "있습니다", "합니다", "이러한", "같은", "모든",
                     "한", "할", "된", "되는", "뒤에", "동안", "함께", "새로운", "약", "가장", "매우", "다시", "다른",
                     "많은", "이번", "지난", "후", "중", "전"}),
    "zh": frozenset({"的", "了", "是", "在", "和", "也", "就", "都", "而", "及", "与", "这", "那", "有", "我们",
                     "一个", "中", "对", "上", "可以", "不", "为", "它", "把", "被"}),
    "ja": frozenset({"の", "に", "は", "を", "た", "が", "で", "て", "と", "し", "れ", "さ", "ある", "いる", "も",
                     "する", "から", "な", "こと", "として", "です", "ます", "この", "その"}),
    "th": frozenset({"ที่", "และ", "ใน", "การ", "ของ", "เป็น", "มี", "ได้", "ให้", "ว่า", "จะ", "ไม่", "กับ", "แต่",
                     "นี้", "ความ", "จาก", "ซึ่ง", "โดย", "ก็", "เพื่อ", "อยู่", "หรือ", "คือ"}),
    "hi": frozenset({"के", "का", "की", "है", "में", "और", "को", "से", "एक", "यह", "पर", "हैं", "भी", "कि", "लिए",
                     "नहीं", "ने", "था", "इस", "होता", "जो", "तो", "या"}),
    "ar": frozenset({"في", "من", "على", "أن", "إلى", "عن", "مع", "هذا", "هذه", "التي", "الذي", "ما", "لا", "كان",
                     "أو", "بين", "كل", "هو", "هي", "قد", "ذلك", "عند", "حتى"}),
    "ru": frozenset({"и", "в", "не", "на", "что", "с", "по", "это", "как", "к", "но", "из", "для", "от", "о", "же",
                     "то", "за", "а", "у", "он", "она", "они", "при", "так"}),
}

# Sentence-final punctuation beyond the Latin/CJK marks the English rules know: the Devanagari
# danda, the Arabic question mark and full stop, the Urdu full stop, the Khmer and Myanmar marks.
EXTRA_TERMINAL = ("।", "॥", "؟", "۔", "؛", "។", "။")
# Thai and Lao end sentences with a space, not a mark: the line-punctuation rules do not apply.
NO_SENTENCE_MARK = frozenset({"th", "lo"})


def _fineweb2(dup_line: float, top: tuple, dup: tuple, line_punct: float, newline: float, alpha_words: float,
              word_len: tuple[float, float]) -> dict:
    """FineWeb-2's published thresholds for one language (its configs/{lang}_{script}.yml, Penedo et al.
    2025) as FilterSection fields: dup_line_frac, top_n_grams (2, 3, 4), dup_n_grams (5 … 10),
    line_punct_thr, new_line_ratio, max_non_alpha_words_ratio (the share of words with a letter a
    document needs) and min/max_avg_word_length."""
    return {"dup_line_frac": dup_line, "top_ngram_char_frac": dict(zip(("2", "3", "4"), top, strict=True)),
            "dup_ngram_char_frac": dict(zip(map(str, range(5, 11)), dup, strict=True)),
            "min_line_punct_ratio": line_punct, "max_newline_ratio": newline, "min_alpha_words_frac": alpha_words,
            "min_mean_word_len": word_len[0], "max_mean_word_len": word_len[1]}


# FineWeb-2 tuned each rule per language from its own data; where it publishes a threshold for one of
# these languages it is used here. Two exceptions, where its words are not the ones counted here:
# Korean — FineWeb-2 splits Korean into morphemes (its stop words are particles: 의, 는, 을), this
# project into eojeols (a word with its particles, as written between spaces), so Korean keeps the
# English n-gram and newline thresholds and its own word length (an eojeol of ordinary prose is
# 2.5–4 syllables: bounds 1.5–8, Gopher's margins around English's 3–10 carried over); and the
# line-punctuation rule in Thai, which FineWeb-2 sets to 0 (Thai ends sentences with a space) and
# which is skipped here with a counted note.
RULES: dict[str, dict] = {  # language → FilterSection fields that differ from English
    "zh": _fineweb2(0.287, (0.256, 0.201, 0.171), (0.198, 0.182, 0.167, 0.154, 0.14, 0.127),
                    0.106, 0.178, 0.735, (1.0, 5.0)),
    "ja": _fineweb2(0.375, (0.121, 0.129, 0.145), (0.307, 0.283, 0.264, 0.248, 0.234, 0.223),
                    0.167, 0.162, 0.759, (1.0, 5.0)),
    "th": _fineweb2(0.349, (0.221, 0.197, 0.162), (0.185, 0.168, 0.152, 0.137, 0.124, 0.111),
                    0.0, 0.153, 0.9, (2.0, 10.0)),
    "hi": _fineweb2(0.206, (0.208, 0.198, 0.161), (0.135, 0.125, 0.116, 0.108, 0.099, 0.09),
                    0.091, 0.316, 0.837, (2.0, 21.0)),
    "ar": _fineweb2(0.304, (0.197, 0.172, 0.146), (0.165, 0.153, 0.142, 0.131, 0.12, 0.109),
                    0.143, 0.189, 0.787, (2.0, 9.0)),
    "ru": _fineweb2(0.322, (0.184, 0.164, 0.146), (0.168, 0.156, 0.145, 0.133, 0.121, 0.109),
                    0.231, 0.139, 0.713, (3.0, 11.0)),
    "ko": {"dup_line_frac": 0.374, "min_line_punct_ratio": 0.062, "min_alpha_words_frac": 0.791,
           "min_mean_word_len": 1.5, "max_mean_word_len": 8.0},
}

# FineWeb-2's stop words for these languages, added to the lists above where its words are ours
# (not Korean's morphemes).
_FINEWEB2_STOP_WORDS = {
    "zh": "的 年 在 月 是 和 日 了 於 · 為 有 被 人 中 为 他 與 後 也 而 由",
    "ja": "の に を は た て が と で 年 し ・ 月 れ さ",
    "th": "ใน ที่ และ ของ เป็น มี การ ได้",
    "hi": "के में है की और से का को एक हैं पर",
    "ar": "، في من على إلى عام أن مع أو هو عن التي كان بين ما كانت هي المتحدة بعد",
    "ru": "в и на с года по году из был к не от что за для его как а он также до после",
}
STOP_WORDS.update({lang: STOP_WORDS[lang] | frozenset(words.split()) for lang, words in _FINEWEB2_STOP_WORDS.items()})


def settings(f, lang: str | None):
    """`f` (a FilterSection) with `lang`'s overrides applied; `f` itself when there are none."""
    overrides = RULES.get(lang or "")
    return dataclasses.replace(f, **overrides) if overrides else f


def unspaced_share(text: str) -> float:
    """Share of word characters that belong to scripts written without spaces."""
    letters = len(_WORDISH.findall(text))
    return len(_UNSPACED_CHARS.findall(text)) / letters if letters else 0.0


# ---- identification -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def identify(text: str, head_chars: int = 4000) -> tuple[str, float]:
    """(ISO 639-1 code, probability) of the text's language, judged on its first `head_chars`."""
    lang, prob = _identifier().classify(text[:head_chars])
    return lang, round(float(prob), 4)


_SCRIPT_ALIASES = {"CJK": "Han", "HIRAGANA": "Kana", "KATAKANA": "Kana"}


def script(text: str, sample: int = 2000) -> str:
    """The script most of the text's letters are written in (Unicode character names' first word;
    `Han` for CJK ideographs, `Kana` for hiragana and katakana)."""
    counts: dict[str, int] = {}
    for ch in text[:sample]:
        if ch.isalpha():
            name = unicodedata.name(ch, "").split(" ", 1)[0]
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "none"
    best = max(counts, key=counts.get)
    return _SCRIPT_ALIASES.get(best, best.title() or "other")


# ---- words -------------------------------------------------------------------------------------

def _need(module: str, language: str):
    """Import a segmenter, or say which extra brings it (they are large: unidic-lite is 250 MB)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        from ultratron.errors import DataError

        raise DataError(f"{language} text needs the {module.split('.')[0]} segmenter: "
                        "pip install 'ultratron[multilingual]'") from None


@functools.lru_cache(maxsize=1)
def _jieba():
    import logging

    jieba = _need("jieba", "Chinese")

    jieba.setLogLevel(logging.WARNING)
    return jieba


@functools.lru_cache(maxsize=1)
def _mecab():
    _need("unidic_lite", "Japanese")  # the dictionary fugashi finds by itself
    return _need("fugashi", "Japanese").Tagger()


@functools.lru_cache(maxsize=1)
def _thai():
    return _need("pythainlp.tokenize", "Thai").word_tokenize


def segment(text: str, lang: str | None) -> list[str]:
    """The text's words, punctuation and numbers included as tokens, whitespace left out."""
    return text.split() if lang not in UNSPACED else list(_segmented(text, lang))


@functools.lru_cache(maxsize=8)
def _segmented(text: str, lang: str) -> tuple[str, ...]:
    """A segmenter's tokens, kept for the last few texts: the filter's rules ask for one document's
    words several times in a row (repetition, quality, FineWeb), and segmenting is the costly part."""
    if lang == "zh":
        tokens = _jieba().lcut(text)
    elif lang == "ja":
        tokens = [w.surface for w in _mecab()(text)]
    elif lang == "th":
        tokens = _thai()(text, engine="newmm", keep_whitespace=False)
    else:  # an unspaced script without a segmenter here: its characters
        tokens = list(text)
    return tuple(t for t in (tok.strip() for tok in tokens) if t)


def words(text: str, lang: str | None) -> list[str]:
    """`segment` without the tokens that hold no letter or digit (punctuation, symbols)."""
    tokens = segment(text, lang)
    if lang not in UNSPACED:
        return tokens
    return [t for t in tokens if _WORDISH.search(t)]


def shingle_words(text: str, lang: str | None) -> list[str] | None:
    """Words for near-dedup's shingles where the language (or, unknown, the script) has no spaces;
    None where the whitespace words the English pipeline uses serve."""
    if lang in UNSPACED:
        return [t.lower() for t in segment(text, lang) if _WORDISH.search(t)]
    if lang is None and not text.isascii() and unspaced_share(text) > 0.3:
        # no language recorded: characters of the unspaced scripts are their own tokens
        return _CHAR_OR_WORD.findall(text.lower())
    return None
