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
  stop-word rule (counted as `gopher_quality:no_stop_words_for_LANG` among the modified reasons,
  never a removal).
- Rule settings: `RULES[lang]` overrides `FilterSection` fields where a language's words or
  sentences are shaped differently from English's (mean word length in characters, sentence-final
  punctuation); every other threshold keeps its English default.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field

# Languages written without spaces between words (ISO 639-1); with a segmenter, or characters.
SEGMENTERS = ("zh", "ja", "th")
UNSPACED = frozenset({*SEGMENTERS, "lo", "km", "my", "bo"})

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


@dataclass(frozen=True)
class LanguageRules:
    """Overrides of FilterSection fields for one language (only what differs from English)."""

    overrides: dict[str, float] = field(default_factory=dict)


# Mean word length, in characters, of ordinary prose: English ≈ 4.7 (Gopher keeps 3–10). A word of
# Chinese or Japanese (as jieba and MeCab segment) is 1–2 characters, one of Thai 3–4, a Korean
# eojeol (a word and its particles) 2.5–4 syllables: each language's bounds bracket what its prose
# measures (docs/data.md) with the same relative margins as Gopher's around English.
RULES: dict[str, LanguageRules] = {
    "zh": LanguageRules({"min_mean_word_len": 1.0, "max_mean_word_len": 4.0}),
    "ja": LanguageRules({"min_mean_word_len": 1.0, "max_mean_word_len": 4.0}),
    "th": LanguageRules({"min_mean_word_len": 1.5, "max_mean_word_len": 8.0}),
    "ko": LanguageRules({"min_mean_word_len": 1.5, "max_mean_word_len": 8.0}),
}


def settings(f, lang: str | None):
    """`f` (a FilterSection) with `lang`'s overrides applied; `f` itself when there are none."""
    rules = RULES.get(lang or "")
    if rules is None:
        return f
    import dataclasses

    return dataclasses.replace(f, **rules.overrides)


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
    if lang not in UNSPACED:
        return text.split()
    if lang == "zh":
        tokens = _jieba().lcut(text)
    elif lang == "ja":
        tokens = [w.surface for w in _mecab()(text)]
    elif lang == "th":
        tokens = _thai()(text, engine="newmm", keep_whitespace=False)
    else:  # an unspaced script without a segmenter here: its characters
        tokens = [ch for ch in text]
    return [t for t in (tok.strip() for tok in tokens) if t]


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
