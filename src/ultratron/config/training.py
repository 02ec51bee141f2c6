"""The training run's config: one dataclass per section, read from TOML and `--section.field` flags.

Everything is validated before any data is read or any process group starts. Problems are
collected and reported together, one line each, as a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ultratron.config.data import DataConfig
from ultratron.config.endpoint import EndpointConfig
from ultratron.config.init_from import adopt_init_from, chosen_fields
from ultratron.config.loader import (
    apply_overrides,
    apply_tables,
    choice_problems,
    did_you_mean,
    read_toml,
)
from ultratron.config.precision import TRAINER_PRECISION, resolve_precision
from ultratron.config.training_rules import document_problems, fp8_problems, profile_problems, ramp_problems
from ultratron.data.mixture_spec import parse_mixture
from ultratron.errors import ConfigError
from ultratron.fields import option, take_fields, taken_from
from ultratron.models.presets import ATTENTION_BACKENDS, PRESETS, ModelShape
from ultratron.planning.layout import PARALLEL_FIELDS, STEP_FIELDS, Layout, check_layout
from ultratron.planning.rules import config_name, shape_problems, trainer_limits

ROPE_SCALINGS = ("none", "linear", "llama3")
# The numbers each RoPE scaling needs (Llama 3.1's config.json names them so).
ROPE_SCALING_PARAMS = {"none": (), "linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass
@take_fields(ModelShape, tuple(f.name for f in dataclasses.fields(ModelShape)), after="preset", optional=True)
class ModelConfig:
    """The shape fields (n_layers, dim, ... router_score) are `models.presets.ModelShape`'s, defined
    there once. A preset fills every shape field left unset (None); explicit fields win over it."""

    preset: str | None = option("tiny", "a named shape (tiny, llama3-1b/3b/8b/70b/405b; mixtures of experts: moe-tiny, "
                                        "mixtral-8x7b, qwen3-30b-a3b, deepseek-v3-like); explicit fields win")
    router_norm_topk: bool = option(True, "rescale the chosen experts' scores to sum to 1; false: raw scores")
    moe_aux_loss: float = option(0.01, "load-balancing loss α·E·Σ f_i·P_i (Switch Transformer: α 0.01); 0 disables")
    moe_bias_update: float = option(0.0, "DeepSeek-V3's balancing bias moves by this per step toward even load "
                                         "(0.001 there); 0 disables")
    moe_capacity_factor: float = option(0.0, "an expert takes this × an even share of a micro-batch's tokens, the "
                                             "rest skip it (dropped); 0: dropless")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    attn_softcap: float = option(0.0, "Gemma-2 attention-logit soft cap cap·tanh(x/cap); 0 disables")
    attention: str = option("auto", "attention kernel: flex (FlexAttention; GPU, or CPU inference), sdpa, auto "
                                    "(flex on a GPU for masks); docs/performance.md", choices=ATTENTION_BACKENDS)
    final_softcap: float = option(0.0, "Gemma-2 final-logit soft cap; 0 disables")
    init_std: float = option(0.02, "standard deviation of the initial weights")
    qkv_bias: bool = option(False, "biases on the query/key/value projections (Qwen2)")
    rope_scaling: str = option("none", "RoPE frequency scaling for long contexts: linear (position interpolation) "
                                       "or llama3 (Llama 3.1)", choices=ROPE_SCALINGS)
    rope_scaling_params: dict[str, float] = option(
        factory=dict, help="rope_scaling's numbers: factor (linear, llama3); low_freq_factor, high_freq_factor, "
                           "original_max_position_embeddings (llama3)")
    init_from: str | None = option(None, "start from these weights at step 0 (a checkpoint or run directory, e.g. "
                                         "what `ultratron import hf` wrote; under LoRA the frozen model). Its "
                                         "config.toml gives the model fields not set by --config or --model.X (the "
                                         "shape, RoPE, norms, max_seq_len; a shape field set otherwise is refused), "
                                         "and its tokenizer is used unless data.tokenizer is set")


@dataclass
@take_fields(Layout, PARALLEL_FIELDS)
class ParallelConfig:
    """The layout's parallel fields — dp, dp_replicate, zero, tp, sp, pp and its schedule, virtual
    stages, split and balance, cp, ep — are `planning.layout.Layout`'s, defined there once."""

    cp_attention: str = option("ring", "how context-parallel attention reaches the other ranks' keys and values: "
                                       "ring (K/V passed round, overlapped with compute) or allgather (Llama 3)",
                               choices=("ring", "allgather"))
    collective_timeout: float = option(300.0, "seconds a collective waits for every rank; then each rank writes its "
                                              "flight record to RUN_DIR/flight and the job stops (ultratron doctor "
                                              "RUN_DIR names the rank it waited on). PyTorch's own default is 30 min",
                                       minimum=1.0)


