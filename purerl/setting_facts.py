"""Facts about a setting that a resumed run and a replay read, kept on the setting itself: its attrs field's
metadata (``attrs.field(..., metadata=facts(resume=MAY_CHANGE))``), or its section's field in the job's config
for every key of the section. A key's own fact wins over its section's.

- ``resume``: :data:`MAY_CHANGE`, a resumed run may change it (the others must equal the run's ``config.json``);
- ``replay``: what a replay may do with it: :data:`COUNTERFACTUAL` (a counterfactual may change it: how the
  recorded batches become updates), :data:`WHERE` (where a check replays, not what: bits may differ),
  :data:`SAMPLES` or :data:`STATE` (refused: it decides what was sampled, or the state's shape); a key with no
  fact is refused too (what was scored, or the run's plumbing).

Light: it imports nothing of purerl, so every module that defines settings can name these facts.
"""

import typing
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["COUNTERFACTUAL", "MAY_CHANGE", "SAMPLES", "STATE", "WHERE", "fact_of", "facts", "keys_where",
           "sections_where"]

MAY_CHANGE = "may change"
COUNTERFACTUAL, WHERE, SAMPLES, STATE = "counterfactual", "where", "samples", "state"


def facts(*, resume: str | None = None, replay: str | None = None) -> dict[str, str]:
    """The metadata of a setting's field that holds these facts."""
    return {name: value for name, value in (("resume", resume), ("replay", replay)) if value is not None}


def _walk(cls: type, prefix: str = "", inherited: Mapping[str, Any] | None = None) -> list[tuple[str, dict]]:
    """Every leaf key of the config class ``cls`` with its facts (a section's field's facts, overridden by each
    key's own)."""
    out = []
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        own = {**(inherited or {}), **field.metadata}
        kind = hints[field.name]
        if isinstance(kind, type) and attrs.has(kind):
            out += _walk(kind, f"{prefix}{field.name}.", own)
        else:
            out.append((f"{prefix}{field.name}", own))
    return out


def fact_of(cls: type, key: str, name: str) -> str | None:
    """Fact ``name`` (``resume``, ``replay``) of the dotted ``key`` of the config class ``cls``; None where it has
    none."""
    return dict(_walk(cls)).get(key, {}).get(name)


def keys_where(cls: type, name: str, value: str) -> list[str]:
    """The dotted keys of ``cls`` whose fact ``name`` is ``value``."""
    return [key for key, found in _walk(cls) if found.get(name) == value]


def sections_where(cls: type, name: str, value: str) -> list[str]:
    """The sections of ``cls`` whose own field holds fact ``name`` = ``value``."""
    return [field.name for field in attrs.fields(cls) if field.metadata.get(name) == value]
