"""The pipeline on a local Ray instance gives output identical to the local run."""

from __future__ import annotations

import pytest

from ultratron.curation.config import from_dict
from ultratron.curation.runner import run_pipeline

pytest.importorskip("ray")

from test_curation_pipeline import config, final_outputs, make_corpus  # noqa: E402


@pytest.mark.slow
def test_ray_run_matches_local_run(tmp_path):
    make_corpus(tmp_path / "src")
    run_pipeline(from_dict(config(tmp_path / "src", tmp_path / "local")), log=lambda _: None)
    ray_cfg = config(tmp_path / "src", tmp_path / "ray")
    ray_cfg["pipeline"]["executor"] = "ray"
    run_pipeline(from_dict(ray_cfg), log=lambda _: None)
    assert final_outputs(tmp_path / "ray") == final_outputs(tmp_path / "local")
