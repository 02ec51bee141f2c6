"""A checkpoint's model and tokenizer for inference: evaluation, serving, export, the perplexity filter."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ultratron.checkpoint.manager import read_checkpoint
from ultratron.checkpoint.state import ModelState
from ultratron.checkpoint.storage import Location, Storage, is_url
from ultratron.checkpoint.store import LATEST, CheckpointRoot, resolve_checkpoint_dir, step_of
from ultratron.config import Config, load_config
from ultratron.data.tokenizer import Tokenizer
from ultratron.errors import CheckpointError
from ultratron.models.lora import apply_lora, is_adapter, merged_state
from ultratron.models.registry import build_empty, plan_of


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: Config
    checkpoint_dir: Location
    step: int | None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inference_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """`name` (fp32, bf16) as a torch dtype; None: bf16 on a GPU, fp32 on a CPU (whose bf16 matmuls
    are slower than fp32 ones on most CPUs without AMX, and the tests compare against fp32)."""
    if name is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_for_inference(checkpoint: str | Path, device: str | torch.device = "cpu",
                       endpoint: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model (eval mode, no gradients, its weights in `dtype`: fp32 unless asked) and tokenizer
    of a checkpoint, run or checkpoints directory, whatever layout wrote it; on local disk or at a URL
    as training writes them (`s3://bucket/prefix`, with `endpoint` for an S3-compatible server; else
    AWS_ENDPOINT_URL or AWS). The checkpoint is read in fp32 and then cast, so a bf16 model rounds
    each weight once, as the trainer's bf16 autocast does."""
    loaded = _load(checkpoint, device, endpoint)
    if dtype != torch.float32:
        loaded.model.to(dtype)
    return loaded


def _load(checkpoint: str | Path, device, endpoint: str | None) -> LoadedModel:
    if is_url(checkpoint):
        return _load_remote(str(checkpoint), device, endpoint)
    ckpt_dir = resolve_checkpoint_dir(checkpoint)
    cfg = load_config(ckpt_dir / "config.toml")
    model = _model(cfg, device)
    if cfg.lora.rank > 0:
        model = _merged_lora(cfg, ckpt_dir, model, device)
    else:
        read_checkpoint(ckpt_dir, ModelState(model))
    tokenizer = Tokenizer.load(ckpt_dir / "tokenizer.json")
    return LoadedModel(model, tokenizer, cfg, ckpt_dir, step_of(ckpt_dir))


def read_lora(cfg: Config, ckpt_dir: Path, model: torch.nn.Module) -> torch.nn.Module:
    """`model` (built from cfg) with the weights of the base checkpoint model.init_from and the
    adapters of `ckpt_dir` on them (`models/lora.py`)."""
    if not cfg.model.init_from:
        raise CheckpointError(f"{ckpt_dir} holds LoRA adapters, but its config names no model.init_from under them")
    base = resolve_checkpoint_dir(cfg.model.init_from)
    read_checkpoint(base, ModelState(model, select=lambda name: not is_adapter(name)))
    apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, plan_of(model).lora_targets)
    read_checkpoint(ckpt_dir, ModelState(model, select=is_adapter))
    return model


def _merged_lora(cfg: Config, ckpt_dir: Path, model: torch.nn.Module, device) -> torch.nn.Module:
    """A LoRA checkpoint as the plain model that computes the same: W + (alpha / rank) · B A."""
    adapted = read_lora(cfg, ckpt_dir, model)
    merged = _model(cfg, device)
    merged.load_state_dict(merged_state(adapted.state_dict(), cfg.lora.alpha / cfg.lora.rank))
    return merged


def _model(cfg: Config, device) -> torch.nn.Module:
    """Storage on `device` and no values (no initialization to throw away): the load fills it."""
    return build_empty(cfg.model, device).eval().requires_grad_(False)


def remote_checkpoint(url: str, endpoint: str | None = None) -> tuple[CheckpointRoot, str]:
    """The checkpoints root and the checkpoint a URL means: a checkpoint itself, `.../latest`, or a
    checkpoints or run directory whose latest checkpoint is meant (the same rules as on disk)."""
    url = url.rstrip("/")
    parent = url.rsplit("/", 1)[0]
    if CheckpointRoot(Storage(parent, endpoint)).is_complete(url):
        return CheckpointRoot(Storage(parent, endpoint)), url
    candidates = [url, f"{url}/checkpoints"] + ([parent] if url.endswith(f"/{LATEST}") else [])
    for root_url in candidates:
        root = CheckpointRoot(Storage(root_url, endpoint))
        if (found := root.latest()) is not None:
            return root, str(found)
    raise CheckpointError(f"{url}: no complete checkpoint there (nor a run or checkpoints directory holding one)")


def _load_remote(url: str, device, endpoint: str | None) -> LoadedModel:
    root, ckpt = remote_checkpoint(url, endpoint)
    storage = root.storage
    with tempfile.TemporaryDirectory(prefix="ultratron-ckpt-") as tmp:
        # the config loader and the tokenizer read files: their small files come down first
        for name in ("config.toml", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if name.endswith((".toml", "tokenizer.json")) or storage.is_file(storage.join(ckpt, name)):
                Path(tmp, name).write_bytes(storage.read_bytes(storage.join(ckpt, name)))
        cfg = load_config(Path(tmp, "config.toml"))
        tokenizer = Tokenizer.load(Path(tmp, "tokenizer.json"))
    model = _model(cfg, device)
    read_checkpoint(ckpt, ModelState(model), storage=storage)  # the manifest is verified first, as on disk
    return LoadedModel(model, tokenizer, cfg, ckpt, root.step_of(ckpt))
