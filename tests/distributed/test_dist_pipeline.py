"""Pipeline parallelism trains like one process on the same global batch, with every schedule and
composed with data and tensor parallel; its checkpoints reshard into other layouts.

An 8-layer model (so that pp4 × 2 virtual stages have a layer each); the reference is the same
model in one process, compared as dist_common's `assert_equivalent` does (losses, gradient norms,
validation losses at the first and last step — the pipeline's forward-only pass — and final
weights). Every run also samples at the end (fp32: the same text as one process). Three launches
(2, 4 and 8 ranks) run all the layouts in a row.
Data parallel under pp runs on FSDP2's machinery, which torch's stages drive: zero 0 as
`replicate` (DDP's arithmetic), zero 1 and 2 as FSDP2 without resharding, zero 3 with it.
"""

from __future__ import annotations

import shutil

import pytest
from dist_common import STEPS, assert_equivalent, dist_base_fixture, launch, records  # noqa: F401 (fixtures)

from tolerances import LAYOUTS, relative_gap
from ultratron.config import load_config
from ultratron.training.trainer import train

SAVE_AT = 3
# At dist_common's learning rate (3e-3) the 8-layer model's gradient norm jumps 3x by step 6 and its
# fp32 and bf16 runs part ways, where any difference is amplified; at 1e-3 both run smoothly.
EXTRA = ["--model.n_layers", "8", "--optim.lr", "1e-3", "--training.sample_tokens", "8",
         "--checkpoint.interval", str(SAVE_AT)]

PP2 = {f"pp2-{s}": ["--parallel.pp", "2", "--parallel.pp_schedule", s]
       for s in ("gpipe", "1f1b", "interleaved-1f1b", "zb", "zbv", "dualpipev")}
# the chunked loss (training.loss_chunk) on the last stage: 1F1B, and ZBV's split weight backward
CHUNKED = ["--training.loss_chunk", "50"]
RANKS_2 = {**{(name, "fp32"): args for name, args in PP2.items()},
           ("pp2-1f1b", "bf16"): PP2["pp2-1f1b"], ("pp2-zbv", "bf16"): PP2["pp2-zbv"],
           ("pp2-1f1b-loss-chunk", "fp32"): PP2["pp2-1f1b"] + CHUNKED,
           ("pp2-zbv-loss-chunk", "fp32"): PP2["pp2-zbv"] + CHUNKED,
           # and the blocks' saved tensors through host memory on each stage (training.offload_activations)
           ("pp2-1f1b-offload", "fp32"): PP2["pp2-1f1b"] + ["--training.offload_activations", "true"]}
DP2_PP2 = ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero", "1"]
RANKS_4 = {("pp4-interleaved-v2", "fp32"): ["--parallel.pp", "4", "--parallel.pp_schedule", "interleaved-1f1b",
                                            "--parallel.pp_virtual_stages", "2"],
           ("dp2xpp2-zero0-zbv", "fp32"): ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero", "0",
                                           "--parallel.pp_schedule", "zbv"],
           ("dp2xpp2-zero1", "fp32"): DP2_PP2,
           ("dp2xpp2-zero3", "fp32"): ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero", "3"],
           ("pp2xtp2-sp", "fp32"): ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.sp", "true"],
           ("pp2xtp2-sp", "bf16"): ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.sp", "true"]}
DP2_TP2_PP2 = ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true", "--parallel.pp", "2",
               "--parallel.zero", "3", "--parallel.pp_schedule", "interleaved-1f1b"]
RANKS_8 = {("dp2xtp2xpp2", "fp32"): DP2_TP2_PP2}  # (bf16 under pp: pp2 and pp2×tp2+sp above)
_RUNS: dict = {}


@pytest.fixture(scope="module")
def pp_references(dist_base, tmp_path_factory) -> dict:
    """One process, 8 layers, fp32 and bf16 (the fp32 run also leaves a checkpoint at step 3)."""
    out = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path_factory.mktemp(f"pp-ref-{precision}")
        train(load_config(None, dist_base + EXTRA + ["--training.precision", precision, "--run.dir", str(run)]),
              echo=False)
        out[precision] = run
    return out


def _runs(world: int, layouts: dict, dist_base, root, extra_runs=()) -> dict:
    dirs, runs = {}, []
    for (name, precision), args in layouts.items():
        dirs[name, precision] = root / f"{name}-{precision}"
        runs.append(dist_base + EXTRA + args + ["--training.precision", precision,
                                                "--run.dir", str(dirs[name, precision])])
    launch(world, runs + list(extra_runs))
    return dirs


