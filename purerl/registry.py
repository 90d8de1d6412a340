"""Named registries: config strings select pure functions (advantage estimators, losses, ...),
rollout engines, model families and environments.

An entry may be a record of what callers need to know about it (an estimator's needs, a loss's
aggregation). A registry only finds entries: settings are bound by the entries' own records
(:class:`~purerl.algo.estimators.AdvantageSettings`, :class:`~purerl.algo.loss_settings.PolicyLossSettings`),
read by attribute.

A registry may know its built-in names before their entries exist (``names``): the modules that
register them (``loaders``) are imported on the first lookup that needs an entry, so checking a
name (a config's validation, a ``--help``) imports neither them nor torch.
"""

import importlib
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

F = TypeVar("F")

__all__ = ["Registry", "imported"]


class Registry(Generic[F]):
    """A mapping from names (and aliases) to entries of one kind (functions, classes, records).

    ``REG.register("gae")`` decorates a function; ``REG["gae"]`` returns it and raises a
    ``ValueError`` listing the known names for an unknown one. ``names`` declares built-in names
    (aliases included) whose entries the modules ``loaders`` register when imported: ``in`` and
    :meth:`names` know them at once, a lookup of one (and :meth:`entries`) imports the loaders,
    which must then have registered every declared name.
    """

    def __init__(self, kind: str, *, names: Iterable[str] = (), loaders: Iterable[str] = ()) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._declared = frozenset(names)
        self._loaders = tuple(loaders)

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
                self._entries[key] = fn
            return fn

        return add

    def __getitem__(self, name: str) -> F:
        if name not in self._entries and name in self._declared:
            self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._declared

    def names(self) -> list[str]:
        return sorted(self._declared.union(self._entries))

    def entries(self) -> list[tuple[tuple[str, ...], F]]:
        """Each entry once, with its names (the name it was registered under, then its aliases), in
        the order of registration."""
        self._load()
        found: dict[int, tuple[tuple[str, ...], F]] = {}
        for name, entry in self._entries.items():
            names, _ = found.get(id(entry), ((), entry))
            found[id(entry)] = ((*names, name), entry)
        return list(found.values())

    def _load(self) -> None:
        """Import the loaders unless every declared name has its entry (a loader that looks up a
        declared name before registering it fails here, naming the names)."""
        if self._declared.issubset(self._entries):
            return
        for module in self._loaders:
            importlib.import_module(module)
        if missing := sorted(self._declared.difference(self._entries)):
            raise LookupError(f"{self.kind} {', '.join(missing)}: declared, but {', '.join(self._loaders)} "
                              "registered no entry under that name")


def imported(target: Any) -> Any:
    """``target`` itself, or the object its ``"module:name"`` names, its module imported now (how a
    record keeps a function of a module that imports torch without importing it)."""
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
