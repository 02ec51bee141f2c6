"""Stage `normalize`: Unicode normal form, control characters, whitespace.

The text is changed only in ways that do not change what it says: NFC (so "é" has one
encoding), C0/C1 control characters other than tab and newline removed, CRLF/CR → LF, runs of
spaces and tabs inside a line collapsed (leading indentation is kept, so code stays code),
trailing spaces dropped, long runs of blank lines shortened. Documents left empty are removed.
"""

from __future__ import annotations

import re
import unicodedata

from ultratron.curation.frame import StageContext

# C0 controls except \t and \n, DEL, and C1 controls.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_INNER_SPACES = re.compile(r"(?<=\S)[ \t]{2,}(?=\S)")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)


def normalize_text(text: str, form: str = "NFC", strip_control: bool = True, collapse_spaces: bool = True,
                   max_blank_lines: int = 2) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize(form, text)
    if strip_control:
        text = _CONTROL.sub("", text)
    if collapse_spaces:
        text = _TRAILING.sub("", _INNER_SPACES.sub(" ", text))
    if max_blank_lines >= 0:
        text = re.sub(f"\n{{{max_blank_lines + 2},}}", "\n" * (max_blank_lines + 1), text)
    return text


def make_doc_fn(cfg, side):
    n = cfg.normalize

    def fn(record: dict, index: int):
        text = normalize_text(record["text"], n.form, n.strip_control, n.collapse_spaces, n.max_blank_lines)
        if not text.strip():
            return None, "empty_after_normalize", None, None
        changed = text != record["text"]
        return {**record, "text": text}, ("normalized" if changed else None), None, None

    return fn


def run(ctx: StageContext) -> dict:
    ctx.map_parts(make_doc_fn)
    return {}
