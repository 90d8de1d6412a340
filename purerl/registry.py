"""Named registries: config strings select pure functions (advantage estimators, losses, ...),
rollout engines and model families.

An entry may be a record of what callers need to know about it (an estimator's needs, a loss's
aggregation); registered functions declare their settings as keyword-only parameters named like
the config keys that set them (:func:`keyword_settings`), and receive only those
(:func:`bind_settings`)."""

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F")

__all__ = ["Registry", "bind_settings", "keyword_settings"]


class Registry(Generic[F]):
    """A mapping from names (and aliases) to entries of one kind (functions, classes, records).

    ``REG.register("gae")`` decorates a function; ``REG["gae"]`` returns it and raises a
    ``ValueError`` listing the known names for an unknown one.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
                self._entries[key] = fn
            return fn

        return add

    def __getitem__(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries))
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)


def keyword_settings(fn: Callable, *, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names of ``fn``'s keyword-only parameters (but ``exclude``): the settings a registered
    function takes, each looked up by name in the sections of a config (:func:`bind_settings`)."""
    import inspect

    return tuple(name for name, p in inspect.signature(fn).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in exclude)


def bind_settings(names: tuple[str, ...], sections: tuple[object, ...], owner: str) -> dict[str, object]:
    """``{name: value}`` for each of ``names``, from the first of ``sections`` with an attribute of
    that name (config sections, or any object). A ``ValueError`` names the settings none has."""
    values, missing = {}, []
    for name in names:
        for section in sections:
            if hasattr(section, name):
                values[name] = getattr(section, name)
                break
        else:
            missing.append(name)
    if missing:
        raise ValueError(f"{owner} needs the settings {', '.join(missing)}, which none of "
                         f"{', '.join(type(s).__name__ for s in sections) or 'no sections'} has")
    return values
