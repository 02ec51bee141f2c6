"""Fixtures of the multi-process tests: one tokenized corpus for every run and the one-process
reference runs every layout is compared with."""

from __future__ import annotations

import pytest
from dist_common import BATCH, STEPS, TINY, records

from ultratron.config import load_config
from ultratron.training.trainer import train


@pytest.fixture(scope="session")
def dist_base(small_corpus, tmp_path_factory) -> list[str]:
    data = tmp_path_factory.mktemp("dist-data")
    base = TINY + BATCH + ["--data.path", str(small_corpus), "--data.extensions", ".py", "--data.cache_dir", str(data)]
    return base


@pytest.fixture(scope="session")
def references(dist_base, tmp_path_factory) -> dict[str, list[dict]]:
    """One-process runs in fp32 and bf16 (these also tokenize the corpus for everyone else)."""
    out = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path_factory.mktemp(f"ref-{precision}")
        train(load_config(None, dist_base + ["--training.precision", precision, "--run.dir", str(run)]), echo=False)
        out[precision] = records(run)
        assert [r["step"] for r in out[precision]] == list(range(1, STEPS + 1))
    return out
