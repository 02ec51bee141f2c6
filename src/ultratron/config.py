"""Typed configuration: one dataclass per section, TOML files, `--section.field value` overrides.

Everything is validated before any data is read or any process group starts. Problems are
collected and reported together, one line each, as a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ultratron.errors import UserError
from ultratron.models.presets import PRESETS


class ConfigError(UserError):
    """A configuration the user can fix. `problems` holds one line per problem."""


@dataclass
class ModelConfig:
    # A preset fills every shape field left unset (None); explicit fields win over the preset.
    preset: str | None = "tiny"
    n_layers: int | None = None
    dim: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    rope_theta: float | None = None
    norm_eps: float = 1e-5
    qk_norm: bool = False
    # Gemma-2 style soft caps: cap * tanh(x / cap); 0 disables.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    init_std: float = 0.02


@dataclass
class ParallelConfig:
    dp: int = 1
    # HSDP: dp = dp_replicate × dp_shard; shard within groups of dp/dp_replicate ranks, replicate across.
    dp_replicate: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    cp: int = 1
    ep: int = 1


@dataclass
class TrainingConfig:
    steps: int = 200
    # The global batch is fixed in tokens; gradient accumulation is derived from it.
    batch_tokens: int = 8192
    micro_batch_size: int = 8
    seq_len: int = 256
    precision: str = "fp32"  # "fp32" | "bf16" (bf16 autocast compute, fp32 master weights)
    grad_clip: float = 1.0  # global-norm clipping; 0 disables (the norm is still logged)
    z_loss: float = 0.0  # PaLM z-loss coefficient (1e-4 in Chowdhery et al. 2022); 0 disables
    seed: int = 0
    recompute: str = "none"  # "none" | "selective" | "full"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    # Stop (with a checkpoint) after this many steps of this invocation, e.g. to fit a job's
    # time limit; the schedule still follows `steps`. 0: run to `steps`.
    stop_after: int = 0
    log_interval: int = 1
    sample_tokens: int = 120  # a short sample at the end; 0 disables
    progress: bool = True


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the floor of the decay, as a fraction of lr
    warmup_steps: int = 20
    schedule: str = "cosine"  # "cosine" | "wsd" | "constant"
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly to the floor
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class DataConfig:
    # None: the built-in corpus (the running interpreter's standard library). Otherwise a
    # directory of text files, a text file, a JSONL file with a "text" field, or a prepared
    # directory (tokenizer.json + train/ [+ val/] shards, as `ultratron data run` writes it).
    path: str | None = None
    tokenizer: str | None = None  # a tokenizer.json to load instead of training one
    held_out_fraction: float = 0.05  # share of files kept for validation, chosen by file hash
    max_bytes: int = 0  # stop reading the corpus after this many bytes; 0 reads everything
    cache_dir: str | None = None  # where tokenizer and shards go; default RUN_DIR/data
    extensions: str = ".py,.txt,.md,.rst,.jsonl,.json"  # files read from a directory


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (and at the end); 0: only at the end
    resume: str = "none"  # "none" | "auto" (latest in the run directory) | a checkpoint directory
    keep: int = 3  # newest checkpoints kept; older ones are deleted


@dataclass
class EvalConfig:
    interval: int = 50  # validation loss on the held-out split every N steps (and at the end)
    batches: int = 8  # micro-batches per validation
    # Task evaluation (ultratron.evaluation) in a separate process every N steps; 0 disables.
    task_interval: int = 0
    tasks: str = "builtin"  # comma-separated: builtin, built-in task names, task files
    max_examples: int = 100  # per task
    # An OpenAI-compatible base URL: the periodic evaluations run through it (default: the local weights)
    endpoint: str | None = None
    endpoint_model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key
    concurrency: int = 4  # requests in flight to the endpoint
    timeout: float = 60.0  # seconds per request
    max_retries: int = 3  # per request, with exponential backoff (the openai client's)
    price_per_request: float = 0.0
    price_per_1k_prompt_tokens: float = 0.0
    price_per_1k_completion_tokens: float = 0.0
    final_wait: float = 300.0  # seconds the end of training waits for the last task evaluation


@dataclass
class RunConfig:
    dir: str = "runs/default"
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def dp_world(self) -> int:
        return self.parallel.dp

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.training.micro_batch_size * self.training.seq_len

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return self.training.batch_tokens // (self.tokens_per_micro_batch * self.dp_world)


SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # section name → its dataclass

CHOICES = {
    ("training", "precision"): ("fp32", "bf16"),
    ("training", "recompute"): ("none", "selective", "full"),
    ("training", "device"): ("auto", "cpu", "cuda"),
    ("optim", "schedule"): ("cosine", "wsd", "constant"),
}


# ---- parsing -------------------------------------------------------------------------------

def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def did_you_mean(name: str, options: list[str]) -> str:
    """' (did you mean X?)' for the closest option, or '' when none is close."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    name = getattr(base, "__name__", str(base))
    return name + (" or none" if args else "")


