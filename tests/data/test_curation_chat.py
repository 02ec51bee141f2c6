"""Curation on conversations (read.format = "chat"): exact and near duplicates and too-short
conversations go, bad lines are counted, and the survivors come back unchanged as chat JSONL, one
file per input file, which the trainer's chat reader takes."""

from __future__ import annotations

import json
import random

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_pipeline
from ultratron.data.conversations import iter_records


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 8))) for _ in range(n))


def _chat(conv_id: str, system: str, question: str, answer: str) -> dict:
    return {"id": conv_id, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question},
                                        {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "meta": {"kept": "as is"}}


def test_duplicates_and_short_conversations_go_and_the_rest_come_back_unchanged(tmp_path):
    rng = random.Random(0)
    system = _words(rng, 300)  # shared by every conversation: if it counted, all would be near duplicates
    answer = _words(rng, 100).split()
    original = _chat("a", system, _words(rng, 20), " ".join(answer))
    question = original["messages"][1]["content"]
    near = _chat("a-near", system, question, " ".join(answer[:50] + ["changed"] + answer[51:]))
    other = _chat("b", system, _words(rng, 20), _words(rng, 100))
    short = _chat("short", system, "hi", "hello")
    no_answer = {"messages": [{"role": "user", "content": "anyone?"}]}
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    lines = [original, {**original, "id": "a-copy"}, near, short, no_answer]
    (src / "a.jsonl").write_text("\n".join(json.dumps(r) for r in lines[:3]) + "\n{not json\n"
                                 + "\n".join(json.dumps(r) for r in lines[3:]) + "\n")
    (src / "sub" / "b.jsonl").write_text(json.dumps(other) + "\n")
    (src / "notes.txt").write_text("not a conversation file: read.format = chat reads .jsonl only")
    out = tmp_path / "out"
    cfg = from_dict({"pipeline": {"input": str(src), "output": str(out), "docs_per_part": 3, "progress": False,
                                  "stages": ["read", "exact-dedup", "near-dedup", "filter", "write-chat"]},
                     "read": {"format": "chat"}, "filter": {"enabled": ["length"], "min_chars": 20}})
    report = run_pipeline(cfg, log=lambda _: None)

    removed = {s["stage"]: s["removed"] for s in report["stages"]}
    assert removed == {"read": {"malformed_jsonl": 1, "no_assistant_turn": 1}, "exact-dedup": {"exact_duplicate": 1},
                       "near-dedup": {"near_duplicate": 1}, "filter": {"length:min_chars": 1}, "write-chat": {}}
    assert [(s["docs_in"], s["docs_out"]) for s in report["stages"]] == [(7, 5), (5, 4), (4, 3), (3, 2), (2, 2)]
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert {(d["id"], d["reason"], d["cluster"]) for d in decisions if d["decision"] == "removed"} >= {
        ("a-copy", "exact_duplicate", "a"), ("a-near", "near_duplicate", "a"), ("short", "length:min_chars", None)}

    chats = out / "04-write-chat" / "conversations"
    assert report["trainer_data_path"] == str(chats)
    assert sorted(p.relative_to(chats).as_posix() for p in chats.rglob("*.jsonl")) == ["a.jsonl", "sub/b.jsonl"]
    assert [record for _, record in iter_records(chats)] == [original, other]  # the records exactly as read
