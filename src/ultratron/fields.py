"""Field definitions, written once: a dataclass field with its help, allowed values, lower bound and
extra flag names (`option`), the checks those imply (`field_problems`), and a way for another
dataclass to take a field's definition rather than restate it (`take_fields`).

It sits at the bottom of the layers (it imports nothing of ultratron) so that every layer can
define its fields with it: the model shape (`models/presets.py`), the parallel layout
(`planning/layout.py`) and every config (`config/`). The config loader turns the definitions into
TOML keys and `--section.field` flags, `ultratron plan` into its flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable
from typing import Any

MISSING = dataclasses.MISSING


def option(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, choices: tuple = (),
           flags: tuple[str, ...] = (), minimum: float | None = None) -> Any:
    """A dataclass field with its help text, allowed values, lowest allowed value and (for flags
    generated from it) extra flag names."""
    metadata = {"help": help, "choices": tuple(choices), "flags": tuple(flags), "minimum": minimum}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def did_you_mean(name: str, options: list[str]) -> str:
    """' (did you mean X?)' for the closest option, or '' when none is close."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def field_problems(obj: Any, name: Callable[[str], str] = lambda field: field) -> list[str]:
    """Fields of a dataclass instance whose value is not among their `choices` or is below their
    `minimum`, one line each; `name` turns a field's name into the name the user wrote."""
    problems = []
    for f in dataclasses.fields(obj):
        value, allowed, minimum = getattr(obj, f.name), f.metadata.get("choices", ()), f.metadata.get("minimum")
        for item in value if isinstance(value, list) else [value]:
            if item is None:
                continue
            if allowed and item not in allowed:
                problems.append(f"{name(f.name)}: {item!r} is not one of {', '.join(map(str, allowed))}"
                                f"{did_you_mean(str(item), [str(a) for a in allowed])}")
            elif minimum is not None and isinstance(item, (int, float)) and item < minimum:
                problems.append(f"{name(f.name)} must be ≥ {minimum}, got {item}")
    return problems


def take_fields(source: type, names: tuple[str, ...], *, after: str | None = None, optional: bool = False,
                meta: dict[str, dict] | None = None, **defaults: Any) -> Callable[[type], type]:
    """A class decorator, applied under `@dataclass`, that gives the class `source`'s own definitions
    of the fields `names` — type, help, choices, bounds, flags — so they are written once.

    `defaults` replace a field's default (the trainer and the planner start from different
    sequence lengths, say); `optional` makes every field `T | None` with default None (a preset
    fills it later); `meta` replaces entries of a field's metadata (a value the taking class adds to
    the choices, with its help). The fields go after the class's own field `after`, or first. Their
    metadata records `source`, so a test can tell which fields came from where (`taken_from`)."""
    hints = typing.get_type_hints(source)
    by_name = {f.name: f for f in dataclasses.fields(source)}

    def copy(name: str) -> tuple[Any, dataclasses.Field]:
        f = by_name[name]
        metadata = {**f.metadata, **(meta or {}).get(name, {}), "source": source}
        if optional:
            return hints[name] | None, dataclasses.field(default=None, metadata=metadata)
        if name in defaults:
            return hints[name], dataclasses.field(default=defaults[name], metadata=metadata)
        if f.default_factory is not MISSING:
            return hints[name], dataclasses.field(default_factory=f.default_factory, metadata=metadata)
        return hints[name], dataclasses.field(default=f.default, metadata=metadata)

    def decorate(cls: type) -> type:
        unknown = [n for n in (*names, *defaults, *(meta or {})) if n not in by_name]
        if unknown:
            raise TypeError(f"{source.__name__} has no field {', '.join(unknown)}")
        own = dict(cls.__dict__.get("__annotations__", {}))
        taken = {}
        for name in names:
            taken[name], field = copy(name)
            setattr(cls, name, field)
        if after is None:
            cls.__annotations__ = taken | own
        else:
            keys = list(own)
            cut = keys.index(after) + 1
            cls.__annotations__ = {k: own[k] for k in keys[:cut]} | taken | {k: own[k] for k in keys[cut:]}
        return cls

    return decorate


def taken_from(cls: type, source: type) -> list[str]:
    """The fields of dataclass `cls` whose definition is `source`'s (see `take_fields`)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("source") is source]
