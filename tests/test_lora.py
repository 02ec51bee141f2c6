"""LoRA applied from outside the model: the base frozen with no optimizer state, the adapters the
only trainable parameters, a merge that computes what the adapted model computes, and a peft
adapter whose tensors, added to the Hugging Face export's layers, give the same logits.

Tolerances (fp32): merging turns W x + s·B(A x) into (W + s·B A) x — the same products summed in
another order, so each logit moves by a few ulps of the partial sums: ~1e-7 relative per
reduction over ≤ 128 terms, 2 layers. 1e-5 of the largest logit (~1-5 here) leaves a margin of
more than 10 over the measured ≤ 6e-7 absolute.
"""

import json

import pytest
import torch

from tolerances import replayed
from ultratron.models.llama import Llama, LlamaArgs
from ultratron.models.llama.parallel_plan import PLAN
from ultratron.models.lora import adapter_state, apply_lora, count_trainable, merged_state
from ultratron.training.optim import build_optimizer

ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def _model(seed=0):
    torch.manual_seed(seed)
    args = LlamaArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, max_seq_len=32,
                     init_std=0.1)
    return Llama(args)


def _adapted(targets=ALL, rank=8, alpha=16.0):
    model = _model()
    apply_lora(model, rank, alpha, targets, PLAN.lora_targets)
    with torch.no_grad():  # B starts at zero; give it values so the adapters change the output
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05)
    return model


def test_the_adapted_model_starts_as_the_model_and_only_adapters_train():
    base, model = _model(), _model()
    adapted = apply_lora(model, 8, 16.0, ALL, PLAN.lora_targets)
    assert len(adapted) == 2 * 7
    tokens = torch.randint(0, 97, (2, 16))
    assert torch.equal(base(tokens), model(tokens))  # B = 0: exactly the model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    # r·(in + out) per adapted layer: q, o 64→64; k, v 64→32; gate, up 64→128; down 128→64
    per_layer = 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert count_trainable(model) == (2 * per_layer, sum(p.numel() for p in base.parameters()) + 2 * per_layer)

    class Optim:
        lr, beta1, beta2, eps, weight_decay = 1e-2, 0.9, 0.95, 1e-8, 0.1

    optimizer = build_optimizer(model, Optim)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state_of = {id(p) for p in optimizer.state}
    assert state_of == {id(p) for n, p in model.named_parameters() if n in trainable}  # none for the base
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert not torch.equal(base(tokens), model(tokens))  # the adapters did learn something


