"""Every setting of the job's config tree as a record of what the settings reference shows: its key,
type, default, check, command-line flags and documentation.

A setting's documentation is the string literal written right after its field (an attribute
docstring, which the API reference shows too)::

    lr: float = attrs.field(default=2e-5, validator=positive)
    \"\"\"The peak learning rate of AdamW's warm-up cosine schedule.\"\"\"

:func:`field_docs` reads them from the source with :mod:`ast`; a field inherited from a record
(``actor`` is a :class:`~purerl.algo.loss_settings.PolicyLossSettings`) is documented where it is
defined. Checks are the fields' attrs validators, written as :func:`check_text` reads them.
"""

import ast
import inspect
import json
import textwrap
import types
import typing
from typing import Any

import attrs

from purerl.checks import accepts
from purerl.config.command_line import FLAGS
from purerl.config.job import JobConfig

__all__ = ["Setting", "check_text", "default_text", "defined_in", "field_docs", "flags_of", "settings", "type_text"]


@attrs.frozen
class Setting:
    """One leaf of the config tree: ``key`` (``section.key``), its annotation, default and check as
    text, the flags that set it, its documentation ("" when it has none) and the module that
    defines it (where the names its documentation uses are found)."""

    key: str
    type: str
    default: str
    check: str
    flags: tuple[str, ...]
    doc: str
    module: str


def settings(root: type = JobConfig) -> list[Setting]:
    """The leaves of the config class ``root`` in the order of its fields, sections depth first."""
    flags = flags_of()
    return [Setting(key, type_text(kind), default_text(field.default), check_text(field.validator),
                    flags.get(key, ()), doc, module) for key, field, kind, doc, module in _leaves(root, "")]


def _leaves(cls: type, prefix: str) -> list[tuple[str, attrs.Attribute, Any, str, str]]:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    found = []
    for field in attrs.fields(cls):
        kind = hints[field.name]
        if attrs.has(kind):
            found += _leaves(kind, f"{prefix}{field.name}.")
        else:
            found.append((f"{prefix}{field.name}", field, kind, docs.get(field.name, ""),
                          defined_in(cls, field.name).__module__))
    return found


def defined_in(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose own body declares the field ``name``."""
    return next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))


def field_docs(cls: type) -> dict[str, str]:
    """``{field: its attribute docstring}`` of the attrs class ``cls``, inherited fields included
    (each from the class that defines it); a field without one is absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if attrs.has(klass) and klass.__module__ != "builtins":
            docs.update(_own_docs(klass))
    return docs


def _own_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings in ``cls``'s own body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def flags_of() -> dict[str, tuple[str, ...]]:
    """``{key: the job's flags that set it}``; a switch shows the value it sets
    (``--no-progress (false)``)."""
    found: dict[str, tuple[str, ...]] = {}
    for flag, key, options in FLAGS:
        shown = f"{flag} ({json.dumps(options['const'])})" if options.get("action") == "store_const" else flag
        found[key] = (*found.get(key, ()), shown)
    return found


def type_text(kind: Any) -> str:
    """An annotation as written in the code (``float | None``, ``tuple[str, ...]``)."""
    if kind is type(None):
        return "None"
    if kind is Ellipsis:
        return "..."
    if kind is Any:
        return "Any"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_text(arg) for arg in args)}]"
    return getattr(kind, "__name__", str(kind))


def default_text(default: Any) -> str:
    """A default as a config file writes it (``none`` where the field may be None, a factory's
    value, long strings cut to their start)."""
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    if default is None:
        return "none"
    if isinstance(default, (bool, str, tuple, list, dict)):
        text = json.dumps(list(default) if isinstance(default, tuple) else default, ensure_ascii=False)
        return text if len(text) <= 60 else text[:56].rstrip() + " …\""
    return repr(default)


def check_text(validator: Any) -> str:
    """What an attrs validator accepts, in words (``≥ 1``, ``in [0, 1]``, ``one of: grpo, gae``);
    a check of its own says so in its docstring's first line; "" for no validator."""
    if validator is None:
        return ""
    if type(validator).__name__ == "_AndValidator":  # several validators on one field
        return "; ".join(filter(None, (check_text(v) for v in validator._validators)))
    inner = getattr(validator, "validator", None)
    if inner is not None and type(validator).__name__ == "_OptionalValidator":
        return f"none, or {check_text(inner)}"
    member = getattr(validator, "member_validator", None)
    if member is not None:
        return f"each {check_text(member)}"
    if words := accepts(validator):
        return words
    validator = inspect.unwrap(validator)  # the function itself where a type checker wraps it (under pytest)
    return (inspect.getdoc(validator) or "").split("\n\n")[0].replace("\n", " ").rstrip(".")
