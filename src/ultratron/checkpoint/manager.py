"""Checkpoints of a run: `RUN/checkpoints/step-NNNNNNN/` plus a `latest` pointer.

A checkpoint is written into a hidden temporary directory and renamed into place only when
every file is on disk, then `latest` is replaced atomically: a crash at any moment leaves either
the old checkpoint or the new one, never half of one. A checkpoint is self-contained (config,
tokenizer, model, optimizer, data-loader position, RNG states), so eval, export and serving
need nothing else.

Files: `model.pt` (model state dict), `optimizer.pt`, `state.pt` (step, loader and RNG states),
`config.toml`, `tokenizer.json`, `complete` (written last, before the rename).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from ultratron.errors import CheckpointError

LATEST = "latest"
DONE_MARKER = "complete"


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Prefixes that wrappers leave in parameter names (torch.compile, DDP, activation checkpointing).
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.")


def clean_param_name(name: str) -> str:
    """A parameter's name as the plain model knows it, without wrapper prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int = 3):
        self.root = Path(root)
        self.keep = keep

    # ---- writing ----------------------------------------------------------------------------
    def save(self, step: int, *, model_state: dict, optimizer_state: dict, state: dict,
             config_toml: str, tokenizer_json: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        torch.save(model_state, tmp / "model.pt")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(state, tmp / "state.pt")
        (tmp / "config.toml").write_text(config_toml, encoding="utf-8")
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        for file in tmp.iterdir():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        (tmp / DONE_MARKER).write_text(f"{step}\n")
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. after a rollback) replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._point_latest(final.name)
        self._prune()
        return final

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".{LATEST}.tmp"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / LATEST)
        _fsync_dir(self.root)

    def _prune(self) -> None:
        steps = self.complete_checkpoints()
        for path in steps[: max(0, len(steps) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)

    # ---- reading ----------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if (p / DONE_MARKER).is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        """The checkpoint `latest` names; if that one is gone or incomplete, the newest complete one."""
        pointer = self.root / LATEST
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / DONE_MARKER).is_file():
                return candidate
        done = self.complete_checkpoints()
        return done[-1] if done else None


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory whose latest one is meant."""
    path = Path(path)
    if (path / DONE_MARKER).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = CheckpointManager(root).latest() if root.is_dir() else None
        if found is not None:
            return found
    if path.name == LATEST and path.parent.is_dir():
        found = CheckpointManager(path.parent).latest()
        if found is not None:
            return found
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    raise CheckpointError(f"{path}: not a complete checkpoint (no '{DONE_MARKER}' marker) and holds none")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu",
                    parts_to_load: tuple[str, ...] = ("model", "optimizer", "state")) -> dict:
    """The named parts of a checkpoint (plus its dir, config and tokenizer text); raises
    CheckpointError for a missing or damaged one. Eval and serving need only "model"."""
    ckpt = resolve_checkpoint_dir(path)
    parts = {}
    for name in parts_to_load:
        file = ckpt / f"{name}.pt"
        if not file.is_file():
            raise CheckpointError(f"{ckpt}: {file.name} is missing")
        try:
            parts[name] = torch.load(file, map_location=map_location, weights_only=False)
        except Exception as err:  # torch raises several types for truncated or foreign files
            raise CheckpointError(f"{file}: cannot be read ({type(err).__name__}: {err})") from None
    parts["dir"] = ckpt
    parts["config_toml"] = (ckpt / "config.toml").read_text(encoding="utf-8")
    parts["tokenizer_json"] = (ckpt / "tokenizer.json").read_text(encoding="utf-8")
    return parts
