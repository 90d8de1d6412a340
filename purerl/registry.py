"""Named registries: config strings select pure functions (advantage estimators, losses, ...),
rollout engines, model families and environments.

An entry may be a record of what callers need to know about it (an estimator's needs, a loss's
aggregation). A registry only finds entries: settings are bound by the entries' own records
(:class:`~purerl.algo.estimators.AdvantageSettings`, :class:`~purerl.algo.loss_settings.PolicyLossSettings`),
read by attribute."""

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F")

__all__ = ["Registry"]


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

    def entries(self) -> list[tuple[tuple[str, ...], F]]:
        """Each entry once, with its names (the name it was registered under, then its aliases), in
        the order of registration."""
        found: dict[int, tuple[tuple[str, ...], F]] = {}
        for name, entry in self._entries.items():
            names, _ = found.get(id(entry), ((), entry))
            found[id(entry)] = ((*names, name), entry)
        return list(found.values())
