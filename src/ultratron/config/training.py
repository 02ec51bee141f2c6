"""The training run's config: one dataclass per section, read from TOML and `--section.field` flags.

Everything is validated before any data is read or any process group starts. Problems are
collected and reported together, one line each, as a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ultratron.config.loader import (
    apply_overrides,
    apply_tables,
    build,
    choice_problems,
    did_you_mean,
    option,
    read_toml,
    set_field,
)
from ultratron.errors import ConfigError
from ultratron.models.presets import PRESETS
from ultratron.planning.pipeline import BALANCES, SCHEDULES
from ultratron.planning.rules import layout_problems, pipeline_problems, shape_problems


@dataclass
class ModelConfig:
    # A preset fills every shape field left unset (None); explicit fields win over the preset.
    preset: str | None = option("tiny", "a named shape (tiny, llama3-1b/3b/8b/70b/405b); explicit fields win")
    n_layers: int | None = option(None, "transformer blocks")
    dim: int | None = option(None, "model width")
    n_heads: int | None = option(None, "attention (query) heads")
    n_kv_heads: int | None = option(None, "key/value heads (grouped-query attention)")
    ffn_dim: int | None = option(None, "SwiGLU hidden width")
    vocab_size: int | None = option(None, "vocabulary size (the tokenizer is trained to it)")
    max_seq_len: int | None = option(None, "longest sequence (RoPE table size)")
    tie_embeddings: bool | None = option(None, "share the embedding and output matrices")
    rope_theta: float | None = option(None, "RoPE base")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    qk_norm: bool = option(False, "RMSNorm on queries and keys per head (OLMo 2, Gemma 3)")
    attn_softcap: float = option(0.0, "Gemma-2 attention-logit soft cap cap·tanh(x/cap); 0 disables")
    final_softcap: float = option(0.0, "Gemma-2 final-logit soft cap; 0 disables")
    init_std: float = option(0.02, "standard deviation of the initial weights")


@dataclass
class ParallelConfig:
    dp: int = option(1, "data-parallel degree")
    dp_replicate: int = option(1, "HSDP: dp = dp_replicate × dp_shard; shard within groups, replicate across")
    zero: int = option(0, "0 DDP, 1 ZeRO-1 (optimizer state), 2 ZeRO-2 (+ gradients), 3 ZeRO-3 (+ parameters)",
                       choices=(0, 1, 2, 3))
    tp: int = option(1, "tensor-parallel degree")
    sp: bool = option(False, "sequence parallel (needs tp > 1)")
    pp: int = option(1, "pipeline-parallel degree: the layers run as stages on pp ranks (docs/parallel.md)")
    pp_schedule: str = option("1f1b", "pipeline schedule: gpipe (all forwards, then all backwards), 1f1b, "
                                      "interleaved-1f1b (several stages per rank), zb (interleaved zero "
                                      "bubble), zbv (zero bubble on a V), dualpipev", choices=SCHEDULES)
    pp_virtual_stages: int = option(0, "pipeline stages per rank; 0: the schedule's own (1 for gpipe and 1f1b, "
                                       "else 2); interleaved-1f1b and zb take any ≥ 2, zbv and dualpipev 2")
    pp_split: str | None = option(None, "layers per pipeline stage in stage order, comma-separated (e.g. 3,5): "
                                        "pp × stages-per-rank entries adding up to model.n_layers; default: "
                                        "balanced by parallel.pp_balance")
    pp_balance: str = option("flops", "what the default stage split evens out: flops (training FLOPs per token) "
                                      "or params; the embedding counts on the first stage, the head on the last",
                             choices=BALANCES)
    cp: int = option(1, "context-parallel degree")
    ep: int = option(1, "expert-parallel degree")


@dataclass
class TrainingConfig:
    steps: int = option(200, "optimizer steps")
    batch_tokens: int = option(8192, "global batch in tokens; gradient accumulation is derived from it")
    micro_batch_size: int = option(8, "sequences per micro-batch per data-parallel rank")
    seq_len: int = option(256, "tokens per sequence")
    precision: str = option("fp32", "bf16: bf16 autocast compute, fp32 master weights", choices=("fp32", "bf16"))
    grad_clip: float = option(1.0, "global-norm clipping; 0 disables (the norm is still logged)")
    z_loss: float = option(0.0, "PaLM z-loss coefficient (1e-4 in Chowdhery et al. 2022); 0 disables")
    seed: int = option(0, "seeds the weights, the data order and sampling")
    recompute: str = option("none", "activation recomputation", choices=("none", "selective", "full"))
    device: str = option("auto", "auto picks cuda when available", choices=("auto", "cpu", "cuda"))
    threads: int = option(0, "torch intra-op threads on CPU; 0 keeps torch's default")
    stop_after: int = option(0, "stop (with a checkpoint) after this many steps of this invocation, e.g. to fit "
                                "a job's time limit; the schedule still follows steps; 0: run to steps")
    log_interval: int = option(1, "a log line every N steps when the output is not a terminal")
    sample_tokens: int = option(120, "a short sample at the end; 0 disables")
    progress: bool = option(True, "a progress bar when the output is a terminal")


@dataclass
class OptimConfig:
    lr: float = option(3e-3, "peak learning rate")
    min_lr_ratio: float = option(0.1, "the floor of the decay, as a fraction of lr")
    warmup_steps: int = option(20, "linear warmup steps")
    schedule: str = option("cosine", "decay after warmup", choices=("cosine", "wsd", "constant"))
    decay_fraction: float = option(0.2, "wsd: the last fraction of steps decays linearly to the floor")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")


@dataclass
class DataConfig:
    path: str | None = option(None, "none: the built-in corpus (this interpreter's standard library); else a "
                                    "directory of text files, a text file, JSONL with a text field, or a prepared "
                                    "directory (tokenizer.json + train/ [+ val/], as `ultratron data run` writes)")
    tokenizer: str | None = option(None, "a tokenizer.json to load instead of training one")
    held_out_fraction: float = option(0.05, "share of files kept for validation, chosen by file hash")
    max_bytes: int = option(0, "stop reading the corpus after this many bytes; 0 reads everything")
    cache_dir: str | None = option(None, "where tokenizer and shards go; default RUN_DIR/data")
    extensions: str = option(".py,.txt,.md,.rst,.jsonl,.json", "files read from a directory")


@dataclass
class CheckpointConfig:
    interval: int = option(0, "save every N steps (and at the end); 0: only at the end")
    resume: str = option("none", "none | auto (the latest in the run directory) | a checkpoint directory")
    keep: int = option(3, "newest checkpoints kept; older ones are deleted")


@dataclass
class EndpointConfig:
    """How to reach an OpenAI-compatible API: shared by `ultratron eval` and periodic evaluation."""

    endpoint: str | None = option(None, "base URL of an OpenAI-compatible API (…/v1)")
    endpoint_model: str | None = option(None, "the endpoint's model id (default: the first /v1/models lists)",
                                        flags=("--model",))
    api_key_env: str = option("OPENAI_API_KEY", "environment variable holding the endpoint's key")
    concurrency: int = option(4, "requests in flight to the endpoint")
    timeout: float = option(60.0, "seconds per request")
    max_retries: int = option(3, "retries per request, with exponential backoff")
    generation_api: str = option("chat", "API used for generation tasks", choices=("chat", "completions"))
    price_per_request: float = option(0.0, "cost counter: price of one request")
    price_per_1k_prompt_tokens: float = option(0.0, "cost counter: price per 1,000 prompt tokens")
    price_per_1k_completion_tokens: float = option(0.0, "cost counter: price per 1,000 completion tokens")


@dataclass
class EvalConfig(EndpointConfig):
    interval: int = option(50, "validation loss on the held-out split every N steps (and at the end); 0: never")
    batches: int = option(8, "micro-batches per validation")
    task_interval: int = option(0, "task evaluation in a separate process every N steps; 0 disables")
    tasks: str = option("builtin", "comma-separated: builtin, built-in task names, task files")
    max_examples: int = option(100, "examples per task")
    final_wait: float = option(300.0, "seconds the end of training waits for the last task evaluation")


@dataclass
class RunConfig:
    dir: str = option("runs/default", "the run directory")
    tensorboard: bool = option(True, "TensorBoard events beside metrics.jsonl")


@dataclass
class Config:
    model: ModelConfig = option(factory=ModelConfig)
    parallel: ParallelConfig = option(factory=ParallelConfig)
    training: TrainingConfig = option(factory=TrainingConfig)
    optim: OptimConfig = option(factory=OptimConfig)
    data: DataConfig = option(factory=DataConfig)
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    eval: EvalConfig = option(factory=EvalConfig)
    run: RunConfig = option(factory=RunConfig)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.training.micro_batch_size * self.training.seq_len

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.training.batch_tokens // (self.tokens_per_micro_batch * self.parallel.dp)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: Config | None = None) -> Config:
    """Read a TOML file (optional), apply dotted overrides, fill preset fields and validate."""
    if base is None:
        cfg = build(Config, path, overrides)
    else:
        cfg, problems = base, []
        if path is not None:
            apply_tables(cfg, read_toml(path), problems, source=str(path))
        apply_overrides(cfg, overrides or [], problems)
        if problems:
            raise ConfigError(problems)
    resolve_model(cfg.model)
    validate(cfg)
    return cfg


def resolve_model(model: ModelConfig) -> None:
    """Fill unset shape fields from the preset; with no preset every shape field must be set."""
    shape_fields = [f.name for f in dataclasses.fields(PRESETS["tiny"])]
    if model.preset is not None:
        if model.preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {model.preset!r}"
                              f"{did_you_mean(model.preset, list(PRESETS))}; known: {', '.join(PRESETS)}")
        preset = PRESETS[model.preset]
        for name in shape_fields:
            if getattr(model, name) is None:
                setattr(model, name, getattr(preset, name))
    missing = [f"model.{n}" for n in shape_fields if getattr(model, n) is None]
    if missing:
        raise ConfigError(f"model.preset is none, so these must be set: {', '.join(missing)}")


def _positive(cfg: Config) -> list[str]:
    m, t, par = cfg.model, cfg.training, cfg.parallel
    fields = {f"model.{n}": getattr(m, n) for n in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim",
                                                      "vocab_size", "max_seq_len")}
    fields |= {f"training.{n}": getattr(t, n) for n in ("steps", "batch_tokens", "micro_batch_size", "seq_len")}
    fields |= {f"parallel.{n}": getattr(par, n) for n in ("dp", "dp_replicate", "tp", "pp", "cp", "ep")}
    return [f"{name} must be positive, got {value}" for name, value in fields.items()
            if value is not None and value <= 0]


def _parallel_problems(par: ParallelConfig) -> list[str]:
    """Rules of the layout itself (the model's share is in planning.rules.layout_problems)."""
    p = []
    if par.dp % par.dp_replicate:
        p.append(f"parallel.dp_replicate={par.dp_replicate} must divide parallel.dp={par.dp} "
                 "(HSDP: dp = dp_replicate × dp_shard)")
    elif par.dp_replicate > 1 and par.zero < 2:
        p.append(f"parallel.dp_replicate={par.dp_replicate} (HSDP) shards within each replica group, so it needs "
                 f"parallel.zero 2 or 3, got {par.zero}")
    if par.sp and par.tp == 1:
        p.append("parallel.sp=true needs parallel.tp > 1 (sequence parallel splits the norm regions over the "
                 "tensor-parallel ranks)")
    for name in ("cp", "ep"):
        if getattr(par, name) > 1:
            p.append(f"parallel.{name}={getattr(par, name)}: this build trains with data, tensor and pipeline "
                     f"parallelism only; set parallel.{name}=1")
    return p


def validate(cfg: Config) -> None:
    m, t, par, o = cfg.model, cfg.training, cfg.parallel, cfg.optim
    p = choice_problems(cfg) + _positive(cfg)
    if p:
        raise ConfigError(p)
    p += shape_problems(m)
    p += layout_problems(m, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, seq=t.seq_len)
    p += _parallel_problems(par)
    if t.seq_len > m.max_seq_len:
        p.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    micro = cfg.tokens_per_micro_batch * par.dp
    if t.batch_tokens % micro:
        lower = max(micro, t.batch_tokens // micro * micro)
        p.append(f"training.batch_tokens={t.batch_tokens} is not divisible by micro_batch_size × seq_len × dp = "
                 f"{t.micro_batch_size} × {t.seq_len} × {par.dp} = {micro}; try {lower} or {lower + micro}")
    p += pipeline_problems(m, pp=par.pp, schedule=par.pp_schedule, virtual_stages=par.pp_virtual_stages,
                           split=par.pp_split, micro_batches=None if t.batch_tokens % micro else cfg.grad_accum_steps,
                           micro_batches_from="training.batch_tokens ÷ (micro_batch_size × seq_len × dp)",
                           dp=par.dp, zero=par.zero, recompute=t.recompute)
    if o.lr <= 0:
        p.append(f"optim.lr must be positive, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        p.append(f"optim.min_lr_ratio must lie in [0, 1], got {o.min_lr_ratio}")
    if not 0 < o.decay_fraction <= 1:
        p.append(f"optim.decay_fraction must lie in (0, 1], got {o.decay_fraction}")
    if o.warmup_steps < 0:
        p.append(f"optim.warmup_steps must be ≥ 0, got {o.warmup_steps}")
    if not 0 <= cfg.data.held_out_fraction < 1:
        p.append(f"data.held_out_fraction must lie in [0, 1), got {cfg.data.held_out_fraction}")
    if t.grad_clip < 0:
        p.append(f"training.grad_clip must be ≥ 0 (0 disables clipping), got {t.grad_clip}")
    if cfg.checkpoint.keep < 1:
        p.append(f"checkpoint.keep must be ≥ 1, got {cfg.checkpoint.keep}")
    if p:
        raise ConfigError(p)


def from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a config saved with `to_dict` (e.g. inside a checkpoint)."""
    cfg = Config()
    problems: list[str] = []
    for section, table in data.items():
        for key, value in table.items():
            set_field(cfg, section, key, value, problems)
    if problems:
        raise ConfigError(problems)
    resolve_model(cfg.model)
    return cfg
