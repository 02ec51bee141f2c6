"""`model.init_from` gives the run its model: with no model fields set, `ultratron train
--model.init_from RUN` takes the shape and the options of the model saved there (its config.toml),
not the default preset; a shape the user sets that is not the weights' is refused with both shapes
named (config/init_from.py)."""

import shutil
import tomllib

import pytest

from ultratron.cli import main
from ultratron.config import load_config, to_toml
from ultratron.errors import ConfigError

pytest.importorskip("transformers")
from test_hf_import import _hf_model  # noqa: E402  (a small random transformers model, no network)

# The imported model: a Qwen2 (q/k/v biases) far from the default preset (tiny: 4 layers of width
# 256, 8 heads, vocabulary 4096), with a RoPE base and norm epsilon of its own.
THEIRS = {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "vocab_size": 320,
          "tie_embeddings": True, "head_dim": 16, "qkv_bias": True, "rope_theta": 50_000.0, "norm_eps": 1e-6,
          "max_seq_len": 128}
SHORT = ["--training.seq_len", "64"]  # within its max_seq_len of 128
ITS_SHAPE = ("n_layers 2, dim 64, n_heads 4, n_kv_heads 2, head_dim 16, ffn_dim 96, vocab_size 320, "
             "tie_embeddings true, qkv_bias true")


@pytest.fixture(scope="module")
def imported(small_corpus, tmp_path_factory):
    """`ultratron import hf` of the model above: a run directory (config.toml, checkpoints/step-0000000)."""
    from ultratron.checkpoint.hf_import import import_hf

    root = tmp_path_factory.mktemp("init-from")
    _hf_model(root / "hf", small_corpus, family="qwen2", rope_theta=50_000.0)
    import_hf(root / "hf", root / "imported")
    return root / "imported"


def _model(cfg) -> dict:
    return {name: getattr(cfg.model, name) for name in THEIRS}


