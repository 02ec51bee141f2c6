"""Chat data (`data.format = "chat"`) → packed token shards with the loss on the answers only.

Input is JSONL in the common messages format, one conversation a line:

    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}

(content may also be a list of text parts). Each conversation is rendered with the model's chat
template and tokenized with its loss mask (`data/chat.py`); conversations are then packed, in
order, into sequences of exactly `seq_len` tokens (the rest of a sequence is EOS padding that
counts in nothing), so no conversation is ever cut. Conversations that cannot be trained on are
rejects, counted by reason, logged and listed in `rejects.jsonl` beside the shards: a line that is
not JSON, no messages, a message without a role or with an unknown one, content that is not text,
no assistant turn, more tokens than one sequence holds, or the same messages as an earlier
conversation (exact deduplication, before the train/held-out split). With several files, each one's
held-out conversations are also packed alone, so validation reports each file's loss besides the
overall one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from ultratron import atomic
from ultratron.data.chat import Reject, Rendered, check_messages, render, render_conversation
from ultratron.data.shards import DOC_START, LOSS, ShardWriter
from ultratron.data.sources import held_out, iter_jsonl, walk_files
from ultratron.data.tokenizer import Tokenizer
from ultratron.errors import DataError

REJECTS_FILE = "rejects.jsonl"
VAL_SOURCES = "val-sources"  # with several chat files: each one's held-out split, for validation per source


def builtin_conversations(n: int = 3000, seed: int = 0) -> list[dict]:
    """The built-in conversation set (data.format=chat without data.path): a task with one right
    answer per prompt — the user sends a word of five letters a-h, the assistant answers it in
    capitals — so a fine-tuned model can be checked exactly on words it never saw."""
    import random

    rng = random.Random(seed)
    words = sorted({"".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(2 * n)})[:n]
    rng.shuffle(words)
    return [{"id": f"builtin:{w}", "messages": [{"role": "user", "content": w},
                                                {"role": "assistant", "content": w.upper()}]} for w in words]


def chat_files(path: str | Path) -> dict[str, Path]:
    """The JSONL files of conversations data.path names, by their name as a source (the path
    relative to a directory, without .jsonl)."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data.path {str(root)!r} does not exist")
    files = [root] if root.is_file() else walk_files(root, (".jsonl",))
    if not files:
        raise DataError(f"{root}: no .jsonl files of conversations (data.format=chat)")
    return {(f.name if root.is_file() else str(f.relative_to(root))).removesuffix(".jsonl"): f for f in files}


def iter_records(path: str | Path) -> Iterator[tuple[str, object]]:
    """(conversation id, parsed record or Reject) of each non-empty line of a JSONL file or of
    the .jsonl files of a directory; the id is the record's "id" or FILE:LINE."""
    root = Path(path)
    for file in chat_files(root).values():
        rel = file.name if root.is_file() else str(file.relative_to(root))
        for line in iter_jsonl(file):
            where = f"{rel}:{line.number}"
            if line.problem is not None:
                yield where, Reject("invalid_json", f"not valid UTF-8 JSON ({line.detail})")
            else:
                record = line.value
                yield str(record.get("id", where)) if isinstance(record, dict) else where, record


def tokenize_conversation(record, tokenizer: Tokenizer, seq_len: int) -> Rendered:
    """A record's tokens and loss mask, or Reject (also when it holds more than seq_len tokens)."""
    if isinstance(record, Reject):
        raise record
    rendered = render_conversation(check_messages(record), tokenizer)
    if len(rendered.ids) > seq_len:
        raise Reject("too_long", f"{len(rendered.ids)} tokens, more than training.seq_len={seq_len}; "
                                 "raise training.seq_len or shorten the conversation")
    return rendered


class Packer:
    """Conversations → sequences of exactly seq_len tokens with their flags, written as they fill."""

    def __init__(self, writer: ShardWriter, seq_len: int, pad_id: int):
        self.writer, self.seq_len, self.pad_id = writer, seq_len, pad_id
        self.ids: list[int] = []
        self.flags: list[int] = []
        self.n_sequences = 0

    def add(self, rendered: Rendered) -> None:
        if len(self.ids) + len(rendered.ids) > self.seq_len:
            self.flush()
        flags = [LOSS if counts else 0 for counts in rendered.mask]
        flags[0] = DOC_START  # nothing of its own document comes before its first token to predict it
        self.ids += rendered.ids
        self.flags += flags

    def flush(self) -> None:
        if not self.ids:
            return
        pad = self.seq_len - len(self.ids)
        self.writer.add(self.ids + [self.pad_id] * pad,
                        np.asarray(self.flags + [DOC_START] * min(pad, 1) + [0] * max(pad - 1, 0), dtype=np.uint8))
        self.n_sequences += 1
        self.ids, self.flags = [], []


def write_split(records, tokenizer: Tokenizer, seq_len: int, out_dir: Path) -> tuple[dict, list[dict]]:
    """Pack one split's conversations into out_dir; (its shard meta with counts, its rejects)."""
    writer = ShardWriter(out_dir, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                         tokenizer_sha256=tokenizer.sha256)
    packer = Packer(writer, seq_len, tokenizer.eos_id)
    rejects: list[dict] = []
    n_conversations = n_tokens = n_loss = 0
    for conv_id, record in records:
        try:
            rendered = tokenize_conversation(record, tokenizer, seq_len)
        except Reject as reject:
            rejects.append({"id": conv_id, "reason": reject.reason, "detail": str(reject)})
            continue
        packer.add(rendered)
        n_conversations += 1
        n_tokens += len(rendered.ids)
        n_loss += rendered.n_loss_tokens
    packer.flush()
    meta = writer.close({"packed": seq_len, "n_conversations": n_conversations, "n_conversation_tokens": n_tokens,
                         "n_loss_tokens": n_loss, "n_sequences": packer.n_sequences, "n_rejects": len(rejects)})
    return meta, rejects