# The layout's step fields (defined in planning/layout.py) with the trainer's defaults (precision: auto)
@dataclass
@take_fields(Layout, STEP_FIELDS, after="batch_tokens", micro_batch_size=8, seq_len=256, **TRAINER_PRECISION)
class TrainingConfig:
    """`micro_batch_size`, `seq_len`, `precision`, `fp8_scaling`, `recompute`, `compile`, `loss_chunk` and
    `offload_activations` are the layout's (`planning.layout`);
    its gradient accumulation is derived from `batch_tokens` (`Config.grad_accum_steps`)."""

    steps: int = option(200, "optimizer steps", minimum=1)
    batch_tokens: int = option(8192, "global batch in tokens; gradient accumulation is derived from it", minimum=1)
    batch_ramp: dict[str, float] = option(
        factory=dict, help="grow the batch from start=TOKENS to batch_tokens over the first tokens=N (GPT-3: 32k "
                           "over 4-12B), in whole micro-batches; the run then lasts steps × batch_tokens tokens "
                           "and the LR schedule follows tokens")
    grad_clip: float = option(1.0, "global-norm clipping; 0 disables (the norm is still logged)")
    z_loss: float = option(0.0, "PaLM z-loss coefficient (1e-4 in Chowdhery et al. 2022); 0 disables")
    seed: int = option(0, "seeds the weights, the data order and sampling")
    cpu_linear: str = option("aten", "fp32 linear layers on a CPU: aten (torch's own), or opt in to onednn (oneDNN's "
                                     "matmul, up to 2x torch's MKL sgemm on AMD CPUs; refused with the reason where "
                                     "it cannot run); docs/performance.md", choices=("aten", "onednn"))
    profile_steps: str = option("", "profile optimizer steps N..M (e.g. 5..7): a torch.profiler trace, an operator "
                                    "table and memory views per rank in RUN_DIR/profile/; empty: off")
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
class LoraConfig:
    rank: int = option(0, "train low-rank adapters of this rank on the targets, the model's own weights frozen "
                          "(start from model.init_from); 0: train every weight", minimum=0)
    alpha: float = option(16.0, "the adapters' scale is alpha / rank (Hu et al. 2021)", minimum=0)
    targets: list[str] = option(factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"],
                                help="the linear layers of each block that get adapters",
                                choices=("q", "k", "v", "o", "gate", "up", "down"))


@dataclass
class CheckpointConfig:
    interval: int = option(0, "save every N steps (and at the end); 0: only at the end")
    resume: str = option("none", "none | auto (the newest checkpoint that passes verification; falls back past "
                                 "damaged ones) | a checkpoint directory")
    keep: int = option(3, "newest checkpoints kept; older ones are deleted (never the newest verified one)")
    dir: str = option("", "where checkpoints go: a directory or an fsspec URL such as s3://bucket/prefix; "
                          "default RUN_DIR/checkpoints")
    endpoint: str = option("", "endpoint URL of an S3-compatible store (MinIO, Ceph, ...) for an s3:// dir; "
                               "credentials come from the usual AWS_* environment variables")
    async_save: bool = option(True, "write checkpoints in the background from a copy in host memory, so training "
                                    "goes on; the last save is awaited")


