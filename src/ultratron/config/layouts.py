"""A ready-to-run training config for a layout that `ultratron plan search` chose."""

from __future__ import annotations

import dataclasses

from ultratron.config.loader import to_toml
from ultratron.config.training import Config
from ultratron.models.presets import ModelShape
from ultratron.planning.layout import Layout
from ultratron.planning.memory import GiB
from ultratron.planning.search import Estimate, SearchSpec


def layout_config(spec: SearchSpec, layout: Layout, preset: str | None = None):
    """A ready-to-run ultratron Config for a layout, its pipeline schedule and stage split included."""
    cfg = Config()
    model = cfg.model
    model.preset = preset
    for f in dataclasses.fields(ModelShape):  # (a field a custom shape leaves unset: the preset's or the default)
        if getattr(spec.shape, f.name, None) is not None:
            setattr(model, f.name, getattr(spec.shape, f.name))
    model.max_seq_len = max(layout.seq_len, getattr(spec.shape, "max_seq_len", 0) or 0)
    model.rope_theta = getattr(spec.shape, "rope_theta", None) or 500_000.0
    cfg.layout = layout
    cfg.training.device = "cuda"
    cfg.run.dir = f"runs/{preset or 'custom'}-{spec.n_gpus}x{spec.accelerator.name.replace(' ', '-').lower()}"
    return cfg


def config_toml(spec: SearchSpec, est: Estimate, preset: str | None = None) -> str:
    lay = est.layout
    header = [
        f"# Written by `ultratron plan search` for {spec.n_gpus} × {spec.accelerator.name}.",
        f"# Layout: {lay.describe()}",
        f"# Estimated: {est.memory.fit_bytes / GiB:.1f} GiB per GPU at most (step or start), "
        f"{est.step_s:.2f} s per step, "
        f"{est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {est.mfu:.1%}.",
        f"# Launch: torchrun --nproc-per-node {min(spec.gpus_per_node, spec.n_gpus)} "
        f"--nnodes {max(1, spec.n_gpus // spec.gpus_per_node)} -m ultratron train --config THIS_FILE",
        "",
    ]
    return "\n".join(header) + to_toml(layout_config(spec, lay, preset))