@pytest.mark.parametrize("targets", [ALL, ["q", "v"]])
def test_the_merged_model_computes_what_the_adapted_one_does(targets):
    model = _adapted(targets)
    tokens = torch.randint(0, 97, (2, 16))
    merged = _model(seed=1)  # other weights, all replaced by the merge
    merged.load_state_dict(merged_state(model.state_dict(), 16.0 / 8))
    with torch.no_grad():
        want, got = model(tokens), merged(tokens)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert set(adapter_state(model.state_dict())) == {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def exported(tmp_path, small_corpus):
    """An adapted model, its base exported to Hugging Face's format and its adapters as peft's."""
    from ultratron.checkpoint.hf import export_hf, export_peft
    from ultratron.config.training import LoraConfig
    from ultratron.data.tokenizer import train_tokenizer

    model = _adapted()
    tokenizer = train_tokenizer([p.read_text() for p in sorted(small_corpus.glob("*.py"))[:3]], 300)
    export_hf(_model(), tokenizer, tmp_path / "hf")
    export_peft(model, LoraConfig(rank=8, alpha=16.0, targets=ALL), tmp_path / "peft", base=str(tmp_path / "hf"))
    return model, tmp_path / "hf", tmp_path / "peft"


def test_the_peft_adapter_on_the_hf_export_gives_the_adapted_models_logits(exported):
    """Each adapter tensor names a layer of the transformers model and is in its layout: that
    layer's weight plus (alpha / r) · B A, for every adapter, computes our adapted model's logits."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    model, hf_dir, peft_dir = exported
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["peft_type"] == "LORA"
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    adapters = load_file(str(peft_dir / "adapter_model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for key, a in adapters.items():
            if ".lora_A." not in key:
                continue
            layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapters[key.replace("lora_A", "lora_B")]
            modules[layer].weight += 16.0 / 8 * (b @ a)
        assert len(adapters) == 2 * 2 * 7
        tokens = torch.randint(0, 97, (2, 16))
        want = model(tokens)
        got = hf(tokens).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_peft_loads_the_adapter_onto_the_transformers_model(exported):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")  # in the test extra; skipped where it is not installed
    model, hf_dir, peft_dir = exported
    tokens = torch.randint(0, 97, (2, 16))
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        want = model(tokens)
        got = peft.PeftModel.from_pretrained(fresh, str(peft_dir)).eval()(tokens).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_a_lora_run_resumes_exactly_from_its_adapter_checkpoint(tiny_overrides, tmp_path):
    """The checkpoint holds the adapters and their optimizer state; resuming reads the frozen
    model from model.init_from again and continues as if never stopped."""
    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    base = tiny_overrides[:-1] + [str(tmp_path / "base")]  # (the last flag is --run.dir's value)
    train(load_config(None, base + ["--training.steps", "2"]), echo=False)
    lora = tiny_overrides[:-2] + ["--model.init_from", str(tmp_path / "base"), "--lora.rank", "4",
                                  "--training.steps", "6", "--optim.lr", "1e-2", "--optim.warmup_steps", "1",
                                  "--eval.interval", "0", "--checkpoint.async_save", "false"]
    train(load_config(None, lora + ["--run.dir", str(tmp_path / "whole")]), echo=False)
    split = lora + ["--run.dir", str(tmp_path / "split")]
    train(load_config(None, split + ["--training.stop_after", "3"]), echo=False)
    train(load_config(None, split + ["--checkpoint.resume", "auto"]), echo=False)
    whole = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "whole") if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "split") if "loss" in r}
    assert sorted(resumed) == list(range(1, 7))
    assert all(replayed(resumed[s], whole[s]) for s in range(4, 7)), (whole, resumed)
    assert whole[6] < whole[1]


def test_tensor_parallel_splits_each_adapter_as_its_layer():
    """Under tp2 with sequence parallel (one process in a fake group of two: shapes and placements,
    no data): column-parallel layers (q, k, v, gate, up) split B along their output features and keep
    A whole, row-parallel ones (o, down) split A along their input features and keep B whole; the
    frozen model stays frozen (sequence parallel's norms too). That the numbers are one process's is
    tests/distributed/test_dist_chat_lora.py's part."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ultratron.parallel.dims import ParallelDims
    from ultratron.parallel.tensor import apply_tensor_parallel
    from ultratron.planning.lora import adapter_params_per_layer

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        dims = ParallelDims(tp=2, sp=True, world_size=2)
        dims.mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model, _ = apply_tensor_parallel(_adapted(), dims, PLAN)
        layers = dict(model.named_modules())
        for target, layer in PLAN.lora_targets.items():
            module = layers[f"layers.0.{layer}"]
            a, b = module.lora_a, module.lora_b
            out, inp = module.weight.shape
            if target in ("o", "down"):
                assert (a.placements, b.placements) == ((Shard(1),), (Replicate(),)), target
                assert (a.to_local().shape, b.to_local().shape) == ((8, inp // 2), (out, 8)), target
            else:
                assert (a.placements, b.placements) == ((Replicate(),), (Shard(0),)), target
                assert (a.to_local().shape, b.to_local().shape) == ((8, inp), (out // 2, 8)), target
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert set(trainable) == {n for n in dict(model.named_parameters()) if n.endswith((".lora_a", ".lora_b"))}
        assert len(trainable) == 2 * 2 * 7
        # what the planner counts on a tp rank is what this rank holds
        held = sum(p.to_local().numel() for p in trainable.values())
        assert held == 2 * adapter_params_per_layer(model.args, 8, ALL, tp=2)
    finally:
        dist.destroy_process_group()