@dataclass
class StabilityConfig:
    skip_nonfinite: bool = option(True, "a step whose loss or gradient norm is NaN/Inf updates nothing (counted); "
                                        "false: stop with an error")
    max_skips_in_a_row: int = option(5, "more non-finite steps in a row than this roll back like a spike")
    window: int = option(20, "recent steps over which the loss noise and the grad-norm median are measured")
    min_steps: int = option(20, "steps of history before spikes are judged")
    loss_mad: float = option(6.0, "a loss above its recent level (median of the last 5 steps) + K × the noise "
                                  "(MAD of the window's step-to-step changes) is a spike; 0 disables")
    loss_min_rise: float = option(0.05, "... and above that level by at least this fraction")
    grad_factor: float = option(10.0, "a grad norm above FACTOR × its running median is a spike; 0 disables")
    max_rollbacks: int = option(3, "spikes roll back to the last good checkpoint and skip the data since; after "
                                   "this many, training stops with a report; 0: spikes are only logged")


@dataclass
class HealthConfig:
    check: bool = option(True, "health checks before training starts: GPUs via NVML (ECC, retired pages, "
                               "remapped rows, temperature, throttling, XIDs) and per-rank matmul/all-reduce timing")
    interval: float = option(0.0, "repeat the checks every N minutes of training; 0: only before the start")
    max_temperature: int = option(90, "a GPU at or above this temperature (°C) fails the check")
    straggler_factor: float = option(2.0, "a rank whose matmul or all-reduce takes more than FACTOR × the median "
                                          "of all ranks is named a straggler")
    matmul_size: int = option(0, "side of the square timing matmul; 0: 4096 on a GPU, 256 on a CPU")
    stop_on_failure: bool = option(True, "a failing GPU stops training (named in the log and in "
                                         "RUN_DIR/unhealthy-nodes.txt, which the Slurm script excludes on requeue)")


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
    wandb: bool = option(False, "also track the run in Weights & Biases (needs the wandb package)")
    wandb_project: str = option("ultratron", "W&B project")
    wandb_name: str | None = option(None, "W&B run name (default: the run directory's name)")
    wandb_tags: list[str] = option(factory=list, help="W&B tags, comma-separated on the command line")
    wandb_mode: str = option("offline", "offline: write the W&B run to disk only (no account or network; upload "
                                        "later with `wandb sync`); online; disabled",
                             choices=("offline", "online", "disabled"))
    wandb_dir: str | None = option(None, "where W&B writes its wandb/ directory (default: the run directory)")


@dataclass
class Config:
    model: ModelConfig = option(factory=ModelConfig)
    parallel: ParallelConfig = option(factory=ParallelConfig)
    training: TrainingConfig = option(factory=TrainingConfig)
    optim: OptimConfig = option(factory=OptimConfig)
    data: DataConfig = option(factory=DataConfig)
    lora: LoraConfig = option(factory=LoraConfig)
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    stability: StabilityConfig = option(factory=StabilityConfig)
    health: HealthConfig = option(factory=HealthConfig)
    eval: EvalConfig = option(factory=EvalConfig)
    run: RunConfig = option(factory=RunConfig)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.training.micro_batch_size * self.training.seq_len

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.training.batch_tokens // (self.tokens_per_micro_batch * self.parallel.dp)

    @property
    def layout(self) -> Layout:
        """The run's layout: the layout fields of [parallel] and [training], gradient accumulation
        derived from training.batch_tokens (the planner's own fields at their defaults)."""
        fields = {name: getattr(section, name) for section in (self.parallel, self.training)
                  for name in taken_from(type(section), Layout)}
        return Layout(**fields, grad_accum=self.grad_accum_steps)

    @layout.setter
    def layout(self, layout: Layout) -> None:
        """Set every layout field, and training.batch_tokens to the layout's global batch."""
        for section in (self.parallel, self.training):
            for name in taken_from(type(section), Layout):
                setattr(section, name, getattr(layout, name))
        self.training.batch_tokens = layout.dp * layout.micro_batch_size * layout.grad_accum * layout.seq_len


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: Config | None = None) -> Config:
    """Read a TOML file (optional) onto `base` or the defaults, apply dotted overrides, give the model
    fields the user did not set model.init_from's (config/init_from.py), fill preset fields and validate."""
    cfg, problems = base or Config(), []
    data = read_toml(path) if path is not None else {}
    chosen = chosen_fields(path, data, overrides, base.model if base else None)
    apply_tables(cfg, data, problems, source=str(path))
    apply_overrides(cfg, overrides or [], problems)
    if problems:
        raise ConfigError(problems)
    found = adopt_init_from(cfg.model, chosen)
    resolve_precision(cfg.training)
    try:
        resolve_model(cfg.model)
        validate(cfg)
    except ConfigError as err:
        raise ConfigError(found + err.problems) from None
    if found:
        raise ConfigError(found)
    return cfg


