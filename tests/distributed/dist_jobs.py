"""Work the spawned ranks of the distributed tests run: a list of training runs, one after another,
in the same process group (a fresh DeviceMesh each), so one launch covers several layouts."""

from __future__ import annotations


def train_runs(runs: list[list[str]]) -> None:
    from ultratron.config import load_config
    from ultratron.training.trainer import train

    for overrides in runs:
        train(load_config(None, overrides), echo=False)
