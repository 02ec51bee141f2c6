"""A checkpoint's model and tokenizer for inference: evaluation, serving, export, the perplexity filter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ultratron.checkpoint.manager import read_checkpoint
from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.store import resolve_checkpoint_dir, step_of
from ultratron.config import Config, load_config
from ultratron.data.tokenizer import Tokenizer
from ultratron.models.registry import build_model


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: Config
    checkpoint_dir: Path
    step: int | None


def load_for_inference(checkpoint: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    """The model (eval mode, fp32, no gradients) and tokenizer of a checkpoint, run or checkpoints
    directory, whatever layout wrote it."""
    ckpt_dir = resolve_checkpoint_dir(checkpoint)
    cfg = load_config(ckpt_dir / "config.toml")
    model = build_model(cfg.model, device)
    read_checkpoint(ckpt_dir, ModelState(model))
    model.eval().requires_grad_(False)
    tokenizer = Tokenizer.load(ckpt_dir / "tokenizer.json")
    return LoadedModel(model, tokenizer, cfg, ckpt_dir, step_of(ckpt_dir))
