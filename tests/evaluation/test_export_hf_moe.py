"""A mixture of experts exports to transformers' Mixtral (no QK-norm) or Qwen3-MoE (QK-norm, dense
first layers, a head width of its own) with the same logits in fp32, and `ultratron import hf` then
`ultratron export hf` give back the very same tensors; other routings are refused with every reason."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from ultratron.checkpoint.hf import export_hf
from ultratron.errors import ExportError
from ultratron.models.llama import Llama, LlamaArgs

transformers = pytest.importorskip("transformers")

MOE = dict(n_layers=2, dim=48, n_heads=6, n_kv_heads=2, ffn_dim=64, vocab_size=512, max_seq_len=64,
           tie_embeddings=False, rope_theta=500_000.0, norm_eps=1e-6, n_experts=4, n_active_experts=2,
           expert_ffn_dim=32)


def _model(**kw) -> Llama:
    torch.manual_seed(2)
    model = Llama(LlamaArgs(**(MOE | kw))).eval()
    with torch.no_grad():  # decisive routing, so that rounding cannot flip a top-k choice
        for name, param in model.named_parameters():
            if name.endswith("router.gate.weight"):
                param.normal_(std=1.0)
    return model


@pytest.mark.parametrize("kw,family", [
    ({}, "MixtralForCausalLM"),
    ({"qk_norm": True, "n_dense_layers": 1, "head_dim": 12, "router_norm_topk": False}, "Qwen3MoeForCausalLM"),
])
def test_moe_exports_with_matching_logits(tmp_path, trained_checkpoint, kw, family):
    from ultratron.data.tokenizer import Tokenizer

    model = _model(**kw)
    out = export_hf(model, Tokenizer.load(trained_checkpoint / "tokenizer.json"), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [family]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    assert type(hf).__name__ == family
    ids = torch.tensor([[5, 9, 300, 12, 7, 44, 1, 2, 3, 500, 17, 23], [8, 8, 1, 400, 3, 2, 90, 91, 5, 6, 7, 11]])
    with torch.no_grad():
        diff = float((model(ids) - hf.eval()(ids).logits).abs().max())
    print(f"export {family}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-5
    # the commands, both ways: the exported directory imports as a checkpoint holding our very tensors,
    # and that checkpoint exports to the very tensors transformers just read
    result = run_cli("import", "hf", "--model", str(out), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    from ultratron.checkpoint.inference import load_for_inference

    imported = load_for_inference(tmp_path / "run").model.state_dict()
    assert imported.keys() == model.state_dict().keys()
    assert all(torch.equal(imported[k], v) for k, v in model.state_dict().items())
    result = run_cli("export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "again"))
    assert result.returncode == 0, result.stderr
    first, again = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == [family]


def test_routings_the_hf_classes_lack_are_refused_with_every_reason(tmp_path, trained_checkpoint):
    from ultratron.data.tokenizer import Tokenizer

    model = _model(n_shared_experts=1, router_score="sigmoid", n_dense_layers=1)
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias[0] = 0.01
    with pytest.raises(ExportError) as info:
        export_hf(model, Tokenizer.load(trained_checkpoint / "tokenizer.json"), tmp_path / "bad")
    text = str(info.value)
    for reason in ("no shared experts", "route by softmax", "Mixtral has no dense layers", "routing bias",
                   "multi-head latent attention"):
        assert reason in text, text
    assert not (tmp_path / "bad").exists()
