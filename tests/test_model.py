import pytest
import torch

from ultratron.config import load_config
from ultratron.models.presets import PRESETS
from ultratron.models.registry import build_model
from ultratron.planning.params import count_params_of


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameter_formula_equals_the_model(preset):
    cfg = load_config(None, ["--model.preset", preset, "--training.seq_len", "64"])
    model = build_model(cfg.model, "meta")
    assert sum(p.numel() for p in model.parameters()) == count_params_of(cfg.model).total


@pytest.mark.parametrize("extra", [["--model.qk_norm", "true"], ["--model.tie_embeddings", "false"]])
def test_parameter_formula_with_options(extra):
    cfg = load_config(None, ["--model.preset", "tiny", *extra])
    model = build_model(cfg.model, "meta")
    assert sum(p.numel() for p in model.parameters()) == count_params_of(cfg.model).total


def test_published_llama3_sizes():
    # Meta's model cards: 8.03B, 70.6B, 405.9B parameters.
    sizes = {name: count_params_of(load_config(None, ["--model.preset", name, "--training.seq_len", "64"]).model).total
             for name in ("llama3-8b", "llama3-70b", "llama3-405b")}
    assert sizes["llama3-8b"] == 8_030_261_248
    assert round(sizes["llama3-70b"] / 1e9, 1) == 70.6
    assert round(sizes["llama3-405b"] / 1e9, 1) == 405.9


def small_model(*extra):
    cfg = load_config(None, ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
                             "--model.n_kv_heads", "2", "--model.ffn_dim", "96", "--model.vocab_size", "100",
                             "--training.seq_len", "32", *extra])
    torch.manual_seed(0)
    return build_model(cfg.model)


@pytest.mark.parametrize("extra", [[], ["--model.qk_norm", "true"], ["--model.attn_softcap", "20"]])
def test_attention_is_causal(extra):
    model = small_model(*extra)
    tokens = torch.randint(0, 100, (2, 24))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 100
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


def test_softcapped_attention_path_matches_sdpa_when_cap_is_huge():
    plain = small_model()
    capped = small_model("--model.attn_softcap", "1e6")
    tokens = torch.randint(0, 100, (2, 24))
    assert torch.allclose(plain(tokens), capped(tokens), atol=1e-5)


def test_final_logit_softcap_bounds_the_logits():
    model = small_model("--model.final_softcap", "2.0")
    with torch.no_grad():
        model.output.weight.mul_(1000)
    logits = model(torch.randint(0, 100, (1, 16)))
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9


def test_tied_embeddings_share_one_tensor():
    model = small_model()
    assert model.output.weight is model.tok_embeddings.weight


def test_residual_projections_get_the_scaled_init():
    model = build_model(load_config(None, ["--model.preset", "tiny"]).model)
    wo = model.layers["0"].attention.wo.weight.std().item()
    wq = model.layers["0"].attention.wq.weight.std().item()
    assert wq == pytest.approx(0.02, rel=0.05)
    assert wo == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.05)


def test_the_registry_reads_a_model_through_its_wrappers(tmp_path):
    """Other code asks `models.registry`: the family, its args and plan, through DDP and torch.compile."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ultratron.models.llama.parallel_plan import PLAN
    from ultratron.models.registry import family_of, model_args, plan_of
    from ultratron.models.specs import spec_of

    model = small_model("--model.max_seq_len", "48")
    cfg = load_config(None, ["--model.preset", "moe-tiny"]).model
    assert cfg.family == "llama" and family_of(model).name == "llama" and family_of(model).spec is spec_of(cfg)
    assert model_args(torch.compile(model)) is model.args and model_args(model).max_seq_len == 48
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        assert model_args(ddp) is model.args and plan_of(ddp) is PLAN
    finally:
        dist.destroy_process_group()

    class Stand:  # a sampling stand-in, no module (the pipeline's), carries its model's args
        args = model.args

    assert model_args(Stand()) is model.args
    with pytest.raises(TypeError, match="no model of a family"):
        model_args(torch.nn.Linear(2, 2))


def test_plain_names_drop_every_wrappers_prefix():
    """The checkpoint wrapper's prefix ends with DDP's ("module."): dropping DDP's first left
    `_checkpoint_wrapped_` in the name, and recomputed blocks were initialized under other names."""
    from ultratron.models.registry import plain_name

    assert plain_name("module._orig_mod.layers.0._checkpoint_wrapped_module.attention.wq.weight") == \
        "layers.0.attention.wq.weight"
