"""Data mixtures: per-source shares that follow the weights (and a schedule), ranks that split one
stream, exact resume, repeat-or-stop, and config errors before anything starts."""

import numpy as np
import pytest
import torch

from tolerances import replayed
from ultratron.data.mixture import MixtureLoader
from ultratron.data.mixture_spec import parse_mixture
from ultratron.data.shards import ShardSet, write_shards
from ultratron.errors import ConfigError, DataError

SEQ, MBS = 64, 8
BANDS = {"web": (1, 100), "code": (100, 200), "math": (200, 300)}  # each source's own token values


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    """Three sources of different sizes whose tokens never overlap, so a batch tells which source
    each token came from."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    out = {}
    for (name, (lo, hi)), n_tokens in zip(BANDS.items(), (300_000, 120_000, 40_000), strict=True):
        docs = [rng.integers(lo, hi, size=999).tolist() for _ in range(n_tokens // 1000)]
        write_shards(docs, root / name, vocab_size=300, eos_id=lo, tokenizer_sha256="t", tokens_per_shard=50_000)
        out[name] = ShardSet.open(root / name)
    return out


def _loader(shard_sets, weights, schedule=(), **kw):
    spec, problems = parse_mixture([f"{n}=/{n}" for n in BANDS], weights, list(schedule))
    assert not problems
    return MixtureLoader(spec, [shard_sets[n] for n in BANDS], seq_len=SEQ, micro_batch_size=MBS, **kw)


def _source_counts(inputs: torch.Tensor) -> dict[str, int]:
    return {name: int(((inputs >= lo) & (inputs < hi)).sum()) for name, (lo, hi) in BANDS.items()}


def test_shares_over_a_million_tokens_match_the_weights(shard_sets):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    loader = _loader(shard_sets, weights)
    seen = dict.fromkeys(BANDS, 0)
    batches = 1_000_000 // (SEQ * MBS) + 1
    for _ in range(batches):
        for name, n in _source_counts(loader.next_batch()[0]).items():
            seen[name] += n
    total = sum(seen.values())
    assert total == batches * SEQ * MBS >= 1_000_000
    metrics = loader.metrics()
    for name, w in weights.items():
        share = seen[name] / total  # counted from the tokens themselves, not the loader's counters
        print(f"{name}: weight {w:.3f}, share {share:.5f}")
        assert abs(share - w) < 0.01 * w
        assert metrics[f"tokens/{name}"] == seen[name]
    # math (40k tokens) was used up many times over and repeated; web (300k) only a few times
    assert metrics["repeats/math"] >= 4 and metrics["repeats/web"] >= 1


def test_a_schedule_moves_the_shares_over_tokens(shard_sets):
    # web only until 200k tokens, then linearly to math only at 400k, then math only
    loader = _loader(shard_sets, {"web": 1, "code": 0, "math": 0},
                     ["200000 web=1 code=0 math=0", "400000 web=0 code=0 math=1"])
    phases = []
    for _ in range(3):
        seen = dict.fromkeys(BANDS, 0)
        for _ in range(200_000 // (SEQ * MBS) - 1):
            for name, n in _source_counts(loader.next_batch()[0]).items():
                seen[name] += n
        phases.append({k: v / sum(seen.values()) for k, v in seen.items()})
        while loader.taken * SEQ % 200_000 >= SEQ * MBS:  # align with the next phase boundary
            loader.next_batch()
    assert phases[0]["web"] == 1.0
    assert abs(phases[1]["web"] - 0.5) < 0.01 and abs(phases[1]["math"] - 0.5) < 0.01 and phases[1]["code"] == 0
    assert phases[2]["math"] > 0.99


def test_ranks_split_the_one_rank_stream(shard_sets):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    one = MixtureLoader(*_spec_and_sets(shard_sets, weights), seq_len=SEQ, micro_batch_size=2 * MBS, seed=5)
    ranks = [MixtureLoader(*_spec_and_sets(shard_sets, weights), seq_len=SEQ, micro_batch_size=MBS, dp_rank=r,
                           dp_world=2, seed=5) for r in (0, 1)]
    for _ in range(300):
        whole = one.next_batch()[0]
        parts = [r.next_batch()[0] for r in ranks]
        assert torch.equal(torch.cat(parts), whole)
    assert ranks[0].metrics() == ranks[1].metrics() == one.metrics()  # global counts on every rank


def _spec_and_sets(shard_sets, weights):
    spec, _ = parse_mixture([f"{n}=/{n}" for n in BANDS], weights, [])
    return spec, [shard_sets[n] for n in BANDS]


def test_resume_mid_run_continues_the_same_stream(shard_sets):
    weights = {"web": 0.2, "code": 0.3, "math": 0.5}
    schedule = ["50000 web=0.2 code=0.3 math=0.5", "150000 web=0.6 code=0.3 math=0.1"]
    straight = _loader(shard_sets, weights, schedule, seed=1)
    for _ in range(150):
        straight.next_batch()
    state = straight.state_dict()
    resumed = _loader(shard_sets, weights, schedule, seed=1)
    resumed.load_state_dict(state)
    assert resumed.metrics() == straight.metrics()
    for _ in range(150):  # crosses the schedule and math's repeats
        assert torch.equal(straight.next_batch()[0], resumed.next_batch()[0])
    assert resumed.metrics() == straight.metrics() and straight.metrics()["repeats/math"] >= 1
    other = _loader(shard_sets, weights, schedule, seed=2)
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(state)


def test_a_used_up_source_stops_the_run_when_told(shard_sets):
    loader = _loader(shard_sets, {"web": 0.5, "code": 0.0, "math": 0.5}, exhausted="stop")
    with pytest.raises(DataError, match="'math' is used up.*data.exhausted=stop"):
        for _ in range(1000):
            loader.next_batch()
    assert loader.metrics()["tokens/math"] == loader.sources[2].n_sequences * SEQ  # every sequence, once


def test_mixture_config_problems_are_error_lines(tmp_path):
    from conftest import TINY, run_cli
    from ultratron.config import load_config

    bad = ["--data.sources", "web=a,code=b,web=c", "--data.weights", "web=1"]
    with pytest.raises(ConfigError, match="'web' is used twice"):
        load_config(None, TINY + bad)
    cases = {
        ("--data.sources", "web=a,code=b", "--data.weights", "web=1,cod=2"): ["no weight for source 'code'",
                                                                              "'cod' is not one of the sources"],
        ("--data.sources", "web=a", "--data.schedule", "10k web=1"): ["'10k' is not a token count"],
        ("--data.sources", "web=a,code=b", "--data.schedule", "100 web=1 code=0,50 web=0 code=1"):
            ["must increase"],
        ("--data.weights", "web=1",): ["need data.sources"],
        ("--data.sources", "web=a", "--data.path", "x"): ["exclude each other"],
    }
    for flags, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, TINY + list(flags))
        for text in expected:
            assert any(text in p for p in err.value.problems), (flags, err.value.problems)
    result = run_cli("train", "--data.sources", "web=a,code=b", "--data.weights", "web=-1,code=1")
    assert result.returncode == 2 and result.stderr.strip() == \
        "error: data.weights: the weight of 'web' must be ≥ 0, got -1.0"


@pytest.fixture(scope="module")
def prepared_sources(small_corpus, tmp_path_factory):
    """Two prepared directories from the small corpus's files, sharing one tokenizer, and a third
    with a tokenizer of its own."""
    import shutil

    from ultratron.config.training import DataConfig
    from ultratron.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("sources")
    files = sorted(small_corpus.glob("*.py"))
    for name, part in (("a", files[::2]), ("b", files[1::2])):
        (root / f"text-{name}").mkdir()
        for f in part:
            shutil.copy(f, root / f"text-{name}" / f.name)
    quiet = lambda message: None
    cfg = lambda name, **kw: DataConfig(path=str(root / f"text-{name}"), extensions=".py", held_out_fraction=0.15,
                                        **kw)
    prepare_data(cfg("a"), 512, root / "a", log=quiet)
    prepare_data(cfg("b", tokenizer=str(root / "a" / "tokenizer.json")), 512, root / "b", log=quiet)
    prepare_data(cfg("b"), 400, root / "other", log=quiet)
    return root


def test_training_on_a_mixture_resumes_exactly(prepared_sources, tmp_path):
    from conftest import TINY
    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    root = prepared_sources
    common = TINY + ["--data.sources", f"a={root / 'a'},b={root / 'b'}", "--data.weights", "a=0.7,b=0.3",
                     "--data.schedule", "1024 a=0.7 b=0.3,3072 a=0.2 b=0.8", "--training.steps", "8",
                     "--eval.interval", "4"]
    train(load_config(None, common + ["--run.dir", str(tmp_path / "full")]), echo=False)
    split = ["--run.dir", str(tmp_path / "split")]
    train(load_config(None, common + split + ["--training.stop_after", "4"]), echo=False)
    train(load_config(None, common + split + ["--checkpoint.resume", "auto"]), echo=False)
    full = {r["step"]: r for r in read_metrics(tmp_path / "full") if "loss" in r}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "split") if "loss" in r}
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert replayed(resumed[step]["loss"], full[step]["loss"]), step
        assert (full[step]["tokens/a"], full[step]["tokens/b"]) == (resumed[step]["tokens/a"],
                                                                    resumed[step]["tokens/b"])
    last = full[8]
    assert last["tokens/a"] + last["tokens/b"] == 8 * 512
    assert 0.4 < last["tokens/b"] / (8 * 512) < 0.6  # 0.3 for the first 1024 tokens, then rising to 0.8
    assert "val_loss" in full[4] and "val_loss" in full[8]


def test_sources_with_different_tokenizers_are_refused(prepared_sources, tmp_path):
    from conftest import TINY
    from ultratron.config import load_config
    from ultratron.training.trainer import train

    root = prepared_sources
    cfg = load_config(None, TINY + ["--data.sources", f"a={root / 'a'},o={root / 'other'}",
                                    "--run.dir", str(tmp_path / "r"), "--training.steps", "1"])
    with pytest.raises(DataError, match="must share one tokenizer.*a \\(tokenizer .*o \\(tokenizer"):
        train(cfg, echo=False)


def test_a_batch_ramp_over_a_mixture_resumes_exactly(prepared_sources, tmp_path):
    from conftest import TINY
    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    root = prepared_sources
    common = TINY + ["--data.sources", f"a={root / 'a'},b={root / 'b'}", "--data.weights", "a=0.7,b=0.3",
                     "--training.batch_tokens", "1024", "--training.batch_ramp", "start=256,tokens=2048",
                     "--training.steps", "3", "--eval.interval", "0"]
    train(load_config(None, common + ["--run.dir", str(tmp_path / "full")]), echo=False)
    split = common + ["--run.dir", str(tmp_path / "split")]
    train(load_config(None, split + ["--training.stop_after", "3"]), echo=False)
    train(load_config(None, split + ["--checkpoint.resume", "auto"]), echo=False)
    full = {r["step"]: r for r in read_metrics(tmp_path / "full") if "loss" in r}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "split") if "loss" in r}
    assert sorted(resumed) == sorted(full) and len(full) > 4
    assert [full[s]["batch_tokens"] for s in sorted(full)] == [256, 256, 256, 512, 512, 768, 1024]
    for step in range(4, len(full) + 1):
        assert replayed(resumed[step]["loss"], full[step]["loss"]), step
        assert full[step]["tokens/a"] + full[step]["tokens/b"] == full[step]["tokens"] == resumed[step]["tokens"]


def test_validation_loss_is_logged_per_source(prepared_sources, tmp_path):
    """Each source's validation loss is that source's held-out split alone: at step 0 (the same
    initial weights) exactly what a run on that source alone reports, besides the mixture's own."""
    from conftest import TINY
    from ultratron.config import load_config
    from ultratron.training.metrics import read_metrics
    from ultratron.training.trainer import train

    root = prepared_sources
    both = TINY + ["--training.steps", "2", "--eval.interval", "2", "--eval.batches", "2"]
    train(load_config(None, both + ["--data.sources", f"a={root / 'a'},b={root / 'b'}", "--run.dir",
                                    str(tmp_path / "mix")]), echo=False)
    records = {r["step"]: r for r in read_metrics(tmp_path / "mix") if "val_loss" in r}
    assert sorted(records) == [0, 2] and {"val_loss/a", "val_loss/b"} <= set(records[2])
    for name in ("a", "b"):
        train(load_config(None, both + ["--data.path", str(root / name), "--run.dir", str(tmp_path / name),
                                        "--training.steps", "1", "--eval.interval", "1"]), echo=False)
        alone = next(r for r in read_metrics(tmp_path / name) if "val_loss" in r)
        assert alone["step"] == 0 and replayed(records[0][f"val_loss/{name}"], alone["val_loss"])
    assert records[0]["val_loss/a"] != records[0]["val_loss/b"]
