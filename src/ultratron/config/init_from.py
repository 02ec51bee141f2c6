"""`model.init_from`: a run that starts from saved weights takes their model from the config.toml
saved with them, so `ultratron train --model.init_from runs/imported` needs no model fields.

The weights' model is read from the checkpoint's config.toml (no weights are read), found as
`checkpoint.store.resolve_checkpoint_dir` finds a checkpoint on local disk: a checkpoint
directory, or a run or checkpoints directory whose `latest` one is meant. The config sits below
the checkpoint layer, so those few rules are restated here (tests/test_init_from_shape.py checks
that both find the same checkpoint).

Two kinds of model field come from there, each unless the user set it (in the --config file, as a
--model.X flag, or through an explicit model.preset):

  SHAPE    the tensors' sizes; a different value set by the user cannot load the weights, so it
           is a ConfigError that names both shapes.
  OPTIONS  what the weights compute with (RoPE, norms, soft caps, routing); a value set by the
           user wins (a longer context, say).

The rest of [model] (init_std, moe_aux_loss, moe_bias_update, moe_capacity_factor) are choices of
the training run, not of the weights: they keep the user's values or the defaults.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from ultratron.config.loader import coerce, parse_overrides, type_hints
from ultratron.errors import ConfigError
from ultratron.models.presets import PRESETS, ModelShape

SHAPE = ("family", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "tie_embeddings",
         "qk_norm", "qkv_bias", "n_experts", "n_shared_experts", "expert_ffn_dim", "n_dense_layers")
OPTIONS = ("rope_theta", "rope_scaling", "rope_scaling_params", "max_seq_len", "norm_eps", "attn_softcap",
           "final_softcap", "n_active_experts", "router_score", "router_norm_topk", "sliding_window",
           "sliding_window_pattern")
# Described in every error; the other shape fields only where they are not at their defaults.
CORE = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
MARKER, LATEST = "complete", "latest"  # checkpoint/store.py's names
MOE = ("n_shared_experts", "expert_ffn_dim", "n_dense_layers")  # shape fields that only experts have
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelShape)} | {"qkv_bias": False}


def chosen_fields(path: str | Path | None, data: dict[str, Any], overrides: list[str] | None,
                  base: Any = None) -> dict[str, str]:
    """The [model] fields the user set → where: in the config file `data` (read from `path`), as
    --model.X flags, or (`base`, a config built by the caller) those not at their defaults."""
    chosen: dict[str, str] = {}
    if base is not None:
        fresh = type(base)()
        chosen |= {f.name: "the given config" for f in dataclasses.fields(base)
                   if getattr(base, f.name) != getattr(fresh, f.name)}
    table = data.get("model")
    chosen |= {key: str(path) for key in (table if isinstance(table, dict) else {})}
    chosen |= {key: f"--model.{key}" for section, key, _ in parse_overrides(overrides or []) if section == "model"}
    return chosen


def adopt_init_from(model: Any, chosen: dict[str, str]) -> list[str]:
    """Give `model` (a ModelConfig, before its preset is applied) the SHAPE and OPTIONS of
    model.init_from's model where `chosen` does not name them; the problems, one line each: a
    shape the user set that is not the weights', or an init_from whose model cannot be read."""
    if not model.init_from:
        return []
    chosen = {name: where for name, where in chosen.items() if getattr(model, name) is not None}  # none: unset
    try:
        theirs = saved_model(model.init_from, type(model))
    except ConfigError as err:
        # With every field set (a run's saved config.toml) nothing is needed from there: a copy of a
        # fine-tuned run loads for inference without the weights it started from.
        return err.problems if any(n not in chosen for n in SHAPE + OPTIONS) else []
    preset = PRESETS.get(model.preset) if "preset" in chosen else None
    yours, origin = dict(theirs), {}
    for name in SHAPE:
        if name in chosen:
            yours[name], origin[name] = getattr(model, name), chosen[name]
        elif preset is not None and hasattr(preset, name):
            yours[name], origin[name] = getattr(preset, name), "preset"
    differ = [n for n in origin if _differs(yours, theirs, n)]
    problems = []
    mine = [n for n in differ if origin[n] != "preset"]
    if mine:
        said = ", ".join(f"model.{n}={_text(yours[n])} ({origin[n]})" for n in mine)  # as set
        drop = ", ".join(f"--model.{n}" if origin[n].startswith("--") else f"model.{n} in {origin[n]}" for n in mine)
        problems.append(f"{said} but {_holds(model.init_from, theirs, mine)}: its shape is {_shape(theirs, yours)}, "
                        f"yours {_shape(yours, theirs)}; drop {drop} to take its shape, or pick weights of yours")
    by_preset = [n for n in differ if origin[n] == "preset"]
    if by_preset:
        problems.append(f"model.preset={model.preset} ({chosen['preset']}) gives {_values(yours, by_preset)} but "
                        f"{_holds(model.init_from, theirs, by_preset)}: its shape is {_shape(theirs, yours)}, "
                        f"yours {_shape(yours, theirs)}; drop model.preset to take its shape, or pick weights of yours")
    for name in SHAPE + OPTIONS:
        if name not in chosen:
            setattr(model, name, theirs[name])
    if "rope_scaling_params" not in chosen and model.rope_scaling != theirs["rope_scaling"]:
        model.rope_scaling_params = {}  # another scaling than the weights': its own numbers, set by the user
    if "preset" not in chosen:
        model.preset = None  # every shape field is set: the weights', not a preset's
    return problems


