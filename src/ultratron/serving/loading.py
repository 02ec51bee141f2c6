"""Load a checkpoint's model and tokenizer for inference (serving, evaluation, export)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ultratron.checkpoint.manager import clean_param_name, load_checkpoint, resolve_checkpoint_dir
from ultratron.errors import CheckpointError


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # ultratron.data.tokenizer.Tokenizer
    config: object  # ultratron.config.Config
    checkpoint_dir: Path
    step: int | None


def clean_state_dict(state: dict) -> dict:
    return {clean_param_name(key): value for key, value in state.items()}


def load_model(checkpoint: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    """The model (eval mode, fp32) and tokenizer of a checkpoint, run or checkpoints directory,
    whether one process wrote it (model.pt) or many (sharded, DCP)."""
    from ultratron.checkpoint.distributed import is_sharded_checkpoint, load_model_weights
    from ultratron.config import load_config
    from ultratron.data.tokenizer import Tokenizer
    from ultratron.models.llama import build_model

    ckpt_dir = resolve_checkpoint_dir(checkpoint)
    cfg = load_config(ckpt_dir / "config.toml")
    model = build_model(cfg.model, device)
    if is_sharded_checkpoint(ckpt_dir):  # written by a multi-process run: DCP reassembles the tensors
        load_model_weights(ckpt_dir, model)
    else:
        parts = load_checkpoint(ckpt_dir, map_location=device, parts_to_load=("model",))
        try:
            model.load_state_dict(clean_state_dict(parts["model"]))
        except RuntimeError as err:
            raise CheckpointError(f"{ckpt_dir}: model weights do not fit its config.toml "
                                  f"({str(err).splitlines()[0]})") from None
    model.eval().requires_grad_(False)
    tokenizer = Tokenizer.load(ckpt_dir / "tokenizer.json")
    done = (ckpt_dir / "complete").read_text().strip() if (ckpt_dir / "complete").is_file() else ""
    return LoadedModel(model, tokenizer, cfg, ckpt_dir, int(done) if done.isdigit() else None)
