"""The one config mechanism of ultratron: dataclasses in, TOML and command-line flags out.

A config is a dataclass whose fields are *section* dataclasses (the trainer's `Config`, the
curation pipeline's `DataPipelineConfig`), or one flat dataclass (the settings of `ultratron
eval` and `ultratron serve`). Fields carry their help text and allowed values in metadata
(`option(...)`), so `--help`, validation of choices and the did-you-mean errors all come from
the definition, written once.

  sections:  TOML tables and `--section.field value` overrides  (read_toml, apply_tables, apply_overrides)
  flat:      argparse flags `--field-name value`                 (add_arguments, from_arguments, to_flags)

The field definitions themselves (`option`, `field_problems`, `take_fields`) are in
`ultratron/fields.py`, below every layer, so the model shape and the planner's layout use them too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from ultratron.errors import ConfigError
from ultratron.fields import MISSING, did_you_mean, field_problems


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, evaluated once per class (it compiles every annotation string
    anew on each call, which made loading one config cost ~50 ms). Read-only: callers never modify it."""
    return typing.get_type_hints(cls)


def sections_of(cfg_or_cls: Any) -> dict[str, type]:
    """Section name → its dataclass, for a dataclass of section dataclasses."""
    return type_hints(cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls))


# ---- values --------------------------------------------------------------------------------

def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    optional = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    if not optional:
        return tp, False
    return [a for a in typing.get_args(tp) if a is not type(None)][0], True


def _from_string(text: str, base: Any, optional: bool, where: str) -> Any:
    text = text.strip()
    if optional and text.lower() in ("none", "null", ""):
        return None
    if base is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{where}: expected true or false, got {text!r}")
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
            raise ValueError(f"{where}: expected an integer, got {text!r}") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {text!r}") from None
    if typing.get_origin(base) is list:
        return [item.strip() for item in text.split(",") if item.strip()]
    if typing.get_origin(base) is dict:  # KEY=NUMBER,KEY=NUMBER
        table = {}
        for item in (i.strip() for i in text.split(",") if i.strip()):
            key, eq, number = item.partition("=")
            try:
                table[key.strip()] = float(number)
            except ValueError:
                raise ValueError(f"{where}: expected KEY=NUMBER pairs separated by commas, got {text!r}") from None
            if not eq or not key.strip():
                raise ValueError(f"{where}: expected KEY=NUMBER pairs separated by commas, got {text!r}")
        return table
    return text


def coerce(value: Any, tp: Any, where: str, from_string: bool = False) -> Any:
    """A TOML value (or, with from_string, a command-line string) as the field's type; ValueError if not."""
    base, optional = _base_type(tp)
    if from_string and isinstance(value, str):
        return _from_string(value, base, optional, where)
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


# ---- sections: TOML tables and --section.field overrides --------------------------------------

def set_field(cfg: Any, section: str, key: str, value: Any, problems: list[str], from_string: bool = False,
              prefix: str = "") -> None:
    """Set `section.key`; an unknown name or a bad value adds one line (after `prefix`) to `problems`."""
    sections = sections_of(cfg)
    if section not in sections:
        problems.append(f"{prefix}unknown config section {section!r}{did_you_mean(section, list(sections))}")
        return
    hints = type_hints(sections[section])
    if key not in hints:
        problems.append(f"{prefix}unknown config field '{section}.{key}'{did_you_mean(key, list(hints))}")
        return
    try:
        setattr(getattr(cfg, section), key, coerce(value, hints[key], f"{section}.{key}", from_string))
    except ValueError as err:
        problems.append(f"{prefix}{err}")


