"""Chat data: the loss mask covers exactly the assistant turns (every role, several turns, the
default template and a model's own), conversations are packed whole, and bad ones are counted
rejects rather than a crash or a cut answer."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tolerances import replayed
from ultratron.data.chat import Reject, check_messages, render, render_conversation
from ultratron.data.conversations import prepare_chat
from ultratron.data.loader import IGNORE, TokenLoader
from ultratron.data.shards import DOC_START, LOSS, ShardSet
from ultratron.data.tokenizer import Tokenizer, train_tokenizer

# A ChatML-like template of the kind published with models: the answer's end marker is text the
# template adds after the content, and a system prompt is injected when there is none.
CHATML = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou help.<|im_end|>\\n' }}{% endif %}"
          "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Reverse 'abc'."},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "And 'hello world'?"},
    {"role": "tool", "content": "{\"reversed\": \"dlrow olleh\"}"},
    {"role": "assistant", "content": [{"type": "text", "text": "dlrow "}, {"type": "text", "text": "olleh"}]},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def base_tokenizer(small_corpus):
    texts = [p.read_text() for p in sorted(small_corpus.glob("*.py"))[:6]]
    return train_tokenizer(texts + [render(CONVERSATION, add_generation_prompt=False)], 400)


def _tokenizers(base):
    return {"default": base, "chatml": Tokenizer(base.hf, chat_template=CHATML)}


@pytest.mark.parametrize("template", ["default", "chatml"])
def test_the_mask_covers_exactly_the_assistant_turns(base_tokenizer, template):
    tokenizer = _tokenizers(base_tokenizer)[template]
    rendered = render_conversation(check_messages({"messages": CONVERSATION}), tokenizer)
    ids, mask = rendered.ids, rendered.mask
    # every token of the conversation is there, in order: the pieces decode to the full rendering
    assert tokenizer.decode(ids) == render(CONVERSATION, tokenizer, add_generation_prompt=False)
    # the masked tokens form one run per assistant turn, and each run is that answer as the template
    # closes it: for the default template the content, EOS and the blank line; for ChatML <|im_end|>\n
    runs, run = [], []
    for token, counts in zip(ids, mask, strict=True):
        if counts:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    ending = "<|endoftext|>\n\n" if template == "default" else "<|im_end|>\n"
    assert [tokenizer.decode(r) for r in runs] == ["cba" + ending, "dlrow olleh" + ending]
    # and everything unmasked is the prompts: each assistant's generation prompt ends right before its run
    for i, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            prompt = tokenizer.encode(render(CONVERSATION[:i], tokenizer, add_generation_prompt=True))
            assert len(prompt) <= len(ids) and ids[:len(prompt)] == prompt  # what the server would send
            assert not mask[len(prompt) - 1] and mask[len(prompt)]


@pytest.mark.parametrize("record, reason", [
    ({"messages": []}, "no_messages"),
    ({"text": "plain"}, "no_messages"),
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, "missing_role"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "x"}]},
     "bad_content"),
])
def test_bad_conversations_are_rejects_with_a_reason(record, reason):
    with pytest.raises(Reject) as info:
        check_messages(record)
    assert info.value.reason == reason


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_chat_shards_pack_whole_conversations_and_report_rejects(base_tokenizer, tmp_path):
    seq_len = 96
    good = [{"messages": [{"role": "user", "content": f"Reverse '{w}'."}, {"role": "assistant", "content": w[::-1]}]}
            for w in ("cat", "house", "python", "moon", "river", "stone", "green", "apple")]
    long_answer = "z" * 400  # far more than 96 tokens: it must not be cut to fit
    bad = ['{"messages": [', {"messages": [{"role": "user", "content": "hi"}]},
           {"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]},
           {"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": long_answer}]}]
    path = tmp_path / "chat.jsonl"
    _write_jsonl(path, good[:3] + bad + good[3:] + [good[1]])  # the last one a copy
    base_tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    cfg = SimpleNamespace(path=str(path), tokenizer=str(tmp_path / "tok" / "tokenizer.json"), held_out_fraction=0.0)
    logs = []
    tokenizer, summary = prepare_chat(cfg, 512, seq_len, tmp_path / "out", logs.append)
    assert summary["rejects"] == {"invalid_json": 1, "no_assistant_turn": 1, "missing_role": 1, "too_long": 1,
                                  "duplicate": 1}
    assert summary["train"]["n_conversations"] == len(good)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rejects] == ["chat.jsonl:4", "chat.jsonl:5", "chat.jsonl:6", "chat.jsonl:7",
                                          "chat.jsonl:13"]
    assert any("5 conversations rejected" in line for line in logs)

    shards = ShardSet.open(tmp_path / "out" / "train")
    tokens, flags = np.asarray(shards.tokens[0]), np.asarray(shards.flags[0])
    assert len(tokens) % seq_len == 0 and len(tokens) // seq_len == summary["train"]["n_sequences"]
    text = tokenizer.decode(tokens.tolist())
    assert "z" * 8 not in text  # the long conversation is nowhere, not even cut
    # each conversation lies whole within one sequence: a DOC_START per conversation, none cut
    starts = np.flatnonzero(flags & DOC_START)
    sequences = [render(g["messages"], tokenizer, add_generation_prompt=False) for g in good]
    assert [tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(starts, starts[1:], strict=False)
            if tokenizer.decode(tokens[a:b].tolist()) in sequences] == sequences
    answers = tokenizer.decode(tokens[(flags & LOSS) != 0].tolist())
    assert answers == "".join(g["messages"][1]["content"] + "<|endoftext|>\n\n" for g in good)

    # the loader: targets that count are exactly the answers; documents number the conversations
    loader = TokenLoader(shards, seq_len=seq_len, micro_batch_size=summary["train"]["n_sequences"],
                         documents=True)
    inputs, targets, documents = loader.next_batch()
    counted = targets[targets != IGNORE]
    assert sorted(tokenizer.decode(counted.tolist())) == sorted(answers)
    assert int(documents.max()) >= 2 and bool((documents[:, 0] == 1).all())
    with pytest.raises(Exception, match="packed into sequences of 96"):
        TokenLoader(shards, seq_len=64, micro_batch_size=1)


def test_plain_text_documents_restart_after_eos():
    """Pre-training shards: a document ends with EOS; the token after it begins the next one, and
    as a target it does not count (nothing of its document precedes it)."""
    from ultratron.data.loader import batch_of

    eos = 0
    window = np.array([5, 6, eos, 7, 8, 9, eos, 4, 3])
    inputs, targets, documents = batch_of([(window, None)], eos, documents=True)
    assert documents.tolist() == [[1, 1, 1, 2, 2, 2, 2, 3]]
    assert targets.tolist() == [[6, eos, IGNORE, 8, 9, eos, IGNORE, 3]]
    inputs, targets = batch_of([(window, None)], eos, documents=False)
    assert targets.tolist() == [window[1:].tolist()] and torch.equal(inputs, torch.from_numpy(window[None, :-1]).long())


def test_several_chat_files_are_validated_each_alone(base_tokenizer, tmp_path):
    """With a directory of chat files, validation reports each file's loss besides the overall one;
    at step 0 (the same weights) each equals a run on that file alone."""
    from conftest import TINY
    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    words = ["".join("abcdefgh"[(i * 7 + j * 3) % 8] for j in range(4 + i % 3)) + str(i) for i in range(240)]
    (tmp_path / "chats").mkdir()
    for name, task in (("upper", str.upper), ("reverse", lambda w: w[::-1])):
        _write_jsonl(tmp_path / "chats" / f"{name}.jsonl", [
            {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": task(w)}]} for w in words])
    base_tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    common = TINY + ["--data.format", "chat", "--data.tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
                     "--data.held_out_fraction", "0.3", "--training.steps", "1", "--eval.interval", "1",
                     "--eval.batches", "2"]
    cfg = load_config(None, common + ["--data.path", str(tmp_path / "chats"), "--run.dir", str(tmp_path / "both"),
                                      "--training.steps", "2"])
    result = train(cfg, echo=False)
    first = next(r for r in read_metrics(tmp_path / "both") if "val_loss" in r)
    assert {"val_loss/upper", "val_loss/reverse"} <= set(first)

    # the tokens reported as counting in the loss are the targets the loss mask keeps in the batches
    # the run read (the same loader, seed and shards), counted exactly; tokens and mfu count positions
    loader = TokenLoader(ShardSet.open(tmp_path / "both" / "data" / "train"), seq_len=cfg.training.seq_len,
                         micro_batch_size=cfg.training.micro_batch_size, seed=cfg.training.seed, documents=True)
    steps = [r for r in read_metrics(tmp_path / "both") if "loss" in r]
    counted = [sum(int((loader.next_batch()[1] != IGNORE).sum()) for _ in range(cfg.grad_accum_steps)) for _ in steps]
    assert [r["loss_tokens"] for r in steps] == counted and 0 < counted[0] < cfg.training.batch_tokens
    assert [r["loss_tokens_total"] for r in steps] == [counted[0], sum(counted)] == [counted[0], result.loss_tokens]
    for r in steps:  # the loss's share of the positions' figures: equal up to float rounding (a few ulps)
        share = r["loss_tokens"] / cfg.training.batch_tokens
        assert r["loss_tokens_mfu"] == pytest.approx(r["mfu"] * share, rel=1e-12)
        assert r["loss_tokens_per_sec"] == pytest.approx(r["tokens_per_sec"] * share, rel=1e-12)
    log = (tmp_path / "both" / "train.log").read_text()
    assert f"{cfg.training.steps * cfg.training.batch_tokens:,} positions; {sum(counted):,} of them counted" in log
    for name in ("upper", "reverse"):
        train(load_config(None, common + ["--data.path", str(tmp_path / "chats" / f"{name}.jsonl"),
                                          "--run.dir", str(tmp_path / name)]), echo=False)
        alone = next(r for r in read_metrics(tmp_path / name) if "val_loss" in r)
        assert replayed(first[f"val_loss/{name}"], alone["val_loss"]), name


def test_the_count_of_loss_tokens_is_kept_in_the_run_state():
    """A resumed run goes on counting from the checkpoint's total; one written before the count
    was kept starts it at 0."""
    from ultratron.training.state import TrainState

    loader = SimpleNamespace(state_dict=lambda: {"position": 7}, load_state_dict=lambda state: None)
    state = TrainState(loader)
    state.step, state.tokens, state.loss_tokens = 3, 1536, 401
    saved = state.state_dict()
    resumed = TrainState(loader)
    resumed.load_state_dict(saved)
    assert (resumed.step, resumed.tokens, resumed.loss_tokens) == (3, 1536, 401)
    del saved["loss_tokens"]
    resumed.load_state_dict(saved)
    assert resumed.loss_tokens == 0
