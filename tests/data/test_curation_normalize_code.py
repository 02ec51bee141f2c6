"""normalize collapses runs of spaces inside lines of prose and keeps them in lines of code."""

from ultratron.curation.stages.normalize import normalize_text

CODE = [
    "x    = 1",
    "a = 1  # aligned comment",
    "def f(a,    b):",
    "    return  a   +  b",
    "\tvalue  =  other",
    "| name   | size  |",
    "int x;   // C",
    "items = {",
    "call(first,   second,",
    "    docstring   prose  inside indented code",
    "path\\\\to   file",
]
PROSE = [("Two  spaces after a sentence.  Next one.", "Two spaces after a sentence. Next one."),
         ("A\t word \t gap", "A word gap"),
         ("prose   with (parentheses)  inside", "prose with (parentheses) inside")]


def test_code_lines_keep_their_spacing_and_prose_lines_do_not():
    for line in CODE:
        assert normalize_text(line + "\n") == line + "\n", line
        assert normalize_text(line + "   \n") == line + "\n"  # trailing spaces still go
    for line, want in PROSE:
        assert normalize_text(line) == want


def test_a_markdown_fence_keeps_every_line_inside_it():
    text = "Intro  text.\n```python\nprint( 'a'  ,  'b' )\nsome   words   only\n```\nOutro  text.\n~~~\nx   y\n"
    assert normalize_text(text) == ("Intro text.\n```python\nprint( 'a'  ,  'b' )\nsome   words   only\n```\n"
                                    "Outro text.\n~~~\nx   y\n")  # an unclosed fence runs to the end


def test_a_python_file_comes_back_unchanged_but_for_trailing_spaces():
    import inspect

    import ultratron.curation.stages.normalize as module

    source = inspect.getsource(module)
    assert normalize_text(source) == source


def test_keep_code_spaces_false_collapses_every_line_as_before():
    import re

    text = "x    = 1\n    return  a   +  b   \nProse  here.\n```\nin   fence\n```\n"
    before = re.sub(r"[ \t]+$", "", re.sub(r"(?<=\S)[ \t]{2,}(?=\S)", " ", text), flags=re.MULTILINE)
    assert normalize_text(text, keep_code=False) == before
    assert before == "x = 1\n    return a + b\nProse here.\n```\nin fence\n```\n"
