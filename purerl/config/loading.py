"""Typed configuration trees: frozen attrs classes built from TOML/YAML files and ``key=value`` overrides.

TOML has no null: for a field that may be None (``X | None``), the string ``"none"`` means None
(``actor.clip_c=none`` on the command line, ``clip_c = "none"`` in a file), unless the field
could hold that string itself.

A configuration is a tree of frozen ``attrs`` classes whose fields have plain annotations
(``bool``, ``int``, ``float``, ``str``, ``X | None``, ``tuple[X, ...]``, ``dict[str, Any]``,
nested attrs classes). :func:`build` turns nested mappings into such a tree, checking every key
and value against the annotations::

    layers = [load_file("ppo.toml"), overrides(["actor.lr=1e-6", "algorithm.adv_estimator=rloo"])]
    config = build(JobConfig, merge(*layers))

An unknown key or a value of the wrong type raises :class:`ConfigError` naming the dotted key
(and the closest valid key); ``attrs`` validators (e.g. :func:`one_of` for registry names) run as
the classes are built and their messages are prefixed with the section's key. :func:`to_dict` is
the inverse of :func:`build`: JSON-ready nested dicts, written into run folders.
"""

import difflib
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

from purerl.validators import SettingError, boolean, one_of

__all__ = ["ConfigError", "boolean", "build", "flatten", "keys_of", "load_file", "merge", "one_of", "overrides",
           "parse_value", "section", "to_dict"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be built; the message names the key (and file) at fault."""


def load_file(path: str | Path) -> dict[str, Any]:
    """The nested mapping in a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path}: a folder, not a .toml, .yaml or .json file")
    if not path.is_file():
        raise ConfigError(f"config file {path}: no such file")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text()) or {}
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ConfigError(f"config file {path}: unsupported type (use .toml, .yaml or .json)")
    except ConfigError:
        raise
    except Exception as err:  # tomllib/yaml/json syntax errors carry line and column
        raise ConfigError(f"config file {path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a table of sections, got {type(data).__name__}")
    return data


def parse_value(text: str) -> Any:
    """A command-line value as TOML reads it (``1e-6``, ``true``, ``[1, 2]``, ``"x"``), else the
    text itself (so ``rloo`` and ``./model`` need no quotes)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["actor.lr=1e-6", ...]`` as a nested mapping."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not all(part.isidentifier() for part in key.split(".")):
            raise ConfigError(f"override {item!r}: expected section.key=value (e.g. actor.lr=1e-6)")
        out = merge(out, nest(key, parse_value(value)))
    return out


def nest(dotted: str, value: Any) -> dict[str, Any]:
    """``nest("a.b", 1) == {"a": {"b": 1}}``."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win; mappings merge key by key, anything else is replaced whole."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
                out[key] = merge(out[key], value)
            else:
                out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def keys_of(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config class ``cls``."""
    keys = []
    for field in attrs.fields(cls):
        key = f"{prefix}{field.name}"
        kind = _resolved(cls)[field.name]
        keys += keys_of(kind, key + ".") if attrs.has(kind) else [key]
    return keys


def build(cls: type[T], data: Any, *, where: str = "") -> T:
    """An instance of the attrs class ``cls`` from ``data`` (missing keys take their defaults)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where.rstrip('.') or 'config'}: expected a table of keys, got {_show(data)}")
    hints = _resolved(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown key {where}{key}{_closest(where + str(key), cls, where)}")
    values = {name: _convert(hints[name], data[name], f"{where}{name}") for name in fields if name in data}
    try:
        return cls(**values)
    except (ConfigError, SettingError) as err:  # a field validator's: "field message"
        raise ConfigError(f"{where}{err}") from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {err}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """The config tree as nested JSON-ready dicts (tuples become lists)."""
    return json.loads(json.dumps(attrs.asdict(config)))


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}`` (dict-typed leaves such as engine options stay whole
    only when empty)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _widen_ints(cls: type, fields: list[attrs.Attribute]) -> list[attrs.Attribute]:
    """A field transformer: every ``float`` (or ``float | None``) field converts an int given for it."""
    def widen(value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    return [f.evolve(converter=widen) if f.converter is None and f.type in (float, float | None) else f
            for f in fields]


def section(cls: type[T]) -> type[T]:
    """A frozen attrs config class (a section of a config tree) whose float fields take ints too."""
    return attrs.frozen(cls, field_transformer=_widen_ints)


def _resolved(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _closest(key: str, cls: type, where: str) -> str:
    root_keys = keys_of(cls, where)
    close = difflib.get_close_matches(key, root_keys, n=1, cutoff=0.5)
    if not close:  # a leaf given at the wrong depth: match on its last part
        tail = key.rsplit(".", 1)[-1]
        close = [k for k in root_keys if k.rsplit(".", 1)[-1] == tail][:1]
    return f"; did you mean {close[0]}?" if close else f" (valid keys here: {', '.join(root_keys)})"


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
"""A number written in decimal, as a string: a float setting takes it."""


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _convert(kind: Any, value: Any, key: str) -> Any:
    """``value`` checked against the annotation ``kind`` (ints widen to floats, lists to tuples)."""
    if attrs.has(kind):
        return build(kind, value, where=key + ".")
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (value == "none" and str not in args)):
            return None  # TOML has no null: "none" stands for it where a string could not be meant
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except ConfigError as err:
                errors.append(err)
        deeper = [e for e in errors if not str(e).startswith(f"{key}: expected")]
        raise deeper[0] if deeper else ConfigError(f"{key}: expected {_name(kind)}, got {_show(value)}")
    if kind is Any:
        return value
    if origin is tuple or kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list of {_name(args[0]) if args else 'values'}, got {_show(value)}")
        item = args[0] if args else Any
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict or kind is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a table, got {_show(value)}")
        return dict(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 1e-5, with no dot, as a string
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # nan passes every bound check (nan < low is False): refuse it here
                raise ConfigError(f"{key} must be a finite number, got {value}")
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{key}: unsupported annotation {kind!r}")
    raise ConfigError(f"{key}: expected {_name(kind)}, got {_show(value)}")


def _name(kind: Any) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(kind))
    return "none" if kind is type(None) else getattr(kind, "__name__", str(kind))
