"""`ultratron import hf`: a small random transformers model saved locally → an ultratron checkpoint
with the same logits, an export that reproduces the original tensors, and training that continues
from it (the loss at step 1 is the imported model's loss on that batch)."""

import json

import pytest
import torch

from conftest import run_cli
from ultratron.checkpoint.hf_import import import_hf, inspect_hf, map_config
from ultratron.errors import CheckpointError

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE = {"num_experts_per_tok": 2, "router_jitter_noise": 0.0}
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>assistant:"


def _tokenizer_files(out, corpus):
    """A byte-level BPE tokenizer.json with Llama-2-style <s> / </s> and a tokenizer_config naming them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))[:6]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "bos_token": "<s>",
         "chat_template": TEMPLATE}))


def _hf_model(root, corpus, family="llama", tie=True, shard=False, seed=0, **extra):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
           "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[family]
    config = cls[0](hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=320,
                    max_position_embeddings=extra.pop("max_position_embeddings", 128), rms_norm_eps=1e-6,
                    tie_word_embeddings=tie, eos_token_id=1, bos_token_id=0, **extra)
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor random, norms and biases included
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if p.dim() == 1 else 0.05)
            if name.endswith(".gate.weight"):  # decisive routing: rounding cannot flip a top-k choice
                p.normal_(0.0, 1.0)
    root.mkdir(parents=True)
    model.save_pretrained(str(root), max_shard_size="60KB" if shard else "1GB")
    _tokenizer_files(root, corpus)
    return model


def _tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_a_mistral_with_a_window_shorter_than_its_context_keeps_transformers_logits(tmp_path, small_corpus):
    """sliding_window 64 of a 256 context, 200 positions: each query past 64 sees only its window, in
    transformers and in the imported model alike, and in the model exported back (1e-5 on fp32 logits,
    as the test below)."""
    from ultratron.checkpoint.hf import export_hf
    from ultratron.checkpoint.inference import load_for_inference
    from ultratron.errors import ExportError

    hf_model = _hf_model(tmp_path / "hf", small_corpus, "mistral", False, False, sliding_window=64,
                         max_position_embeddings=256)
    import_hf(tmp_path / "hf", tmp_path / "run")
    loaded = load_for_inference(tmp_path / "run")
    assert loaded.model.args.sliding_window == 64
    ids = torch.randint(2, 320, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = loaded.model(ids), hf_model(ids).logits
        unwindowed = build_like(loaded.model, sliding_window=0)(ids)  # (the test can tell: it matters)
    assert float((ours - theirs).abs().max()) < 1e-5
    assert float((unwindowed[:, 100:] - theirs[:, 100:]).abs().max()) > 1e-3
    out = export_hf(loaded.model, loaded.tokenizer, tmp_path / "again")  # back as a Mistral with its window
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert again.config.model_type == "mistral" and again.config.sliding_window == 64
    with torch.no_grad():
        assert float((again(ids).logits - ours).abs().max()) < 1e-5
    with pytest.raises(ExportError, match="only Mistral's and Mixtral's window on every layer"):
        export_hf(build_like(loaded.model, sliding_window_pattern=2), loaded.tokenizer, tmp_path / "pattern")


def test_serve_greedy_of_an_imported_windowed_mistral_equals_transformers(tmp_path, small_corpus):
    """Issue 45's acceptance: a Mistral with sliding_window 64 of a 256 context, imported, answers a
    200-token prompt through serve's engine (KV cache, a prompt prefilled in chunks of 48 tokens, the
    prefix cache on) with transformers' greedy tokens, token for token. Greedy ids are exact: the
    logits agree within 1e-5 (the test above) and the test checks each chosen token's margin over
    the runner-up is far above that, so no rounding can flip a choice."""
    from ultratron.checkpoint.inference import load_for_inference
    from ultratron.inference.engine import Engine, SamplingParams, Sequence

    hf_model = _hf_model(tmp_path / "hf", small_corpus, "mistral", False, False, sliding_window=64,
                         max_position_embeddings=256)
    import_hf(tmp_path / "hf", tmp_path / "run")
    loaded = load_for_inference(tmp_path / "run")
    prompt = torch.randint(2, 320, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    new = 24
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                   eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want = theirs.sequences[0, len(prompt):].tolist()
    margins = [float(step[0].topk(2).values.diff().abs()) for step in theirs.logits]
    assert min(margins) > 1e-3, margins  # a choice rounding cannot flip
    engine = Engine(loaded.model, eos_id=-1, decode=lambda ids: "", slots=2, capacity=256,
                    prefix_cache_tokens=256, max_batched_tokens=48)
    seq = Sequence(prompt, SamplingParams(max_tokens=new, temperature=0))
    engine.admit([seq])
    while engine.busy:
        engine.admit([])
        engine.step()
    assert seq.token_ids == want
    # (the window matters here: the same weights unwindowed choose other tokens)
    assert _greedy(build_like(loaded.model, sliding_window=0), prompt, new) != want


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def build_like(model, **changes):
    """The same weights in a model built from `model.args` with `changes`."""
    import dataclasses

    from ultratron.models.llama import Llama

    other = Llama(dataclasses.replace(model.args, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("family,tie,shard,extra", [
    ("llama", True, False, {}),
    ("llama", False, True, {"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                            "rope_theta": 500_000.0}),
    ("qwen2", False, False, {}),
    ("mistral", False, False, {"sliding_window": None}),
    ("qwen3", True, False, {"head_dim": 24}),  # QK-norm, a head width of its own
    ("mixtral", False, True, MOE | {"num_local_experts": 4}),
    # QK-norm, a dense first layer, scores not rescaled, a head width of its own
    ("qwen3_moe", False, False, MOE | {"num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [0],
                                       "norm_topk_prob": False, "head_dim": 24}),
])
def test_imported_model_has_transformers_logits_and_exports_back_exactly(tmp_path, small_corpus, family, tie,
                                                                          shard, extra):
    from ultratron.checkpoint.hf import export_hf
    from ultratron.checkpoint.inference import load_for_inference

    hf_dir = tmp_path / "hf"
    hf_model = _hf_model(hf_dir, small_corpus, family, tie, shard, **extra)
    assert type(hf_model).__name__ == ARCHITECTURES[family]
    assert (hf_dir / "model.safetensors.index.json").is_file() == shard
    if family in ("mixtral", "qwen3_moe"):  # the command itself, for the mixtures of experts
        result = run_cli("import", "hf", "--model", str(hf_dir), "--out", str(tmp_path / "run"))
        assert result.returncode == 0, result.stderr
        assert "continue training" in result.stdout
        ckpt = None
    else:
        ckpt = import_hf(hf_dir, tmp_path / "run")
    loaded = load_for_inference(tmp_path / "run")
    assert loaded.checkpoint_dir == (ckpt or loaded.checkpoint_dir) and loaded.step == 0
    assert loaded.model.args.tie_embeddings == tie and loaded.model.args.n_kv_heads == 2
    ids = [[5, 9, 300, 12, 7, 44, 1, 2, 3, 250, 17, 18, 100, 101, 102, 103] * 6]  # 96 positions
    with torch.no_grad():
        ours, theirs = loaded.model(torch.tensor(ids)), hf_model(torch.tensor(ids)).logits
    diff = float((ours - theirs).abs().max())
    print(f"import {family} tied={tie}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-5
    # the tokenizer, its EOS/BOS and chat template came along
    tok = loaded.tokenizer
    assert (tok.eos_token, tok.bos_token, tok.chat_template) == ("</s>", "<s>", TEMPLATE)
    assert tok.eos_id == 1
    # export gives back the very tensors that were imported
    out = export_hf(loaded.model, tok, tmp_path / "again")
    original, exported = _tensors(hf_dir), _tensors(out)
    if tie:
        original.pop("lm_head.weight", None)
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    again = json.loads((out / "config.json").read_text())
    # a Mistral without a sliding window is a Llama, and is exported as one
    assert again["model_type"] == {"mistral": "llama"}.get(family, family) and again["tie_word_embeddings"] == tie
    if "rope_scaling" in extra:
        assert again["rope_scaling"]["rope_type"] == "llama3" and again["rope_scaling"]["factor"] == 4.0


def test_training_continues_from_the_import(tmp_path, small_corpus):
    """CLI import, then `train` from its config: step 1's loss is the HF model's loss on that batch."""
    from conftest import TINY
    from ultratron.config import load_config
    from ultratron.data.loader import TokenLoader
    from ultratron.data.shards import ShardSet
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    hf_dir = tmp_path / "hf"
    hf_model = _hf_model(hf_dir, small_corpus, tie=False)
    result = run_cli("import", "hf", "--model", str(hf_dir), "--out", str(tmp_path / "imported"))
    assert result.returncode == 0, result.stderr
    assert "continue training" in result.stdout
    run = tmp_path / "ft"
    keep = [x for i, x in enumerate(TINY) if not (TINY[i].startswith("--model") or
                                                 (i and TINY[i - 1].startswith("--model")))]
    overrides = keep + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--run.dir", str(run),
                        "--training.steps", "2", "--training.batch_tokens", "256", "--eval.interval", "0"]
    cfg = load_config(tmp_path / "imported" / "config.toml", overrides)
    assert cfg.model.init_from == str((tmp_path / "imported").resolve()) and cfg.model.dim == 64
    train(cfg, echo=False)
    first = read_metrics(run)[0]
    loader = TokenLoader(ShardSet.open(run / "data" / "train"), seq_len=64, micro_batch_size=4, seed=0)
    inputs, targets = loader.next_batch()
    with torch.no_grad():
        logits = hf_model(inputs).logits
    want = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert first["step"] == 1 and abs(first["loss"] - want) < 1e-5, (first["loss"], want)
    # in place: the import's own run directory resumes from its weights-only checkpoint at step 0
    again = load_config(tmp_path / "imported" / "config.toml", overrides[:-8] + [
        "--training.steps", "1", "--training.batch_tokens", "256", "--eval.interval", "0",
        "--checkpoint.resume", "auto", "--data.path", str(small_corpus), "--data.extensions", ".py"])
    assert again.run.dir == str((tmp_path / "imported").resolve())
    train(again, echo=False)
    assert abs(read_metrics(tmp_path / "imported")[0]["loss"] - want) < 1e-5


def test_what_does_not_map_is_refused_with_every_reason(tmp_path, small_corpus):
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "vocab_size": 320}
    _, problems = map_config({**base, "attention_bias": True, "partial_rotary_factor": 0.5, "hidden_act": "gelu",
                              "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert len(problems) == 4 and any("yarn" in p for p in problems) and any("partial_rotary" in p for p in problems)
    # a mixture of experts whose dense layers are not the first ones (Qwen3-MoE's decoder_sparse_step=2)
    moe = {**base, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "num_hidden_layers": 4}
    fields, problems = map_config({**moe, "mlp_only_layers": [0, 1]})
    assert not problems and (fields["n_dense_layers"], fields["n_experts"], fields["expert_ffn_dim"]) == (2, 4, 32)
    _, problems = map_config({**moe, "decoder_sparse_step": 2})
    assert problems == ["dense layers [0, 2] (mlp_only_layers, decoder_sparse_step): ultratron keeps only the first "
                        "layers dense"]
    fields, problems = map_config({**base, "model_type": "mistral", "sliding_window": 64,
                                   "max_position_embeddings": 256})
    assert not problems and fields["sliding_window"] == 64  # the window on every layer
    _, problems = map_config({**base, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                              "max_window_layers": 1, "max_position_embeddings": 256})
    assert problems and "--max-seq-len 64" in problems[0]  # Qwen2's first layers full, the rest windowed
    fields, problems = map_config({**base, "model_type": "mistral", "sliding_window": 64,
                                   "max_position_embeddings": 256}, max_seq_len=64)
    assert not problems and fields["max_seq_len"] == 64 and "sliding_window" not in fields
    assert "not a model ultratron can hold" in map_config({"model_type": "gpt2"})[1][0]
    # a directory with an extra tensor and no tokenizer: both reasons, one line each, and nothing written
    hf_dir = tmp_path / "hf"
    _hf_model(hf_dir, small_corpus, tie=True)
    (hf_dir / "tokenizer.json").unlink()
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    with pytest.raises(CheckpointError) as err:
        inspect_hf(hf_dir)
    assert len(err.value.problems) == 2 and all(p.startswith(f"cannot import {hf_dir}") for p in err.value.problems)
    result = run_cli("import", "hf", "--model", str(hf_dir), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.count("error: cannot import") == 2
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_deepseek_v3_is_refused_in_one_line(tmp_path, small_corpus):
    """Multi-head latent attention has no place in our decoder: one error line says so, nothing is written."""
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, vocab_size=320, max_position_embeddings=128)
    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(str(hf_dir))
    _tokenizer_files(hf_dir, small_corpus)
    result = run_cli("import", "hf", "--model", str(hf_dir), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot import") and "multi-head latent attention" in lines[0]
    assert not (tmp_path / "out").exists()


def test_import_streams_one_tensor_at_a_time(tmp_path, small_corpus, monkeypatch):
    """The save planner reads each tensor only when it is written, and DCP lets it go after: at
    most two tensors' memory (storages, which DCP's own aliases keep alive too) at any moment."""
    import weakref

    from ultratron.checkpoint import hf_import

    _hf_model(tmp_path / "hf", small_corpus, tie=False)
    storages, peak = [], [0]
    original = hf_import.TensorSource.tensor

    def tracked(self, name):
        tensor = original(self, name)
        storages.append(weakref.ref(tensor.untyped_storage()))
        peak[0] = max(peak[0], sum(ref() is not None for ref in storages))
        return tensor

    monkeypatch.setattr(hf_import.TensorSource, "tensor", tracked)
    import_hf(tmp_path / "hf", tmp_path / "run")
    assert len(storages) == 3 + 2 * 9  # embedding, norm, lm_head + 9 per layer, each read once
    assert peak[0] <= 2


def test_a_bf16_model_imports_to_fp32_and_exports_back_bit_for_bit(tmp_path, small_corpus):
    from ultratron.checkpoint.hf import export_hf
    from ultratron.checkpoint.inference import load_for_inference

    hf_model = _hf_model(tmp_path / "fp32", small_corpus, tie=False)
    hf_model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    _tokenizer_files(tmp_path / "bf16", small_corpus)
    import_hf(tmp_path / "bf16", tmp_path / "run")
    loaded = load_for_inference(tmp_path / "run")
    assert next(loaded.model.parameters()).dtype == torch.float32  # fp32 master weights to train on
    out = export_hf(loaded.model, loaded.tokenizer, tmp_path / "again", dtype="bfloat16")
    original, exported = _tensors(tmp_path / "bf16"), _tensors(out)
    assert original.keys() == exported.keys() and all(
        exported[k].dtype == torch.bfloat16 and torch.equal(original[k], exported[k]) for k in original)


def test_a_missing_init_from_is_one_error_line(tmp_path):
    from conftest import TINY

    result = run_cli("train", *TINY, "--model.init_from", str(tmp_path / "nowhere"), "--run.dir", str(tmp_path / "r"))
    assert result.returncode == 2 and result.stderr.strip().endswith("does not exist")
    assert "Traceback" not in result.stderr
