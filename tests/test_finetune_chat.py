"""End to end on a CPU: a transformers-initialised model → `import hf` → chat fine-tuning on a
task with one right answer per prompt → `serve`'s /v1/chat/completions answers held-out prompts.

The task: a user sends a word of 5 letters (a-h), the assistant answers it in capitals. Held-out
words were never trained on, so an exact answer means the model learned the task (copy each
letter, map it), not the words. The tokenizer is byte-level without merges (one token a letter),
so the task is the same for every word. ≥ 90% exact is the acceptance bar; measured 100%.

Then LoRA: on the fine-tuned model (LoRA adapts a trained model; on the random one its frozen
embeddings leave rank-8 adapters nowhere to start), rank-8 adapters on v and o (3.6% of the
parameters) learn a new behaviour, ending each answer with "!" (abcde → ABCDE!), which the model
never produced; their checkpoint holds the adapters alone and names the model under them;
`export hf --merge` and `export peft` give transformers the same greedy answers as our server.
(A task that remaps every letter, abcde → bcdef, was not learned by rank-8 v/o adapters in 400
steps here: 2% exact.)
"""

import json
import random
import socket
import threading
import time
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ultratron.checkpoint.hf_import import import_hf  # noqa: E402
from ultratron.config import load_config  # noqa: E402
from ultratron.training.metrics import read_metrics  # noqa: E402
from ultratron.training.trainer import train  # noqa: E402

LETTERS = "abcdefgh"
TASKS = {"upper": str.upper, "shout": lambda word: word.upper() + "!"}
N_HELD_OUT = 30


def _words():
    rng = random.Random(0)
    words = sorted({"".join(rng.choice(LETTERS) for _ in range(5)) for _ in range(6000)})
    rng.shuffle(words)
    return words[:N_HELD_OUT], words[N_HELD_OUT:]


def _hf_model(root):
    """A random transformers Llama and a byte-level tokenizer (256 bytes + <|endoftext|>, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root.mkdir(parents=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["x"], trainers.BpeTrainer(vocab_size=257, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "<|endoftext|>"}))
    eos = tok.token_to_id("<|endoftext|>")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                      max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=eos,
                                      bos_token_id=eos)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(root))


def _chat_file(path, task, words, bad=()):
    lines = [json.dumps({"messages": [{"role": "user", "content": w},
                                      {"role": "assistant", "content": TASKS[task](w)}]}) for w in words]
    path.write_text("\n".join(list(bad) + lines) + "\n")
    return path


def _train(config, run_dir, data, steps, lr, *extra):
    cfg = load_config(config, overrides=[
        "--data.path", str(data), "--data.format", "chat", "--data.held_out_fraction", "0.02",
        "--run.dir", str(run_dir), "--training.seq_len", "128", "--training.micro_batch_size", "8",
        "--training.batch_tokens", "1024", "--training.steps", str(steps), "--optim.lr", str(lr),
        "--optim.warmup_steps", "20", "--optim.weight_decay", "0", "--training.progress", "false",
        "--training.sample_tokens", "0", "--run.tensorboard", "false", "--eval.interval", str(steps),
        "--eval.batches", "2", "--health.check", "false", "--stability.grad_factor", "0",
        "--stability.loss_mad", "0", "--checkpoint.async_save", "false", *extra])
    return train(cfg, echo=False)


class _Served:
    """`serve`'s app on a local port for a checkpoint, as `ultratron serve` runs it."""

    def __init__(self, checkpoint):
        import uvicorn

        from ultratron.checkpoint.inference import load_for_inference
        from ultratron.serving.server import Server, create_app

        loaded = load_for_inference(checkpoint)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.uv = uvicorn.Server(uvicorn.Config(create_app(Server(loaded.model, loaded.tokenizer)), host="127.0.0.1",
                                                port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)

    def answer(self, word: str, parts: bool) -> str:
        content = [{"type": "text", "text": word}] if parts else word
        body = {"model": "ultratron", "messages": [{"role": "user", "content": content}], "max_tokens": 12,
                "temperature": 0}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())["choices"][0]["message"]["content"]

    def close(self):
        self.uv.should_exit = True
        self.thread.join(timeout=10)


