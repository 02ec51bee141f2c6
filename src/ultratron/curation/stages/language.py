"""Stage `language`: each document's language, its probability and its script, kept or dropped by a list.

Writes `language` (ISO 639-1, py3langid's 97 languages), `language_score` (the probability of that
language) and `script` (the script most of its letters use) into every record; from here on the
stage reports count documents and bytes per language, and `filter` and `near-dedup` use the
language's words, stop words and rule settings (`curation/languages.py`). `language.keep` lists
the languages to keep (empty: all); a document below `language.min_score` is removed as
`language:low_score` (its text is too short, mixed or of a language the model lacks).
"""

from __future__ import annotations

from ultratron.curation import languages
from ultratron.curation.frame import StageContext


def make_doc_fn(cfg, side):
    keep = frozenset(cfg.language.keep)
    min_score, head = cfg.language.min_score, cfg.language.head_chars

    def fn(record: dict, index: int):
        lang, score = languages.identify(record["text"], head)
        # set on the input record too: a removed document is counted under its language
        record.update(language=lang, language_score=score, script=languages.script(record["text"]))
        if keep and lang not in keep:
            return None, "language:not_kept", None, lang
        if score < min_score:
            return None, "language:low_score", None, score
        return record, None, None, None

    return fn


def run(ctx: StageContext) -> dict:
    ctx.map_parts(make_doc_fn)
    return {"keep": list(ctx.cfg.language.keep) or "all", "min_score": ctx.cfg.language.min_score}
