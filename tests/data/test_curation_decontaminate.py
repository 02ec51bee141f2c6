"""Decontamination: evaluation items planted in a corpus — verbatim, in other case, with other spacing,
in English and in Chinese — are all found; a clean corpus loses nothing."""

from __future__ import annotations

import json
import random

import pytest
from multilingual_corpus import build

from ultratron.cli import main
from ultratron.curation.config import from_dict
from ultratron.curation.contamination import build_index, matched_spans, words
from ultratron.curation.runner import run_pipeline, run_stage
from ultratron.evaluation.builtin import held_out_documents, task_texts


def _items(lang: str, n: int = 12) -> list[str]:
    """Evaluation items: the first paragraph of prose written from the corpus's held-out frames."""
    return [d["text"].split("\n\n")[0] for d in build(seed=9, held_out=True) if d["lang"] == lang
            and d["kind"] == "prose"][:n]


def _respaced(text: str, rng: random.Random, unspaced: bool) -> str:
    """The item with its spacing changed: runs of spaces and line breaks between (or, in Chinese,
    inside) its words."""
    if unspaced:
        return "".join(ch + (rng.choice(["", "", " ", "\n", "  "])) for ch in text)
    return "".join(rng.choice(["  ", "\n", " \t ", "\n\n"]) if ch == " " else ch for ch in text)


def _variants(item: str, k: int, rng: random.Random, unspaced: bool) -> str:
    return [item, item.upper(), _respaced(item, rng, unspaced), _respaced(item.swapcase(), rng, unspaced)][k % 4]