def resolve_model(model: ModelConfig) -> None:
    """Fill unset shape fields from the preset; with no preset every shape field must be set."""
    shape_fields = [f.name for f in dataclasses.fields(ModelShape)]
    if model.preset is not None:
        if model.preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {model.preset!r}"
                              f"{did_you_mean(model.preset, list(PRESETS))}; known: {', '.join(PRESETS)}")
        preset = PRESETS[model.preset]
        for name in shape_fields:
            if getattr(model, name) is None:
                setattr(model, name, getattr(preset, name))
    for f in dataclasses.fields(ModelShape):  # the optional ones (MoE, head_dim, ...): their defaults
        if f.default is not dataclasses.MISSING and getattr(model, f.name) is None:
            setattr(model, f.name, f.default)
    missing = [f"model.{n}" for n in shape_fields if getattr(model, n) is None]
    if missing:
        raise ConfigError(f"model.preset is none, so these must be set: {', '.join(missing)}")


def rope_scaling_problems(m: ModelConfig) -> list[str]:
    if m.rope_scaling not in ROPE_SCALING_PARAMS:
        return []  # a choice problem, reported already
    needed = ROPE_SCALING_PARAMS[m.rope_scaling]
    p = [f"model.rope_scaling={m.rope_scaling} needs model.rope_scaling_params.{k}" for k in needed
         if k not in m.rope_scaling_params]
    p += [f"model.rope_scaling_params.{k}: not used by rope_scaling={m.rope_scaling} (it takes "
          f"{', '.join(needed) or 'none'})" for k in m.rope_scaling_params if k not in needed]
    params = m.rope_scaling_params
    if "factor" in params and params["factor"] <= 0:
        p.append(f"model.rope_scaling_params.factor must be positive, got {params['factor']}")
    if m.rope_scaling == "llama3" and not p and params["high_freq_factor"] <= params["low_freq_factor"]:
        p.append("model.rope_scaling_params.high_freq_factor must exceed low_freq_factor")
    return p


