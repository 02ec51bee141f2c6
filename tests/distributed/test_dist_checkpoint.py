"""Sharded checkpoints reshard: saved under dp2×tp2 (FSDP + TP + SP), resumed under dp4 and under
one process, the next steps' losses equal those of the run that kept going (the one-process
reference, which every layout matches to 1e-5 — see test_dist_equivalence)."""

from __future__ import annotations

import shutil

import pytest
from dist_common import (  # noqa: F401 (fixtures)
    assert_equivalent,
    dist_base_fixture,
    launch,
    records,
    references_fixture,
)

from ultratron.config import load_config
from ultratron.training.trainer import train

SAVE_AT = 3
DP2_TP2 = ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true", "--parallel.zero", "3"]


@pytest.fixture(scope="module")
def resharded(dist_base, references, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    saved = root / "dp2xtp2"
    ckpt = saved / "checkpoints" / f"step-{SAVE_AT:07d}"
    launch(4, [
        dist_base + DP2_TP2 + ["--run.dir", str(saved), "--training.stop_after", str(SAVE_AT)],
        dist_base + ["--parallel.dp", "4", "--run.dir", str(root / "dp4"), "--checkpoint.resume", str(ckpt)],
    ])
    shutil.copytree(saved, root / "dp2xtp2-copy")  # the one-process resume must not need the original
    train(load_config(None, dist_base + ["--run.dir", str(root / "one"), "--checkpoint.resume",
                                         str(root / "dp2xtp2-copy" / "checkpoints" / "latest")]), echo=False)
    return {"ckpt": ckpt, "dp4": root / "dp4", "one": root / "one", "saved": records(saved)}


def test_checkpoint_is_sharded_and_complete(resharded):
    ckpt = resharded["ckpt"]
    assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "complete").is_file()
    assert (ckpt.parent / "latest").read_text().strip() == ckpt.name
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == 4  # one file of shards per rank
    assert not list(ckpt.parent.glob(".tmp-*"))
    assert [r["step"] for r in resharded["saved"]] == list(range(1, SAVE_AT + 1))


@pytest.mark.parametrize("layout", ["dp4", "one"])
def test_resumed_steps_equal_the_run_that_kept_going(resharded, references, layout):
    assert_equivalent(resharded[layout], references["fp32"], "fp32", layout, first_step=SAVE_AT + 1)


def test_a_sharded_checkpoint_loads_for_inference_in_one_process(resharded, dist_base, tmp_path):
    """eval, serve, export and the perplexity filter load a multi-process run's checkpoint as well."""
    import torch

    from ultratron.checkpoint.inference import load_for_inference as load_model
    from ultratron.models.registry import build_model
    from ultratron.training.trainer import Trainer

    loaded = load_model(resharded["ckpt"])
    assert loaded.step == SAVE_AT
    trainer = Trainer(load_config(None, dist_base + ["--run.dir", str(tmp_path / "r"),
                                                     "--checkpoint.resume", str(resharded["ckpt"])]), echo=False)
    trainer.checkpoints.resume()  # the training path's resharding load, for comparison
    expected = trainer.model.state_dict()
    got = loaded.model.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    fresh = build_model(loaded.config.model).state_dict()
    assert not torch.equal(fresh["layers.0.attention.wq.weight"], got["layers.0.attention.wq.weight"])