def _coerce(value: Any, tp: Any, where: str, from_string: bool) -> Any:
    """Convert a TOML value or a command-line string to the field's type, or raise ValueError."""
    optional = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    base = [a for a in typing.get_args(tp) if a is not type(None)][0] if optional else tp
    if from_string and isinstance(value, str):
        text = value.strip()
        if optional and text.lower() in ("none", "null", ""):
            return None
        if base is bool:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        if base is int:
            try:
                return int(text.replace("_", ""))
            except ValueError:
                try:
                    as_float = float(text)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
                raise ValueError(f"{where}: expected an integer, got {value!r}") from None
        if base is float:
            try:
                return float(text)
            except ValueError:
                raise ValueError(f"{where}: expected a number, got {value!r}") from None
        return text
    if value is None and optional:
        return None
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if base is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where}: expected a string, got {value!r}")
    origin = typing.get_origin(base)
    if origin is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ValueError(f"{where}: expected a list of strings, got {value!r}")
    if origin is dict:
        if isinstance(value, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           for v in value.values()):
            return {str(k): float(v) for k, v in value.items()}
        raise ValueError(f"{where}: expected a table of numbers, got {value!r}")
    return value


def _apply(cfg: Any, section: str, key: str, value: Any, from_string: bool, problems: list[str],
           sections: dict[str, type] = SECTIONS) -> None:
    if section not in sections:
        problems.append(f"unknown config section {section!r}{did_you_mean(section, list(sections))}")
        return
    types_ = _field_types(sections[section])
    if key not in types_:
        problems.append(f"unknown config field '{section}.{key}'{did_you_mean(key, list(types_))}")
        return
    try:
        setattr(getattr(cfg, section), key, _coerce(value, types_[key], f"{section}.{key}", from_string))
    except ValueError as err:
        problems.append(str(err))