def saved_checkpoint(init_from: str | Path) -> Path:
    """The checkpoint directory `init_from` means (local disk, as `resolve_checkpoint_dir`)."""
    path = Path(init_from)
    if (path / MARKER).is_file():
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir() and (found := _latest(root)) is not None:
            return found
    if path.name == LATEST and path.parent.is_dir() and (found := _latest(path.parent)) is not None:
        return found
    if not path.exists():
        raise ConfigError(f"model.init_from: checkpoint {str(path)!r} does not exist")
    raise ConfigError(f"model.init_from: {path} is not a complete checkpoint (no '{MARKER}' marker) and holds none")


def saved_model(init_from: str | Path, cls: type) -> dict[str, Any]:
    """The SHAPE and OPTIONS of the model in `init_from`'s config.toml; `cls`: the ModelConfig class
    (its types and defaults). Fields it leaves out: its preset's, else the defaults."""
    toml = saved_checkpoint(init_from) / "config.toml"
    where = f"model.init_from {init_from}: {toml}"
    try:
        table = tomllib.loads(toml.read_text(encoding="utf-8")).get("model", {})
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist, so the shape of its model is unknown") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{where} cannot be read: {err}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: 'model' is not a [model] table")
    hints, defaults = type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    preset = PRESETS.get(table.get("preset")) if isinstance(table.get("preset"), str) else None
    model, problems = {}, []
    for name in SHAPE + OPTIONS:
        if name in table:
            try:
                model[name] = coerce(table[name], hints[name], f"{where}: model.{name}")
            except ValueError as err:
                problems.append(str(err))
        elif preset is not None and hasattr(preset, name):
            model[name] = getattr(preset, name)
        elif name in DEFAULTS:
            model[name] = DEFAULTS[name]
        else:
            own = defaults[name]
            model[name] = own.default_factory() if own.default_factory is not dataclasses.MISSING else own.default
    missing = [f"model.{n}" for n, v in model.items() if v is dataclasses.MISSING]
    if missing:
        problems.append(f"{where} does not give {', '.join(missing)}")
    if problems:
        raise ConfigError(problems)
    return model


def _latest(root: Path) -> Path | None:
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        if (named / MARKER).is_file():
            return named
    done = sorted(p.name for p in root.iterdir() if p.name.startswith("step-") and (p / MARKER).is_file())
    return root / done[-1] if done else None


def _size(model: dict[str, Any], name: str) -> Any:
    """A shape field as the tensors see it: head_dim 0 is dim / n_heads, expert_ffn_dim 0 is ffn_dim;
    None: the experts' fields of a model without experts."""
    if name in MOE and not model["n_experts"]:
        return None
    if name == "head_dim":
        return model["head_dim"] or model["dim"] // max(1, model["n_heads"])  # (n_heads 0: refused later)
    if name == "expert_ffn_dim":
        return model["expert_ffn_dim"] or model["ffn_dim"]
    return model[name]


def _differs(a: dict[str, Any], b: dict[str, Any], name: str) -> bool:
    """Whether the tensors of shape field `name` differ (the experts' fields of models that both have experts)."""
    x, y = _size(a, name), _size(b, name)
    return x is not None and y is not None and x != y


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _values(model: dict[str, Any], names: list[str]) -> str:
    return ", ".join(f"{n} {_text(_size(model, n))}" for n in names)


def _holds(init_from: str, theirs: dict[str, Any], names: list[str]) -> str:
    return f"model.init_from {init_from} holds a model with {_values(theirs, names)}"


def _shape(model: dict[str, Any], other: dict[str, Any]) -> str:
    """The shape fields of `model` that tell it from `other`: the CORE ones always, the others where
    either is not at its default or they differ."""
    shown = [n for n in SHAPE if n in CORE or _size(model, n) is not None and (
        _size(model, n) != _size(other, n) or model[n] != DEFAULTS[n] or other[n] != DEFAULTS[n])]
    return _values(model, shown)
