"""The config loader's typed building blocks: a dataclass from a mapping, with one-paragraph errors naming the
key, the bad value and the valid choices. rlhf.config builds the run's Config with them; a task builds its
own options (`task.options`, rlhf.tasks.task_options) with the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from rlhf.errors import ConfigError


def build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """An instance of dataclass `cls` from the mapping `raw`: defaults for what it leaves out, ConfigError for
    an unknown key or a value of the wrong type (named as `prefix` + key)."""
    return _build(cls, raw, prefix)


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    obj = cls()
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        _check_key(obj, key, prefix)
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {prefix + key!r} is a section; got {value!r}.")
            setattr(obj, key, _build(hints[key], value, f"{prefix}{key}."))
        else:
            setattr(obj, key, _coerce(value, hints[key], prefix + key))
    return obj


def _check_key(node: Any, key: str, prefix: str) -> None:
    names = [f.name for f in dataclasses.fields(node)]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
        section = f"section {prefix[:-1]!r}" if prefix else "the top level"
        raise ConfigError(f"unknown config key {prefix + key!r}.{hint} Valid keys in {section}: {', '.join(names)}.")


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a field's type; ints are accepted where floats are expected."""
    if dataclasses.is_dataclass(hint):
        raise ConfigError(f"config key {key!r} is a section; set its fields instead (e.g. {key}.<field>=...).")
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key {key!r} cannot be empty (null).")
    base = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(base) is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} expects a list (e.g. [a, b]), got {value!r}.")
        (item,) = typing.get_args(base)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if base is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} expects a mapping of keys to values, got {value!r}.")
        return dict(value)
    if base in (int, float) and isinstance(value, str):
        value = _parse_number(value, base)  # YAML 1.1 reads "1e-6" as a string
    ok = (
        (base is bool and isinstance(value, bool))
        or (base is int and isinstance(value, int) and not isinstance(value, bool))
        or (base is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (base is str and isinstance(value, str))
    )
    if not ok and base is str and isinstance(value, bool):
        raise ConfigError(f"config key {key!r} expects text, got the boolean {value!r}: YAML reads no/yes/on/off "
                          f"as booleans, so quote the word (e.g. mixed_precision: 'no').")
    if not ok:
        raise ConfigError(f"config key {key!r} expects {base.__name__}, got {value!r} ({type(value).__name__}).")
    return float(value) if base is float else value


def _parse_number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        return text  # left as a string: the type check below names it