def apply_tables(cfg: Any, data: dict[str, Any], problems: list[str], sections: dict[str, type] = SECTIONS,
                 source: str = "") -> None:
    """Set the fields of `cfg` (a dataclass of section dataclasses, described by `sections`) from
    a parsed TOML document, adding one line to `problems` per unknown or ill-typed entry. Shared
    by every typed config in ultratron (the trainer's and the data pipeline's)."""
    prefix = f"{source}: " if source else ""
    for section, table in data.items():
        if not isinstance(table, dict):
            problems.append(f"{prefix}'{section}' must be a [section] table, got a value")
            continue
        for key, value in table.items():
            _apply(cfg, section.replace("-", "_"), key, value, False, problems, sections)


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.field value` or `--section.field=value` pairs → (section, field, raw value)."""
    out: list[tuple[str, str, str]] = []
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            problems.append(f"unexpected argument {arg!r}: overrides look like --section.field value")
            i += 1
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and "." in args[i + 1][2:].split("=")[0]):
                problems.append(f"--{name} needs a value")
                i += 1
                continue
            value = args[i + 1]
            i += 1
        i += 1
        section, _, key = name.partition(".")
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
    if problems:
        raise ConfigError(problems)
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: Config | None = None) -> Config:
    """Read a TOML file (optional), apply dotted overrides, fill preset fields and validate."""
    cfg = base if base is not None else Config()
    problems: list[str] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {str(path)!r} does not exist"])
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError([f"{path}: not valid TOML: {err}"]) from None
        apply_tables(cfg, data, problems, source=str(path))
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value, True, problems)
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
            raise ConfigError([
                f"model.preset: unknown preset {model.preset!r}{did_you_mean(model.preset, list(PRESETS))}; "
                f"known: {', '.join(PRESETS)}"
            ])
        preset = PRESETS[model.preset]
        for name in shape_fields:
            if getattr(model, name) is None:
                setattr(model, name, getattr(preset, name))
    missing = [f"model.{n}" for n in shape_fields if getattr(model, n) is None]
    if missing:
        raise ConfigError([f"model.preset is none, so these must be set: {', '.join(missing)}"])


def validate(cfg: Config) -> None:
    p: list[str] = []
    m, t, par, o = cfg.model, cfg.training, cfg.parallel, cfg.optim
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            p.append(f"{section}.{key}: {value!r} is not one of {', '.join(allowed)}")
    positive = {
        "model.n_layers": m.n_layers, "model.dim": m.dim, "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.n_kv_heads, "model.ffn_dim": m.ffn_dim, "model.vocab_size": m.vocab_size,
        "model.max_seq_len": m.max_seq_len, "training.steps": t.steps, "training.batch_tokens": t.batch_tokens,
        "training.micro_batch_size": t.micro_batch_size, "training.seq_len": t.seq_len,
        "parallel.dp": par.dp, "parallel.tp": par.tp, "parallel.pp": par.pp, "parallel.cp": par.cp,
        "parallel.ep": par.ep,
    }
    for name, value in positive.items():
        if value is not None and value <= 0:
            p.append(f"{name} must be positive, got {value}")
    if p:
        raise ConfigError(p)
    if m.dim % m.n_heads:
        p.append(f"model.n_heads={m.n_heads} does not divide model.dim={m.dim}")
    elif (m.dim // m.n_heads) % 2:
        p.append(f"head dimension {m.dim // m.n_heads} (dim/n_heads) must be even for rotary embeddings")
    if m.n_heads % m.n_kv_heads:
        p.append(f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads} "
                 f"(grouped-query attention shares each kv head among n_heads/n_kv_heads query heads)")
    if t.seq_len > m.max_seq_len:
        p.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    micro = cfg.tokens_per_micro_batch * par.dp
    if t.batch_tokens % micro:
        lower = max(micro, t.batch_tokens // micro * micro)
        p.append(
            f"training.batch_tokens={t.batch_tokens} is not divisible by micro_batch_size × seq_len × dp = "
            f"{t.micro_batch_size} × {t.seq_len} × {par.dp} = {micro}; try {lower} or {lower + micro}"
        )
    if par.zero not in (0, 1, 2, 3):
        p.append(f"parallel.zero must be 0, 1, 2 or 3, got {par.zero}")
    if m.n_heads % par.tp or m.n_kv_heads % par.tp:
        p.append(f"parallel.tp={par.tp} does not divide model.n_heads={m.n_heads} and "
                 f"model.n_kv_heads={m.n_kv_heads}")
    if par.pp > m.n_layers:
        p.append(f"parallel.pp={par.pp} exceeds model.n_layers={m.n_layers}")
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


# ---- writing -------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML. Unset (None) fields are written as comments."""
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"# {key} = none" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in SECTIONS}


def from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a config saved with `to_dict` (e.g. inside a checkpoint)."""
    cfg = Config()
    problems: list[str] = []
    for section, table in data.items():
        for key, value in table.items():
            _apply(cfg, section, key, value, False, problems)
    if problems:
        raise ConfigError(problems)
    resolve_model(cfg.model)
    return cfg