def apply_tables(cfg: Any, data: dict[str, Any], problems: list[str], source: str = "") -> None:
    """Set the fields of `cfg` from a parsed TOML document; one problem line per bad entry."""
    prefix = f"{source}: " if source else ""
    for section, table in data.items():
        if not isinstance(table, dict):
            problems.append(f"{prefix}'{section}' must be a [section] table, got a value")
            continue
        for key, value in table.items():
            set_field(cfg, section.replace("-", "_"), key, value, problems, prefix=prefix)


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.field value` or `--section.field=value` → (section, field, raw value)."""
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


def apply_overrides(cfg: Any, overrides: list[str], problems: list[str]) -> None:
    for section, key, value in parse_overrides(overrides):
        set_field(cfg, section, key, value, problems, from_string=True)


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def build(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
          data: dict[str, Any] | None = None) -> Any:
    """A sectioned config: defaults, then a TOML file and/or a parsed dict, then overrides."""
    cfg = cls()
    problems: list[str] = []
    if path is not None:
        apply_tables(cfg, read_toml(path), problems, source=str(path))
    if data is not None:
        apply_tables(cfg, data, problems)
    apply_overrides(cfg, overrides or [], problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def choice_problems(cfg: Any) -> list[str]:
    """Fields whose value is not among their declared choices or below their declared minimum
    (sectioned or flat configs), named as the user writes them (`section.field`)."""
    if not all(dataclasses.is_dataclass(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)):
        return field_problems(cfg)
    return [line for section in sections_of(cfg)
            for line in field_problems(getattr(cfg, section), lambda field, s=section: f"{s}.{field}")]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + " }"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def to_toml(cfg: Any) -> str:
    """A sectioned config as TOML; unset (None) fields are written as comments."""
    lines: list[str] = []
    for section in sections_of(cfg):
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"# {key} = none" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Any) -> dict[str, dict[str, Any]]:
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in sections_of(cfg)}


def describe_fields(cls: type) -> str:
    """Every field of a sectioned config as `--section.field (default): help`, for --help."""
    lines = []
    for section, section_cls in sections_of(cls).items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(section_cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            lines.append(f"  --{section}.{f.name} ({_toml_value(default) if default is not None else 'none'})"
                         + (f": {f.metadata['help']}" if f.metadata.get("help") else ""))
    return "\n".join(lines)


# ---- flat settings: argparse flags --------------------------------------------------------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, unset: bool = False,
                  text: bool = False, required: tuple[str, ...] = ()) -> None:
    """One flag per field of a flat settings dataclass (`--field-name`, and the field's extra `flags`),
    typed, with its help and default. `unset`: every default is None, so the caller tells a flag
    given from one left out; `text`: values other than true/false stay text for the caller to parse
    (comma lists, say, with `coerce`); `required`: fields that must be given."""
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        base, _ = _base_type(hints[f.name])
        names = [_flag(f.name), *f.metadata.get("flags", ())]
        own_default = None if f.default is MISSING and f.default_factory is MISSING else (
            f.default if f.default is not MISSING else f.default_factory())
        must = f.name in required or (not unset and f.default is MISSING and f.default_factory is MISSING)
        default = None if unset or must else own_default
        text_help = f.metadata.get("help", "")
        if base is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=text_help)
            continue
        shown = "" if must or unset or own_default in (None, "") else f" (default {own_default})"
        if text and f.metadata.get("choices"):  # (argparse would list them, had it the values to check)
            shown = f" ({', '.join(map(str, f.metadata['choices']))}){shown}"
        kwargs: dict[str, Any] = {"dest": f.name, "help": text_help + shown, "required": must}
        if not must:
            kwargs["default"] = None if default is None else str(default) if text else default
        if base in (int, float) and not text:
            kwargs["type"] = base
        if f.metadata.get("choices") and not text:
            kwargs["choices"] = list(f.metadata["choices"])
        parser.add_argument(*names, **kwargs)


def from_arguments(cls: type, namespace: argparse.Namespace) -> Any:
    """The settings dataclass from parsed flags (fields absent from the namespace keep their default)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


def to_flags(settings: Any) -> list[str]:
    """The command-line flags that rebuild `settings` (e.g. for a child process); None fields are left out."""
    out: list[str] = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(_flag(f.name) if value else _flag("no_" + f.name))
        else:
            out += [_flag(f.name), ",".join(value) if isinstance(value, list) else str(value)]
    return out


def settings_from(cls: type, source: Any) -> Any:
    """The fields of `cls` taken from another dataclass that has them (a config section)."""
    return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})
