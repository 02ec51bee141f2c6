"""A ready-to-run training config for a layout that `ultratron plan search` chose."""

from __future__ import annotations

from ultratron.config.loader import to_toml
from ultratron.config.training import Config
from ultratron.planning.memory import GiB, Layout
from ultratron.planning.search import Estimate, SearchSpec


def layout_config(spec: SearchSpec, layout: Layout, preset: str | None = None):
    """A ready-to-run ultratron Config for a layout, its pipeline schedule and stage split included."""
    cfg = Config()
    model = cfg.model
    model.preset = preset
    for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings"):
        setattr(model, name, getattr(spec.shape, name))
    for name in ("head_dim", "qk_norm", "n_experts", "n_active_experts", "n_shared_experts", "expert_ffn_dim",
                 "n_dense_layers", "router_score", "family"):  # (absent from a custom shape: the preset's or default)
        if getattr(spec.shape, name, None) is not None:
            setattr(model, name, getattr(spec.shape, name))
    model.max_seq_len = max(layout.seq, getattr(spec.shape, "max_seq_len", 0) or 0)
    model.rope_theta = getattr(spec.shape, "rope_theta", None) or 500_000.0
    par = cfg.parallel
    par.dp, par.zero, par.tp, par.sp, par.pp, par.cp, par.ep = (
        layout.dp, layout.zero, layout.tp, layout.sp, layout.pp, layout.cp, layout.ep)
    if layout.pp > 1:
        par.pp_schedule, par.pp_virtual_stages = layout.pp_schedule, layout.stages_per_rank
        par.pp_split, par.pp_balance = layout.pp_split, layout.pp_balance
    train = cfg.training
    train.batch_tokens = spec.global_batch_tokens
    train.micro_batch_size = layout.mbs
    train.seq_len = layout.seq
    train.precision = layout.precision
    train.recompute = layout.recompute
    train.device = "cuda"
    cfg.run.dir = f"runs/{preset or 'custom'}-{spec.n_gpus}x{spec.accelerator.name.replace(' ', '-').lower()}"
    return cfg


def config_toml(spec: SearchSpec, est: Estimate, preset: str | None = None) -> str:
    lay = est.layout
    header = [
        f"# Written by `ultratron plan search` for {spec.n_gpus} × {spec.accelerator.name}.",
        f"# Layout: {lay.describe()}",
        f"# Estimated: {est.memory.peak_bytes / GiB:.1f} GiB per GPU, {est.step_s:.2f} s per step, "
        f"{est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {est.mfu:.1%}.",
        f"# Launch: torchrun --nproc-per-node {min(spec.gpus_per_node, spec.n_gpus)} "
        f"--nnodes {max(1, spec.n_gpus // spec.gpus_per_node)} -m ultratron train --config THIS_FILE",
        "",
    ]
    return "\n".join(header) + to_toml(layout_config(spec, lay, preset))