@pytest.fixture(scope="module")
def two_rank_runs(dist_base, pp_references, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-two")
    # a one-process checkpoint resumed on a V schedule (both copies of the tied table on one rank)
    resume = dist_base + EXTRA + PP2["pp2-zbv"] + ["--run.dir", str(root / "from-one"), "--checkpoint.resume",
                                                   str(pp_references["fp32"] / "checkpoints" / f"step-{SAVE_AT:07d}")]
    dirs = _runs(2, RANKS_2, dist_base, root, [resume])
    dirs["from-one", "fp32"] = root / "from-one"
    return dirs


@pytest.fixture(scope="module")
def four_rank_runs(dist_base, pp_references, tmp_path_factory):
    """The layouts, then the dp2×pp2 run's step-3 checkpoint resumed under pp4 (and, after the
    launch, in one process from a copy)."""
    root = tmp_path_factory.mktemp("pp-four")
    saved = root / "dp2xpp2-zero1-fp32" / "checkpoints" / f"step-{SAVE_AT:07d}"
    resume = dist_base + EXTRA + ["--parallel.pp", "4", "--run.dir", str(root / "resumed-pp4"),
                                  "--checkpoint.resume", str(saved)]
    dirs = _runs(4, RANKS_4, dist_base, root, [resume])
    shutil.copytree(saved.parent.parent, root / "copy")
    train(load_config(None, dist_base + EXTRA + ["--run.dir", str(root / "resumed-one"), "--checkpoint.resume",
                                                 str(root / "copy" / "checkpoints" / f"step-{SAVE_AT:07d}")]),
          echo=False)
    dirs["resumed-pp4", "fp32"], dirs["resumed-one", "fp32"] = root / "resumed-pp4", root / "resumed-one"
    return dirs


@pytest.fixture(scope="module")
def eight_rank_runs(dist_base, pp_references, tmp_path_factory):
    return _runs(8, RANKS_8, dist_base, tmp_path_factory.mktemp("pp-eight"))


def _sample(run_dir) -> str:
    return (run_dir / "train.log").read_text().split("sample:\n", 1)[1]


def _assert_matches(run_dir, reference_dir, precision: str, name: str, first_step: int = 1) -> None:
    assert_equivalent(run_dir, reference_dir, precision, name, first_step)
    if precision == "fp32":
        assert _sample(run_dir) == _sample(reference_dir), name


@pytest.mark.parametrize("name,precision", list(RANKS_2) + [("from-one", "fp32")])
def test_pp2_with_each_schedule_equals_one_process(two_rank_runs, pp_references, name, precision):
    first = SAVE_AT + 1 if name == "from-one" else 1
    _assert_matches(two_rank_runs[name, precision], pp_references[precision], precision, name, first)


@pytest.mark.parametrize("name,precision", list(RANKS_4))
def test_four_rank_pipelines_equal_one_process(four_rank_runs, pp_references, name, precision):
    _assert_matches(four_rank_runs[name, precision], pp_references[precision], precision, name)


@pytest.mark.parametrize("name,precision", list(RANKS_8))
def test_dp2_tp2_pp2_on_eight_ranks_equals_one_process(eight_rank_runs, pp_references, name, precision):
    _assert_matches(eight_rank_runs[name, precision], pp_references[precision], precision, name)


@pytest.mark.parametrize("layout", ["resumed-pp4", "resumed-one"])
def test_a_dp2_pp2_checkpoint_resumes_under_pp4_and_one_process(four_rank_runs, pp_references, layout):
    saved = four_rank_runs["dp2xpp2-zero1", "fp32"]
    ckpt = saved / "checkpoints" / f"step-{SAVE_AT:07d}"
    assert (ckpt / "complete").is_file() and len(list((ckpt / "dcp").glob("*.distcp"))) == 4
    _assert_matches(four_rank_runs[layout, "fp32"], pp_references["fp32"], "fp32", layout, SAVE_AT + 1)
    kept_going = {r["step"]: r for r in records(saved)}
    for record in records(four_rank_runs[layout, "fp32"]):  # and equal to the run that kept going
        assert relative_gap(record["loss"], kept_going[record["step"]]["loss"]) <= LAYOUTS["fp32"]["loss"]


@pytest.mark.parametrize("saved_by", ["dp2xpp2-zero1", "dp2xpp2-zero0-zbv"])
def test_a_pipeline_checkpoint_loads_for_inference_in_one_process(four_rank_runs, dist_base, tmp_path, saved_by):
    """eval, serve and export read a pipeline run's checkpoint (load_for_inference): the weights the
    training path's resharding load gives one process, with the tied table tied again (saved with
    FSDP2 shards, and with `replicate`'s replicated parameters on a V schedule)."""
    import torch

    from ultratron.checkpoint.inference import load_for_inference
    from ultratron.models.registry import build_model
    from ultratron.training.trainer import Trainer

    ckpt = four_rank_runs[saved_by, "fp32"] / "checkpoints" / f"step-{SAVE_AT:07d}"
    loaded = load_for_inference(ckpt)
    assert loaded.step == SAVE_AT
    trainer = Trainer(load_config(None, dist_base + EXTRA + ["--run.dir", str(tmp_path / "r"),
                                                             "--checkpoint.resume", str(ckpt)]), echo=False)
    trainer.checkpoints.resume()
    expected, got = trainer.model.state_dict(), loaded.model.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert loaded.model.output.weight is loaded.model.tok_embeddings.weight
    fresh = build_model(loaded.config.model).state_dict()
    assert not torch.equal(fresh["layers.7.attention.wq.weight"], got["layers.7.attention.wq.weight"])