def validate(cfg: Config) -> None:
    m, t, par, o = cfg.model, cfg.training, cfg.parallel, cfg.optim
    p = choice_problems(cfg)
    if p:
        raise ConfigError(p)
    p += shape_problems(m) + rope_scaling_problems(m)
    micro = cfg.tokens_per_micro_batch * par.dp
    p += check_layout(m, cfg.layout, config_name, fields=False, grad_accum_from=None if t.batch_tokens % micro else
                      "training.batch_tokens ÷ (micro_batch_size × seq_len × dp)") + trainer_limits(cfg.layout)
    if t.seq_len > m.max_seq_len:
        p.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if t.batch_tokens % micro:
        lower = max(micro, t.batch_tokens // micro * micro)
        p.append(f"training.batch_tokens={t.batch_tokens} is not divisible by micro_batch_size × seq_len × dp = "
                 f"{t.micro_batch_size} × {t.seq_len} × {par.dp} = {micro}; try {lower} or {lower + micro}")
    p += ramp_problems(cfg, micro, p) + profile_problems(t.profile_steps) + fp8_problems(cfg) + document_problems(cfg)
    if cfg.lora.rank > 0:
        if not m.init_from:
            p.append("lora.rank > 0 trains adapters on a model's own weights: give the model with "
                     "model.init_from (e.g. a run `ultratron import hf` wrote)")
        if not cfg.lora.targets:
            p.append("lora.targets is empty: name the linear layers that get adapters, e.g. q,k,v,o,gate,up,down")
        if m.n_experts:  # (and so expert parallelism, which only a mixture of experts takes)
            p.append("LoRA adapts the dense linear layers; a mixture-of-experts model (model.n_experts="
                     f"{m.n_experts}, parallel.ep={par.ep}) is not supported yet")
        if t.cpu_linear != "aten":
            p.append("LoRA adds its adapters around torch's own linear layers; use training.cpu_linear=aten")
    if cfg.data.format == "chat" and cfg.data.sources:
        p.append("data.format=chat reads data.path (conversations); data.sources (a mixture of prepared "
                 "directories) does not take it")
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
    p += parse_mixture(cfg.data.sources, cfg.data.weights, cfg.data.schedule)[1]
    if cfg.data.sources and cfg.data.path is not None:
        p.append("data.path and data.sources exclude each other: a mixture names its datasets in data.sources")
    if cfg.run.wandb and importlib.util.find_spec("wandb") is None:
        p.append("run.wandb=true needs the wandb package, which is not installed: pip install wandb")
    if cfg.checkpoint.keep < 1:
        p.append(f"checkpoint.keep must be ≥ 1, got {cfg.checkpoint.keep}")
    p += _checkpoint_dir_problems(cfg.checkpoint) + _resilience_problems(cfg)
    if p:
        raise ConfigError(p)


def _checkpoint_dir_problems(c: CheckpointConfig) -> list[str]:
    """A URL for checkpoint.dir needs an fsspec protocol that is installed (checked here, before
    any process starts, not at the first save)."""
    if "://" not in c.dir or c.dir.startswith("file://"):
        return [] if not c.endpoint else ["checkpoint.endpoint is set but checkpoint.dir is not an s3:// URL"]
    import importlib.util

    from fsspec.registry import known_implementations, registry

    protocol = c.dir.split("://", 1)[0]
    if protocol not in known_implementations and protocol not in registry:
        return [f"checkpoint.dir {c.dir!r}: unknown storage protocol {protocol!r}"
                f"{did_you_mean(protocol, list(known_implementations))}"]
    needs = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(protocol)
    if needs and importlib.util.find_spec(needs) is None:
        return [f"checkpoint.dir {c.dir!r} needs the {needs} package: pip install {needs}"]
    if c.endpoint and protocol not in ("s3", "s3a"):
        return [f"checkpoint.endpoint is for s3:// URLs, not {protocol}://"]
    return []


def _resilience_problems(cfg: Config) -> list[str]:
    s, h, p = cfg.stability, cfg.health, []
    for name in ("max_skips_in_a_row", "window", "min_steps", "max_rollbacks"):
        if getattr(s, name) < 0:
            p.append(f"stability.{name} must be ≥ 0, got {getattr(s, name)}")
    for name in ("loss_mad", "loss_min_rise", "grad_factor"):
        if getattr(s, name) < 0:
            p.append(f"stability.{name} must be ≥ 0 (0 disables), got {getattr(s, name)}")
    if s.window and s.min_steps > s.window:
        p.append(f"stability.min_steps={s.min_steps} exceeds stability.window={s.window}")
    if h.interval < 0:
        p.append(f"health.interval must be ≥ 0 minutes, got {h.interval}")
    if h.straggler_factor <= 1:
        p.append(f"health.straggler_factor must exceed 1, got {h.straggler_factor}")
    if h.matmul_size < 0:
        p.append(f"health.matmul_size must be ≥ 0 (0: automatic), got {h.matmul_size}")
    return p
