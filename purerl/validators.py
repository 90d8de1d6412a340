"""attrs validators of settings: :func:`at_least`, :func:`positive`, :func:`in_range`,
:func:`one_of` (a registry's names) and :func:`boolean` check a frozen record's fields as it is
built, naming the field; :func:`accepts` says in words what one accepts (the settings reference).

No torch here: a job's config builds with these alone (:mod:`purerl.checks` re-exports them
beside its tensor checks).
"""

import difflib
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = ["SettingError", "accepts", "at_least", "boolean", "in_range", "one_of", "positive"]


class SettingError(ValueError):
    """A setting outside its range; the message starts with the setting's name."""


def accepts(validator: Any) -> str:
    """What an attrs validator of this module accepts, in words (``≥ 1``, ``in (0, 1]``, ``one of: a,
    b``): the text its error message uses, which the settings reference shows; "" for another
    validator."""
    described = getattr(validator, "accepts", None)
    return described() if callable(described) else ""


def _described(text: Any) -> Any:
    """Gives a validator its ``accepts()``: ``text``, a function of nothing returning the words."""

    def attach(check: Any) -> Any:
        check.accepts = text
        return check

    return attach


def at_least(low: float | int) -> Any:
    """An attrs validator: the value (when not None) is ``≥ low``."""

    @_described(lambda: f"≥ {low}")
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and not value >= low:
            raise SettingError(f"{attribute.name} must be {check.accepts()}, got {value}")

    return check


@_described(lambda: "> 0")
def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An attrs validator: the value (when not None) is ``> 0``."""
    if value is not None and not value > 0:
        raise SettingError(f"{attribute.name} must be > 0, got {value}")


def in_range(low: float | int, high: float | int, *, open_low: bool = False) -> Any:
    """An attrs validator: the value is in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    @_described(lambda: f"in {'(' if open_low else '['}{low}, {high}]")
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not ((low < value) if open_low else (low <= value)) or not value <= high:
            raise SettingError(f"{attribute.name} must be {check.accepts()}, got {value}")

    return check


@_described(lambda: "true or false")
def boolean(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An attrs validator: the value is ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise SettingError(f"{attribute.name} must be true or false, got {value!r}")


def one_of(names: Iterable[str] | Any, what: str) -> Any:
    """An attrs validator accepting the names of a registry (anything with ``names()``) or an
    iterable; the error names the closest valid value."""

    def names_now() -> list[Any]:  # a registry's names when checked: entries registered later count
        return list(names.names() if hasattr(names, "names") else names)

    @_described(lambda: "one of: " + ", ".join(map(str, names_now())))
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        known = names_now()
        if value not in known:
            close = difflib.get_close_matches(str(value), [str(k) for k in known], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingError(f"{attribute.name}: unknown {what} {value!r}{hint} "
                               f"(known: {', '.join(map(str, known))})")

    check.choices = names_now  # the command line's choices for the setting (one spelling of each value)
    return check
