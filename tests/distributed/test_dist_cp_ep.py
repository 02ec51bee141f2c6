"""Context and expert parallelism train like one process on the same global batch, alone and with
the other axes — pipeline stages and HSDP included (cp2×pp2, tp2×cp2×pp2, HSDP 2×2×cp2, HSDP 2×2
with ep2) —, and expert-parallel checkpoints resume under another ep and in one process.

Dense layouts compare with the session's one-process reference (dist_common); the mixture-of-experts
ones with a one-process run of the same MoE (4 experts, top-2, both balancing methods on: the aux
loss and the DeepSeek-V3 bias). fp32, compared as dist_common's `assert_equivalent` does (losses,
gradient norms, validation losses, final weights); MoE runs also route exactly as one process (the
same slots per expert at every step) and report the same balancing loss. Three launches (2, 4 and 8
ranks) run the layouts in a row.
"""

from __future__ import annotations

import shutil

import pytest
from dist_common import assert_equivalent, dist_base_fixture, launch, references_fixture, weights_gap  # noqa: F401

from tolerances import LAYOUTS
from ultratron.config import load_config
from ultratron.training.trainer import train

SAVE_AT = 3
MOE = ["--model.n_experts", "4", "--model.n_active_experts", "2", "--model.expert_ffn_dim", "64",
       "--model.moe_bias_update", "0.001", "--checkpoint.interval", str(SAVE_AT)]
CP2 = ["--parallel.cp", "2"]
RANKS_2 = {"cp2": CP2, "cp2-allgather": CP2 + ["--parallel.cp_attention", "allgather"],
           "ep2": MOE + ["--parallel.dp", "2", "--parallel.ep", "2"]}
EP2_DP2 = MOE + ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero", "3"]
RANKS_4 = {"cp2xdp2": CP2 + ["--parallel.dp", "2", "--parallel.zero", "2"],
           "cp2xtp2": CP2 + ["--parallel.tp", "2", "--parallel.sp", "true"],
           "cp2xpp2": CP2 + ["--parallel.pp", "2"],  # ring attention inside the stages of a pipeline
           "hsdp2x2-ep2": MOE + ["--parallel.dp", "4", "--parallel.dp_replicate", "2", "--parallel.zero", "3",
                                 "--parallel.ep", "2"],
           "ep2xdp2": EP2_DP2,
           "ep2xtp2": MOE + ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2", "--parallel.sp", "true",
                             "--parallel.zero", "1"]}
DP2_CP2_TP2 = ["--parallel.dp", "2", "--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sp", "true",
               "--parallel.zero", "3"]
RANKS_8 = {"dp2xcp2xtp2": DP2_CP2_TP2, "dp2xcp2xtp2-ep2": MOE + DP2_CP2_TP2 + ["--parallel.ep", "2"],
           "tp2xcp2xpp2": CP2 + ["--parallel.tp", "2", "--parallel.sp", "true", "--parallel.pp", "2"],
           "hsdp2x2xcp2": CP2 + ["--parallel.dp", "4", "--parallel.dp_replicate", "2", "--parallel.zero", "3"]}


def _is_moe(args: list[str]) -> bool:
    return "--model.n_experts" in args


@pytest.fixture(scope="module")
def moe_reference(dist_base, tmp_path_factory):
    run = tmp_path_factory.mktemp("moe-ref")
    train(load_config(None, dist_base + MOE + ["--run.dir", str(run)]), echo=False)
    return run


def _launch(world: int, layouts: dict, dist_base, root, extra=()) -> dict:
    dirs = {name: root / name for name in layouts}
    launch(world, [dist_base + args + ["--run.dir", str(dirs[name])] for name, args in layouts.items()] + list(extra))
    return dirs


@pytest.fixture(scope="module")
def two_rank_runs(dist_base, references, moe_reference, tmp_path_factory):
    return _launch(2, RANKS_2, dist_base, tmp_path_factory.mktemp("cpep-two"))


