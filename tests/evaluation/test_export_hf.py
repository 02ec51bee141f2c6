"""`ultratron export hf` → transformers loads the directory → the same logits (fp32)."""

import json

import pytest
import torch

from conftest import run_cli
from ultratron.checkpoint.hf import export_hf
from ultratron.errors import ExportError
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.llama.hf_adapter import rope_to_half_split

transformers = pytest.importorskip("transformers")


def _hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                              dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_exported_checkpoint_loads_in_transformers_with_matching_logits(trained_checkpoint, tmp_path):
    out = tmp_path / "hf"
    result = run_cli("export", "hf", "--checkpoint", str(trained_checkpoint), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    from ultratron.checkpoint.inference import load_for_inference as load_model

    loaded = load_model(trained_checkpoint)
    text = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int\n"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = loaded.tokenizer.encode(text)
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok.eos_token == "<|endoftext|>"
    batch = [ids[:24], ids[2:26]]
    with torch.no_grad():
        ours = loaded.model(torch.tensor(batch))
    diff = float((ours - _hf_logits(out, batch)).abs().max())
    print(f"export: max |logit difference| ultratron vs transformers = {diff:.2e}")
    assert diff < 1e-4
    # a second export into the same directory is refused rather than mixed in
    again = run_cli("export", "hf", "--checkpoint", str(trained_checkpoint), "--out", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr


def test_untied_gqa_model_round_trips_and_unsupported_options_are_refused(tmp_path, trained_checkpoint):
    from ultratron.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(trained_checkpoint / "tokenizer.json")
    torch.manual_seed(1)
    args = LlamaArgs(n_layers=2, dim=48, n_heads=6, n_kv_heads=2, ffn_dim=96, vocab_size=512, max_seq_len=64,
                     tie_embeddings=False, rope_theta=500_000.0, norm_eps=1e-6)
    model = Llama(args).eval()
    out = export_hf(model, tokenizer, tmp_path / "untied")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == 2
    ids = [[5, 9, 300, 12, 7, 44, 1, 2, 3, 500]]
    with torch.no_grad():
        diff = float((model(torch.tensor(ids)) - _hf_logits(out, ids)).abs().max())
    assert diff < 1e-4
    # the permutation moves each head's even rows first, then the odd ones
    w = torch.arange(8.0)[:, None]
    assert rope_to_half_split(w, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    for bad in ({"qk_norm": True, "qkv_bias": True}, {"attn_softcap": 30.0}, {"final_softcap": 15.0},
                {"sliding_window": 8, "qkv_bias": True}):
        odd = Llama(LlamaArgs(n_layers=1, dim=16, n_heads=2, n_kv_heads=2, ffn_dim=32, vocab_size=512,
                              max_seq_len=16, **bad))
        with pytest.raises(ExportError, match="cannot export"):
            export_hf(odd, tokenizer, tmp_path / f"bad-{next(iter(bad))}")
        assert not (tmp_path / f"bad-{next(iter(bad))}").exists()