def test_train_from_an_import_alone_takes_its_shape(imported, small_corpus, tmp_path, capsys):
    """(a) No --config, no model field: the run trains the import's model and records its shape."""
    run = tmp_path / "run"
    code = main(["train", "--model.init_from", str(imported), "--training.steps", "2", "--run.dir", str(run),
                 "--data.path", str(small_corpus), "--data.extensions", ".py", *SHORT,
                 "--training.micro_batch_size", "2", "--training.batch_tokens", "128", "--training.progress",
                 "false", "--training.sample_tokens", "0", "--run.tensorboard", "false", "--eval.interval", "0"])
    assert code == 0, capsys.readouterr().err
    assert "trained to step 2" in capsys.readouterr().out
    for saved in (run / "config.toml", run / "checkpoints" / "latest"):
        path = saved if saved.suffix else run / "checkpoints" / saved.read_text().strip() / "config.toml"
        model = tomllib.loads(path.read_text())["model"]
        assert {k: model[k] for k in THEIRS} == THEIRS
        assert "preset" not in model  # none: the shape is the weights', field by field
        assert model["init_from"] == str(imported)
    # the same resolved model for every command that loads the config: here --show-config
    assert main(["train", "--model.init_from", str(imported), *SHORT, "--show-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["model"]["dim"] == 64


def test_a_conflicting_shape_names_both(imported, tmp_path, capsys):
    """(b) A shape field set to another value than the weights' is one line naming both shapes."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.init_from", str(imported), "--model.dim", "128", *SHORT])
    assert err.value.problems[0] == (
        f"model.dim=128 (--model.dim) but model.init_from {imported} holds a model with dim 64: its shape is "
        f"{ITS_SHAPE}, yours {ITS_SHAPE.replace('dim 64', 'dim 128')}; drop --model.dim to take its shape, "
        "or pick weights of yours")
    # through the CLI: exit 2 and that line, no traceback
    assert main(["train", "--model.init_from", str(imported), "--model.dim", "128", *SHORT]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: model.dim=128 (--model.dim) but model.init_from") and "Traceback" not in stderr
    # set in a --config file: the file is named
    config = tmp_path / "mine.toml"
    config.write_text("[model]\nn_layers = 3\nn_kv_heads = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(config, ["--model.init_from", str(imported), *SHORT])
    assert err.value.problems[0].startswith(f"model.n_layers=3 ({config}) but model.init_from {imported} holds a "
                                            "model with n_layers 2: its shape is n_layers 2, dim 64,")
    assert f"drop model.n_layers in {config} to take its shape" in err.value.problems[0]
    # an explicit preset of another shape
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.init_from", str(imported), "--model.preset", "tiny", *SHORT])
    assert err.value.problems[0] == (
        "model.preset=tiny (--model.preset) gives n_layers 4, dim 256, n_heads 8, n_kv_heads 4, head_dim 32, "
        f"ffn_dim 768, vocab_size 4096 but model.init_from {imported} holds a model with n_layers 2, dim 64, "
        f"n_heads 4, n_kv_heads 2, head_dim 16, ffn_dim 96, vocab_size 320: its shape is {ITS_SHAPE}, yours "
        "n_layers 4, dim 256, n_heads 8, n_kv_heads 4, head_dim 32, ffn_dim 768, vocab_size 4096, "
        "tie_embeddings true, qkv_bias true; drop model.preset to take its shape, or pick weights of yours")
    # and under LoRA, whose frozen model is model.init_from
    with pytest.raises(ConfigError, match=r"^model.qkv_bias=false \(--model.qkv_bias\) but model.init_from"):
        load_config(None, ["--model.init_from", str(imported), "--lora.rank", "4", "--model.qkv_bias", "false",
                           *SHORT])


def test_equal_shapes_and_the_users_options_are_accepted(imported):
    """(c) Shape fields set to the weights' values (head_dim 0 is dim / n_heads) pass; the model's
    options (RoPE, context length) set by the user win over the weights'."""
    cfg = load_config(None, ["--model.init_from", str(imported), "--model.dim", "64", "--model.n_heads", "4",
                             "--model.head_dim", "0", "--model.qkv_bias", "true", "--model.rope_theta", "1e6",
                             "--model.max_seq_len", "512", *SHORT])
    assert _model(cfg) == THEIRS | {"head_dim": 0, "rope_theta": 1e6, "max_seq_len": 512}
    assert cfg.model.preset is None
    # the import's own config.toml (its preset named, every field set) with its init_from; LoRA on it
    assert _model(load_config(imported / "config.toml", SHORT)) == THEIRS
    assert _model(load_config(None, ["--model.init_from", str(imported), "--lora.rank", "4", *SHORT])) == THEIRS


def test_the_checkpoint_is_the_one_the_checkpoint_layer_finds(imported, tmp_path):
    """init_from's config.toml is read from the checkpoint `resolve_checkpoint_dir` names, for each
    form of the path; an unreadable one is one clear line."""
    from ultratron.checkpoint.store import resolve_checkpoint_dir
    from ultratron.config.init_from import saved_checkpoint

    step = imported / "checkpoints" / "step-0000000"
    for path in (imported, imported / "checkpoints", imported / "checkpoints" / "latest", step):
        assert saved_checkpoint(path) == resolve_checkpoint_dir(path) == step
    with pytest.raises(ConfigError, match=r"^model.init_from: checkpoint '.*nowhere' does not exist$"):
        load_config(None, ["--model.init_from", str(tmp_path / "nowhere")])
    bare = tmp_path / "bare"
    shutil.copytree(step, bare)
    (bare / "config.toml").unlink()
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--model.init_from", str(bare), *SHORT])
    assert err.value.problems == [f"model.init_from {bare}: {bare / 'config.toml'} does not exist, so the shape of "
                                  "its model is unknown"]
    # a saved config sets every model field: it loads without its init_from (a run copied elsewhere)
    saved = tmp_path / "saved.toml"
    saved.write_text(to_toml(load_config(imported / "config.toml", SHORT)).replace(str(imported), str(bare)))
    assert _model(load_config(saved)) == THEIRS
