"""training.batch_ramp: the batch grows in whole micro-batches; tokens seen, the LR and a resume follow it."""

import pytest

from tolerances import replayed
from ultratron.config import load_config
from ultratron.errors import ConfigError
from ultratron.training.batch_ramp import BatchSchedule
from ultratron.training.metrics import read_metrics
from ultratron.training.optim import lr_at
from ultratron.training.trainer import Trainer, train

UNIT = 4 * 64  # TINY: micro_batch_size × seq_len
RAMP = ["--training.batch_tokens", str(8 * UNIT), "--training.batch_ramp", f"start={UNIT},tokens={16 * UNIT}",
        "--training.steps", "4", "--eval.interval", "0", "--optim.warmup_steps", "2"]


def walk(schedule: BatchSchedule, end: int) -> list[int]:
    seen, sizes = 0, []
    while seen < end:
        sizes.append(schedule.tokens_at(seen))
        seen += sizes[-1]
    return sizes


@pytest.mark.parametrize("grow_by", [1, 3])
def test_the_ramp_grows_linearly_in_whole_units_to_the_full_batch(grow_by):
    unit, full, start, over = 512, 60 * 512, 3 * 512, 400_000
    schedule = BatchSchedule(full=full, unit=unit, grow_by=grow_by, start=start, ramp_tokens=over)
    sizes = walk(schedule, 2 * over)
    assert sizes[0] == start and sizes[-1] == full and sizes == sorted(sizes)
    assert len(set(sizes)) > 10  # it grew in many steps, not at once
    seen = 0
    for size in sizes:
        assert size % unit == 0 and (size - start) % (unit * grow_by) == 0 or size == full
        if seen < over:  # linear in tokens seen, rounded down to a whole growth step
            target = start + (full - start) * seen / over
            assert target - unit * grow_by < size <= target + 1e-9
        else:
            assert size == full
        seen += size
    for begin in (0, sizes[0], sum(sizes[:7]), sum(sizes[:30])):
        assert schedule.steps_to(begin, 2 * over) == len(walk_from(schedule, begin, 2 * over))


def walk_from(schedule, seen, end):
    sizes = []
    while seen < end:
        sizes.append(schedule.tokens_at(seen))
        seen += sizes[-1]
    return sizes


def test_tokens_seen_and_the_lr_follow_the_schedule(tiny_overrides):
    cfg = load_config(None, tiny_overrides + RAMP)
    result = train(cfg, echo=False)
    schedule = BatchSchedule.from_config(cfg)
    sizes = walk(schedule, 4 * 8 * UNIT)
    assert [s // UNIT for s in sizes] == [1, 1, 1, 2, 3, 4, 6, 8, 8]  # 256 + 1792 × seen / 4096, whole
    records = [r for r in read_metrics(cfg.run.dir) if "loss" in r]
    assert result.steps_done == len(records) == len(sizes) > 4  # more optimizer steps than training.steps
    seen = 0
    for record, size in zip(records, sizes, strict=True):
        assert record["batch_tokens"] == size
        assert record["lr"] == pytest.approx(lr_at(seen / (8 * UNIT), 4, cfg.optim), rel=1e-12)
        seen += size
        assert record["tokens"] == seen
    assert seen >= 4 * 8 * UNIT > seen - 8 * UNIT


def test_the_lr_at_equal_tokens_is_the_same_with_and_without_the_ramp(tiny_overrides, tmp_path):
    fixed = load_config(None, tiny_overrides + RAMP[:2] + RAMP[4:] + ["--run.dir", str(tmp_path / "fixed")])
    train(fixed, echo=False)
    ramped = load_config(None, tiny_overrides + RAMP + ["--run.dir", str(tmp_path / "ramped")])
    train(ramped, echo=False)
    lr_before = lambda cfg: {r["tokens"] - r.get("batch_tokens", 8 * UNIT): r["lr"]
                             for r in read_metrics(cfg.run.dir) if "loss" in r}
    without, with_ramp = lr_before(fixed), lr_before(ramped)
    shared = set(without) & set(with_ramp)
    assert len(shared) >= 2 and all(without[t] == with_ramp[t] for t in shared)


def test_resume_mid_ramp_is_exact(tiny_overrides, tmp_path):
    common = tiny_overrides + RAMP + ["--data.cache_dir", str(tmp_path / "data")]
    train(load_config(None, common + ["--run.dir", str(tmp_path / "full")]), echo=False)
    split = common + ["--run.dir", str(tmp_path / "split")]
    train(load_config(None, split + ["--training.stop_after", "3"]), echo=False)  # mid-ramp: next come 2 micro-batches
    train(load_config(None, split + ["--checkpoint.resume", "auto"]), echo=False)
    full = {r["step"]: r for r in read_metrics(tmp_path / "full") if "loss" in r}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "split") if "loss" in r}
    assert sorted(resumed) == sorted(full) and len(full) > 5
    for step in range(4, len(full) + 1):
        assert resumed[step]["tokens"] == full[step]["tokens"] and resumed[step]["lr"] == full[step]["lr"]
        assert replayed(resumed[step]["loss"], full[step]["loss"]), step
    assert full[len(full)]["loss"] < full[1]["loss"]