@pytest.fixture(scope="module")
def four_rank_runs(dist_base, references, moe_reference, tmp_path_factory):
    """The layouts, then the ep2×dp2 run's step-3 checkpoint resumed under ep4 (and, after the
    launch, in one process from a copy)."""
    root = tmp_path_factory.mktemp("cpep-four")
    saved = root / "ep2xdp2" / "checkpoints" / f"step-{SAVE_AT:07d}"
    resume = dist_base + MOE + ["--parallel.dp", "4", "--parallel.ep", "4", "--run.dir", str(root / "resumed-ep4"),
                                "--checkpoint.resume", str(saved)]
    dirs = _launch(4, RANKS_4, dist_base, root, [resume])
    shutil.copytree(saved.parent.parent, root / "copy")
    train(load_config(None, dist_base + MOE + ["--run.dir", str(root / "resumed-one"), "--checkpoint.resume",
                                               str(root / "copy" / "checkpoints" / f"step-{SAVE_AT:07d}")]),
          echo=False)
    return dirs | {"resumed-ep4": root / "resumed-ep4", "resumed-one": root / "resumed-one"}


@pytest.fixture(scope="module")
def eight_rank_runs(dist_base, references, moe_reference, tmp_path_factory):
    return _launch(8, RANKS_8, dist_base, tmp_path_factory.mktemp("cpep-eight"))


def _reference(name: str, layouts: dict, references, moe_reference):
    return moe_reference if _is_moe(layouts.get(name, MOE)) else references["fp32"]


@pytest.mark.parametrize("name", list(RANKS_2))
def test_two_rank_cp_and_ep_equal_one_process(two_rank_runs, references, moe_reference, name):
    assert_equivalent(two_rank_runs[name], _reference(name, RANKS_2, references, moe_reference), "fp32", name)


@pytest.mark.parametrize("name", list(RANKS_4))
def test_four_rank_cp_and_ep_layouts_equal_one_process(four_rank_runs, references, moe_reference, name):
    assert_equivalent(four_rank_runs[name], _reference(name, RANKS_4, references, moe_reference), "fp32", name)


@pytest.mark.parametrize("name", list(RANKS_8))
def test_dp2_cp2_tp2_on_eight_ranks_equals_one_process(eight_rank_runs, references, moe_reference, name):
    assert_equivalent(eight_rank_runs[name], _reference(name, RANKS_8, references, moe_reference), "fp32", name)


@pytest.mark.parametrize("layout", ["resumed-ep4", "resumed-one"])
def test_an_ep2_checkpoint_resumes_under_ep4_and_in_one_process(four_rank_runs, moe_reference, layout):
    ckpt = four_rank_runs["ep2xdp2"] / "checkpoints" / f"step-{SAVE_AT:07d}"
    assert (ckpt / "complete").is_file() and len(list((ckpt / "dcp").glob("*.distcp"))) == 4
    assert_equivalent(four_rank_runs[layout], moe_reference, "fp32", layout, SAVE_AT + 1)


def test_an_ep_checkpoint_loads_for_inference_in_one_process(four_rank_runs, moe_reference):
    """eval, serve and export read the experts back whole (global shapes), with the routing bias the
    run had learned; the same weights as the one-process run's checkpoint of that step, within the
    layouts' weight tolerance (tests/tolerances.py: a share of each tensor's update). The two runs
    route slot for slot (test_four_rank_cp_and_ep_layouts_equal_one_process) and their routing
    biases are equal bit for bit, so the experts' gaps are summation order alone (docs/testing.md)."""
    from ultratron.checkpoint.inference import load_for_inference

    def step_weights(run):
        return load_for_inference(run / "checkpoints" / f"step-{SAVE_AT:07d}").model.state_dict()

    got, expected = step_weights(four_rank_runs["ep2xdp2"]), step_weights(moe_reference)
    assert got["layers.0.feed_forward.experts.w1"].shape == (4, 64, 64)
    assert set(got) == set(expected)
    biases = [name for name in expected if name.endswith("router.expert_bias")]
    assert biases and all(got[name].equal(expected[name]) for name in biases)  # the same routing decisions
    assert got["layers.1.feed_forward.router.expert_bias"].abs().sum() > 0  # the bias moved, and was saved
    gap = weights_gap(four_rank_runs["ep2xdp2"], moe_reference, step_weights)
    assert gap <= LAYOUTS["fp32"]["weights"], gap