def _write_tasks(tmp_path) -> dict[str, list[str]]:
    """An lm-eval-style multiple-choice file of the English items and a text task of the Chinese ones."""
    en, zh = _items("en"), _items("zh")
    mc = tmp_path / "en_mc.jsonl"
    mc.write_text("".join(json.dumps({"query": item.rsplit(" ", 3)[0], "choices": [item.rsplit(" ", 3)[1], "no"],
                                      "gold": 0}) + "\n" for item in en))
    text = tmp_path / "zh_text.jsonl"
    text.write_text("".join(json.dumps({"type": "text", "text": item}) + "\n" for item in zh))
    return {"en_mc": en, "zh_text": zh, "spec": f"{mc},{text}"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A clean corpus of 1036 documents (7 languages: Thai's segmenter alone takes seconds to load) with
    every item planted 4 times in other documents."""
    tmp = tmp_path_factory.mktemp("decont")
    tasks = _write_tasks(tmp)
    clean = [d for seed in range(4) for d in build(seed=seed) if d["lang"] != "th"]
    rng = random.Random(0)
    planted = []
    for task, lang in (("en_mc", "en"), ("zh_text", "zh")):
        hosts = [d for d in clean if d["lang"] == lang]
        for i, item in enumerate(tasks[task]):
            for k in range(4):
                host = hosts[rng.randrange(len(hosts))]["text"]
                cut = rng.randrange(len(host))
                text = host[:cut] + "\n" + _variants(item, k, rng, lang == "zh") + "\n" + host[cut:]
                planted.append({"id": f"planted-{task}-{i}-{k}", "text": text, "task": task, "host": len(host)})
    docs = [{"id": d["id"], "text": d["text"]} for d in clean] + [{"id": d["id"], "text": d["text"]} for d in planted]
    random.Random(1).shuffle(docs)
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    tmp.joinpath("hosts.json").write_text(json.dumps({d["id"]: d["host"] for d in planted}))
    return tmp, src, tasks, {d["id"]: d["task"] for d in planted}, len(clean)


def _decisions(out) -> dict[str, dict]:
    return {d["id"]: d for d in map(json.loads, (out / "_decisions" / "in.jsonl").read_text().splitlines())}


def test_every_planted_item_is_removed_and_no_clean_document(corpus):
    tmp, src, tasks, planted, n_clean = corpus
    cfg = from_dict({"decontaminate": {"tasks": tasks["spec"]}, "pipeline": {"workers": 1, "progress": False}})
    summary = run_stage("decontaminate", cfg, src, tmp / "out", task_texts=task_texts)
    decisions = _decisions(tmp / "out")
    removed = {i: d["reason"] for i, d in decisions.items() if d["decision"] == "removed"}
    assert {i: removed.get(i) for i in planted} == {i: f"contaminated:{task}" for i, task in planted.items()}
    false = [i for i in removed if i not in planted]
    assert len(false) <= n_clean // 1000, false  # ≤ 0.1 % of the clean corpus (measured: none)
    assert summary["removed"] == {"contaminated:en_mc": 48, "contaminated:zh_text": 48}
    counts = summary["decontaminate_tasks"]
    assert counts["en_mc"]["items"] == counts["zh_text"]["items"] == 12 and counts["en_mc"]["items_too_short"] == 0


def test_cut_mode_keeps_the_rest_of_the_document(corpus, tmp_path):
    tmp, src, tasks, planted, _ = corpus
    cfg = from_dict({"decontaminate": {"tasks": tasks["spec"], "mode": "cut"}, "pipeline": {"progress": False}})
    run_stage("decontaminate", cfg, src, tmp_path / "cut", task_texts=task_texts)
    decisions = _decisions(tmp_path / "cut")
    assert {i: decisions[i]["decision"] for i in planted} == {i: "modified" for i in planted}
    out = {r["id"]: r["text"] for r in map(json.loads, (tmp_path / "cut" / "in.jsonl").read_text().splitlines())}
    index, _ = build_index({"en": tasks["en_mc"], "zh": tasks["zh_text"]}, 13)
    assert all(not len(index.matches(out[i])[0]) for i in planted)  # no n-gram of an item is left
    hosts = json.loads((tmp / "hosts.json").read_text())
    assert all(len(out[i]) >= hosts[i] for i in planted)  # the text around the item is all kept
    source = {r["id"]: r["text"] for r in map(json.loads, src.read_text().splitlines())}
    assert {i: t for i, t in out.items() if i not in planted} == {i: t for i, t in source.items() if i not in planted}


def test_words_ignore_case_punctuation_and_spacing_and_spans_match_them():
    assert words("Hello,  WORLD!\n(it's) 3.14") == ["hello", "world", "it", "s", "3", "14"]
    assert words("东京是 日本的\n首都。") == words("东京是日本的首都") == ["东京", "是", "日本", "的", "首都"]
    text = "Ab  cd, 东京 是日本的首都 ef"
    index, _ = build_index({"t": ["ab cd 东京是日本"]}, 3)
    starts, tasks = index.matches(text)
    assert starts.tolist() == [0, 1, 2] and tasks.tolist() == [0, 0, 0]
    assert matched_spans(text, starts, 3) == [(0, text.index("日本") + 2)]


def test_the_builtin_suite_finds_its_own_documents():
    docs = [text for _, text in held_out_documents(0.05)[:5]]
    index, counts = build_index(task_texts("builtin"), 13)
    assert all(len(index.matches(text)[0]) for text in docs)
    assert counts["builtin_arithmetic"]["items_too_short"] == counts["builtin_arithmetic"]["items"]  # 12 numbers


def test_the_command_reports_per_task_without_writing(corpus, capsys):
    tmp, src, tasks, _, _ = corpus
    assert main(["data", "decontaminate", "--tasks", tasks["spec"], "--input", str(src)]) == 0
    out = capsys.readouterr().out
    assert "| en_mc | 12 | 0 |" in out and "| 48 | 0 |" in out and "contaminated:zh_text: planted-zh_text" in out
    assert main(["data", "decontaminate", "--tasks", "no_such_task", "--input", str(src)]) == 2
    assert main(["data", "decontaminate", "--input", str(src), "--decontaminate.mode", "drop"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'no_such_task'" in err and "decontaminate.mode: 'drop' is not one of remove, cut" in err


def test_the_pipeline_report_has_a_row_per_task(tmp_path, small_corpus):
    """`data run` with the stage: the removed file is counted under its task in report.md."""
    item = (small_corpus / "textwrap.py").read_text().splitlines()[40:60]
    task = tmp_path / "copied.jsonl"
    task.write_text(json.dumps({"type": "text", "text": "\n".join(item)}) + "\n")
    cfg = from_dict({"pipeline": {"input": str(small_corpus), "output": str(tmp_path / "out"), "progress": False,
                                  "stages": ["read", "decontaminate"]}, "decontaminate": {"tasks": str(task)}})
    report = run_pipeline(cfg, log=lambda line: None, task_texts=task_texts)
    assert report["stages"][-1]["removed"] == {"contaminated:copied": 1}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Decontamination (13-grams, remove)" in md and "| copied | 1 | 0 |" in md and "| 1 | 0 |\n" in md