def _rendered_texts(path, tokenizer=None) -> Iterator[str]:
    for _, record in iter_records(path):
        try:
            yield render(check_messages(record), tokenizer, add_generation_prompt=False)
        except Reject:
            continue


def prepare_chat(data_cfg, vocab_size: int, seq_len: int, out_dir: Path, log: Callable[[str], None]):
    """Tokenizer and packed train/val shards of data.path's conversations in out_dir; returns
    (tokenizer, summary). The tokenizer is data.tokenizer (an imported model's, with its chat
    template) or else one trained on the conversations rendered with the default template."""
    from ultratron.data.tokenizer import train_tokenizer

    if data_cfg.path is None:
        path = out_dir / "builtin-chat.jsonl"
        atomic.write_text(path, "".join(json.dumps(c) + "\n" for c in builtin_conversations()))
        log(f"data: the built-in conversation set ({path}: a word → the word in capitals)")
        data_cfg = dataclasses.replace(data_cfg, path=str(path))
    if data_cfg.tokenizer:
        tokenizer = Tokenizer.load(data_cfg.tokenizer)
        template = "its own chat template" if tokenizer.chat_template else "the default chat template"
        log(f"data: loaded tokenizer {data_cfg.tokenizer} ({tokenizer.vocab_size} tokens; {template})")
    else:
        log(f"data: training a byte-level BPE tokenizer ({vocab_size} tokens) on the conversations")
        tokenizer = train_tokenizer(_rendered_texts(data_cfg.path), vocab_size)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
                        "raise model.vocab_size or use a smaller tokenizer")
    tokenizer.save(out_dir / "tokenizer.json")

    duplicate = _duplicates(data_cfg.path)

    def split(want_held_out: bool, path=data_cfg.path):
        return ((i, Reject("duplicate", "the same messages as an earlier conversation") if dup else r)
                for (i, r), dup in zip(iter_records(path), duplicate[str(path)], strict=True)
                if held_out(i, data_cfg.held_out_fraction) == want_held_out)

    train, train_rejects = write_split(split(False), tokenizer, seq_len, out_dir / "train")
    val, val_rejects = write_split(split(True), tokenizer, seq_len, out_dir / "val")
    val_sources = {}
    files = chat_files(data_cfg.path)
    if len(files) > 1:  # several files: each one's held-out conversations also alone, for validation per source
        for n, (name, file) in enumerate(files.items()):
            meta, _ = write_split(split(True, file), tokenizer, seq_len, out_dir / VAL_SOURCES / f"{n:04d}")
            if meta["n_tokens"]:
                val_sources[name] = f"{VAL_SOURCES}/{n:04d}"
    rejects = train_rejects + val_rejects
    atomic.write_text(out_dir / REJECTS_FILE, "".join(json.dumps(r) + "\n" for r in rejects))
    if not train["n_conversations"]:
        raise DataError(f"no conversation of {data_cfg.path} can be trained on ({len(rejects)} rejected: "
                        f"{_reasons(rejects)}; see {out_dir / REJECTS_FILE})")
    keys = ("n_conversations", "n_conversation_tokens", "n_loss_tokens", "n_sequences", "n_tokens", "n_rejects")
    summary = {"format": "chat", "source": data_cfg.path, "tokenizer_vocab_size": tokenizer.vocab_size,
               "train": {k: train[k] for k in keys}, "val": {k: val[k] for k in keys},
               "rejects": dict(Counter(r["reason"] for r in rejects)), "val_sources": val_sources}
    for name, meta in (("train", train), ("held-out", val)):
        fill = meta["n_conversation_tokens"] / max(meta["n_tokens"], 1)
        log(f"data: {name} {meta['n_conversations']} conversations in {meta['n_sequences']} sequences of {seq_len} "
            f"tokens ({fill:.0%} filled); {meta['n_loss_tokens']:,} answer tokens count in the loss")
    if rejects:
        log(f"data: {len(rejects)} conversations rejected ({_reasons(rejects)}); each is listed in "
            f"{out_dir / REJECTS_FILE}, e.g. {rejects[0]['id']}: {rejects[0]['detail']}")
    return tokenizer, summary


def _duplicates(path) -> dict[str, list[bool]]:
    """Exact deduplication before the split (a copy never lands on both sides of it): for
    data.path and each of its files, in reading order, whether a record's messages equal an
    earlier record's (of any file)."""
    seen: set[str] = set()
    flags: dict[str, list[bool]] = {}
    for file in chat_files(path).values():
        mine = flags[str(file)] = []
        for _, record in iter_records(file):
            messages = record.get("messages") if isinstance(record, dict) else None
            key = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest() if messages else None
            mine.append(key is not None and key in seen)
            if key is not None:
                seen.add(key)
    flags[str(path)] = [d for f in chat_files(path).values() for d in flags[str(f)]]
    return flags


def _reasons(rejects: list[dict]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(Counter(r["reason"] for r in rejects).items()))