PP = ["--training.batch_tokens", "4096", "--parallel.pp", "2", "--model.n_layers", "4"]


@pytest.mark.parametrize("flags, message", [
    (["--training.batch_ramp", "start=300,tokens=1e6"], "must be a positive multiple of micro_batch_size × "
                                                        "seq_len × dp = 4 × 64 × 1 = 256 (whole micro-batches); "
                                                        "try 256 or 512"),
    (["--training.batch_ramp", "start=512,tokens=1e6"], "must be below training.batch_tokens=512"),
    (["--training.batch_ramp", "begin=256,tokens=1e6"], "takes start and tokens"),
    (["--training.batch_ramp", "start=256,tokens=0"], "tokens must be a positive whole number"),
    (["--training.batch_ramp", "start=768,tokens=1e6", *PP], "multiple of micro_batch_size × seq_len × dp × pp = "
                                                             "4 × 64 × 1 × 2 = 512 (whole micro-batches, pp of them "
                                                             "at a time); try 512 or 1024"),
    (["--training.batch_ramp", "start=512,tokens=1e6", *PP, "--parallel.pp_schedule", "dualpipev"],
     "2 micro-batches per step (the first step of training.batch_ramp) are fewer than the 4 stages"),
])
def test_ramps_that_cannot_keep_micro_batches_whole_are_refused(tiny_overrides, flags, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, tiny_overrides + flags)
    assert any(message in line for line in str(err.value).splitlines()), str(err.value)


def test_a_pipeline_ramp_of_whole_rounds_is_accepted(tiny_overrides):
    cfg = load_config(None, tiny_overrides + PP + ["--training.batch_ramp", "start=512,tokens=1e6"])
    sizes = walk(BatchSchedule.from_config(cfg), 2_000_000)
    assert {s // UNIT % 2 for s in sizes} == {0} and sizes[-1] == 4096  # every step: whole rounds of pp


def test_a_mixture_of_experts_counts_each_steps_own_micro_batches(tiny_overrides):
    """Under a ramp the router statistics and the balancing loss's weight follow the step's micro-batches."""
    moe = ["--model.n_experts", "4", "--model.n_active_experts", "2", "--model.expert_ffn_dim", "64",
           "--model.moe_aux_loss", "0.01"]
    cfg = load_config(None, tiny_overrides + RAMP + moe)
    train(cfg, echo=False)
    records = [r for r in read_metrics(cfg.run.dir) if "loss" in r]
    assert len({r["batch_tokens"] for r in records}) > 2
    for record in records:  # every token of the step routed to 2 experts in every layer (dropless)
        assert [sum(layer) for layer in record["moe_load"]] == [2 * record["batch_tokens"]] * cfg.model.n_layers
        assert record["moe_aux_loss"] > 0
    early = Trainer(load_config(None, tiny_overrides + RAMP + moe + ["--training.stop_after", "2",
                                                                     "--run.dir", f"{cfg.run.dir}-early"]), echo=False)
    early.fit()  # its two steps ran one micro-batch each, not grad_accum_steps = 8
    assert {router.aux_loss_scale for router in early.routers.routers} == {1.0}