def _served_answers(checkpoint, words):
    served = _Served(checkpoint)
    try:
        return {w: served.answer(w, parts=i % 2 == 1) for i, w in enumerate(words)}  # both content forms
    finally:
        served.close()


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """The imported model fine-tuned (every weight) on the capitals task, with three bad lines."""
    root = tmp_path_factory.mktemp("finetune")
    _hf_model(root / "hf")
    import_hf(root / "hf", root / "imported")
    held, train_words = _words()
    bad = ['{"messages": [{"role": "user", "content": "abc"}]}', "not json",
           json.dumps({"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]})]
    data = _chat_file(root / "upper.jsonl", "upper", train_words, bad)
    result = _train(root / "imported" / "config.toml", root / "full", data, steps=250, lr=3e-3)
    return root, result, held, train_words


def test_full_finetuning_answers_held_out_prompts_through_the_server(finetuned):
    root, result, held, _ = finetuned
    answers = _served_answers(result.checkpoint, held)
    exact = sum(answers[w] == w.upper() for w in held) / len(held)
    assert exact >= 0.9, answers
    # the bad lines were counted rejects, and the loss counted only the answers' tokens: 5 letters,
    # <|endoftext|> and the blank line (2) per conversation
    prepared = json.loads((root / "full" / "data" / "prepared.json").read_text())
    assert prepared["rejects"] == {"no_assistant_turn": 1, "invalid_json": 1, "too_long": 1}
    assert prepared["train"]["n_loss_tokens"] == 8 * prepared["train"]["n_conversations"]
    steps = [r for r in read_metrics(root / "full") if "loss" in r]
    assert all(0 < r["loss_tokens"] <= 8 * 3 * 8 for r in steps)  # ≤ 3 conversations a row of 128, 8 rows


@pytest.fixture(scope="module")
def lora_run(finetuned, tmp_path_factory):
    """Rank-8 adapters on v and o of the fine-tuned model, trained on the new ending; their served
    answers to the held-out words."""
    root, full, held, train_words = finetuned
    out = tmp_path_factory.mktemp("lora")
    data = _chat_file(out / "shout.jsonl", "shout", train_words)
    result = _train(root / "full" / "config.toml", out / "lora", data, 150, 2e-2, "--model.init_from",
                    str(full.checkpoint), "--lora.rank", "8", "--lora.alpha", "16", "--lora.targets", "v,o")
    return out, result.checkpoint, _served_answers(result.checkpoint, held)


def _greedy(directory, model, word):
    """transformers' greedy answer, with the exported tokenizer's chat template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": word}], add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_lora_learns_a_new_ending_and_the_merged_export_answers_as_the_server(finetuned, lora_run, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from ultratron.checkpoint.hf import export_hf
    from ultratron.checkpoint.inference import load_for_inference, read_lora
    from ultratron.models.registry import build_model

    root, full, held, _ = finetuned
    _, ckpt, answers = lora_run
    reference = json.loads((ckpt / "lora.json").read_text())
    assert reference == {"rank": 8, "alpha": 16.0, "targets": ["v", "o"], "base": str(full.checkpoint.resolve())}
    cfg = load_config(ckpt / "config.toml")
    adapted = read_lora(cfg, ckpt, build_model(cfg.model))
    trainable = sum(p.numel() for n, p in adapted.named_parameters() if n.endswith(("lora_a", "lora_b")))
    assert trainable / sum(p.numel() for p in adapted.parameters()) < 0.05
    # the checkpoint holds the adapters (and their optimizer state), nothing of the frozen model
    metadata = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    saved = [k for k in metadata if k.startswith("app.model.")]
    assert saved and all(k.endswith((".lora_a", ".lora_b")) for k in saved)
    want = {w: TASKS["shout"](w) for w in held}
    assert sum(answers[w] == want[w] for w in held) / len(held) >= 0.9, answers

    # transformers on the merged export gives the server's greedy answers
    loaded = load_for_inference(ckpt)
    export_hf(loaded.model, loaded.tokenizer, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    some = held[:8]
    assert {w: _greedy(tmp_path / "merged", merged, w) for w in some} == {w: answers[w] for w in some}


def test_peft_with_the_exported_adapter_answers_as_the_server(finetuned, lora_run, tmp_path):
    from ultratron.checkpoint.hf import export_hf, export_peft
    from ultratron.checkpoint.inference import load_for_inference, read_lora
    from ultratron.models.registry import build_model

    _, full, held, _ = finetuned
    _, ckpt, answers = lora_run
    cfg = load_config(ckpt / "config.toml")
    export_peft(read_lora(cfg, ckpt, build_model(cfg.model)), cfg.lora, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    peft = pytest.importorskip("peft")  # in the test extra; skipped where it is not installed
    base = load_for_inference(full.checkpoint)
    export_hf(base.model, base.tokenizer, tmp_path / "base")
    with_adapter = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), str(tmp_path / "adapter")).eval()
    some = held[:8]
    assert {w: _greedy(tmp_path / "base", with_adapter, w) for w in some} == {w: answers[w] for w in some}
