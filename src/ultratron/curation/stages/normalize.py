"""Stage `normalize`: Unicode normal form, control characters, whitespace.

The text is changed only in ways that do not change what it says: NFC (so "é" has one
encoding), C0/C1 control characters other than tab and newline removed, CRLF/CR → LF, runs of
spaces and tabs inside a line of prose collapsed, trailing spaces dropped, long runs of blank
lines shortened. Documents left empty are removed.

Code keeps its spacing: leading indentation is never touched, and runs of spaces inside a line are
kept when the line is code — where alignment (`x    = 1`, `a = 1  # comment`, table columns) is
part of what the text says. A line is code when it is
- inside a Markdown code fence (from a line starting with ``` or ~~~ to the next such line), or
- indented (it starts with a tab or two spaces or more: a block of code, or an indented block), or
- it holds a character prose rarely has — `=`, `{`, `}`, `;`, `|`, `#`, `\\` or `//` — or ends with `:`,
  `(`, `[`, `{` or `,` (a block opener, an open call, a continued literal).
Prose lines with those characters keep their double spaces too: a missed collapse costs a byte, a
collapsed code line changes what it says.
"""

from __future__ import annotations

import re
import unicodedata

from ultratron.curation.frame import StageContext

# C0 controls except \t and \n, DEL, and C1 controls.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_INNER_SPACES = re.compile(r"(?<=\S)[ \t]{2,}(?=\S)")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)
_FENCED = re.compile(r"^(?:```|~~~).*?(?:^(?:```|~~~)[^\n]*$|\Z)", re.MULTILINE | re.DOTALL)
# a line with a run of inner spaces: its indentation, then the rest
_SPACED_LINE = re.compile(r"^([ \t]*)(\S[^\n]*?[ \t]{2,}\S[^\n]*)$", re.MULTILINE)
_CODE_MARK = re.compile(r"[={};|#\\]|//|[:(\[{,][ \t]*$")


def _collapse_line(m: re.Match) -> str:
    return m.group(1) + _INNER_SPACES.sub(" ", m.group(2))


def _collapse_prose_line(m: re.Match) -> str:
    indent, rest = m.group(1), m.group(2)
    if indent.startswith("\t") or len(indent) >= 2 or _CODE_MARK.search(rest):
        return m.group()  # a line of code: its spacing stays
    return indent + _INNER_SPACES.sub(" ", rest)


def collapse_spaces(text: str, keep_code: bool = True) -> str:
    """Runs of spaces and tabs inside lines of prose (`keep_code`; else inside every line) → one
    space, code lines as they are (module docstring); trailing spaces dropped everywhere."""
    if not keep_code:
        return _TRAILING.sub("", _SPACED_LINE.sub(_collapse_line, text))
    pieces, at = [], 0
    for fence in _FENCED.finditer(text) if "```" in text or "~~~" in text else ():
        pieces.append(_SPACED_LINE.sub(_collapse_prose_line, text[at:fence.start()]))
        pieces.append(fence.group())
        at = fence.end()
    pieces.append(_SPACED_LINE.sub(_collapse_prose_line, text[at:]))
    return _TRAILING.sub("", "".join(pieces))


def normalize_text(text: str, form: str = "NFC", strip_control: bool = True, collapse: bool = True,
                   max_blank_lines: int = 2, keep_code: bool = True) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize(form, text)
    if strip_control:
        text = _CONTROL.sub("", text)
    if collapse:
        text = collapse_spaces(text, keep_code)
    if max_blank_lines >= 0:
        text = re.sub(f"\n{{{max_blank_lines + 2},}}", "\n" * (max_blank_lines + 1), text)
    return text


def make_doc_fn(cfg, side):
    n = cfg.normalize

    def fn(record: dict, index: int):
        text = normalize_text(record["text"], n.form, n.strip_control, n.collapse_spaces, n.max_blank_lines,
                              n.keep_code_spaces)
        if not text.strip():
            return None, "empty_after_normalize", None, None
        changed = text != record["text"]
        return {**record, "text": text}, ("normalized" if changed else None), None, None

    return fn


def run(ctx: StageContext) -> dict:
    ctx.map_parts(make_doc_fn)
    return {}
