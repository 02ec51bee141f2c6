"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), loadable under another layout.

Same directory conventions and atomicity as `manager.py`: every rank writes its shards into one
hidden temporary directory, rank 0 adds `state.pt`, `config.toml`, `tokenizer.json` and the
`complete` marker, renames it to `step-NNNNNNN/` and moves `latest`. The weights and optimizer
state go to `dcp/` keyed by parameter name with their global shapes, so DCP can cut them again
for any other layout (dp2×tp2 → dp4, or one process). Single-process checkpoints (`model.pt`,
`optimizer.pt`) load into any layout too.

ZeroRedundancyOptimizer has no DCP support: each rank saves the AdamW state of the parameters it
owns under the same names the other layouts use, so those checkpoints reshard as well.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ultratron.checkpoint.manager import (
    DONE_MARKER,
    CheckpointManager,
    _fsync_dir,
    clean_param_name,
    step_dir_name,
)
from ultratron.errors import CheckpointError

DCP_DIR = "dcp"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_zero1(optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _zero1_param_names(model: nn.Module, optimizer) -> dict[int, str]:
    names = {id(p): clean_param_name(n) for n, p in model.named_parameters(remove_duplicate=True)}
    return {id(p): names[id(p)] for group in optimizer.param_groups for p in group["params"]}


def _zero1_owned_state(model: nn.Module, optimizer, create: bool) -> dict:
    """{"state": {name: {...}}} for the parameters this rank's ZeRO-1 shard owns."""
    names = _zero1_param_names(model, optimizer)
    local = optimizer.optim
    out = {}
    for group in local.param_groups:
        for param in group["params"]:
            if create and param not in local.state:
                local.state[param] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            if param in local.state:
                out[names[id(param)]] = local.state[param]
    return {"state": out}


def _state_for_dcp(model: nn.Module, optimizer) -> tuple[dict, dict]:
    if _is_zero1(optimizer):
        return get_model_state_dict(model), _zero1_owned_state(model, optimizer, create=True)
    return get_state_dict(model, optimizer)


def save_sharded(manager: CheckpointManager, step: int, *, model: nn.Module, optimizer, state: dict,
                 config_toml: str, tokenizer_json: str, is_main: bool) -> Path:
    """Every rank calls this; returns the final checkpoint directory."""
    root = manager.root
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-sharded"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    model_state, optim_state = _state_for_dcp(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / DCP_DIR))
    if is_main:
        torch.save(state, tmp / "state.pt")
        (tmp / "config.toml").write_text(config_toml, encoding="utf-8")
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        for file in [*tmp.iterdir(), *(tmp / DCP_DIR).iterdir()]:
            if file.is_file():
                with open(file, "rb") as fh:
                    os.fsync(fh.fileno())
        (tmp / DONE_MARKER).write_text(f"{step}\n")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        manager._point_latest(final.name)
        manager._prune()
    _barrier()
    return final


def load_sharded(path: Path, model: nn.Module, optimizer) -> dict:
    """Load a DCP checkpoint into this layout's model and optimizer; returns its `state.pt`."""
    model_state, optim_state = _state_for_dcp(model, optimizer)
    try:
        # Only the per-parameter state is read: the hyperparameters come from this run's config.
        dcp.load({"model": model_state, "optimizer": {"state": optim_state["state"]}},
                 checkpoint_id=str(path / DCP_DIR))
    except Exception as err:  # DCP raises CheckpointException wrapping each rank's error
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: the sharded weights do not fit this model.* config ({first})") from None
    if _is_zero1(optimizer):
        set_model_state_dict(model, model_state)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return torch.load(path / "state.pt", map_location="cpu", weights_only=False)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Only the weights of a DCP checkpoint, into a plain (unsharded) model in one process —
    for evaluation, serving and export of a run trained on many processes."""
    import warnings

    model_state = model.state_dict()
    try:
        with warnings.catch_warnings():  # loading in one process is the intent here, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_state}, checkpoint_id=str(Path(path) / DCP_DIR))
    except Exception as err:  # DCP wraps the reader's error
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: the sharded weights do not fit its config.toml ({first})") from None
    model.load_state_dict(model_state)


def load_full_into_layout(parts: dict, model: nn.Module, optimizer) -> None:
    """A single-process checkpoint (full tensors, optimizer keyed by position) into any layout."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, parts["model"], options=options)
    saved = parts["optimizer"]
    if _is_zero1(optimizer):
        raise CheckpointError("resuming a one-process checkpoint under parallel.zero=1 is not supported; "
                              "resume it with zero 0, 2 or 3 and save again")
    # The optimizer was built from model.parameters() in the same order as in one process, so
    # position i of the saved state is the i-th parameter of our groups.
    names = {id(p): clean_param_name(n) for n, p in model.named_parameters()}
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    by_name = {"state": {names[id(ordered[i])]: value for i, value in saved["state"].items()},
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [names[id(ordered[i])] for i in g["params"]]}
                                for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
