"""Docstrings as the documentation site's Markdown: purerl's docstrings name code with Sphinx roles
(``:func:`~purerl.algo.kl.kl_loss```) and end a paragraph before a literal block with ``::``; the
site (mkdocstrings, and the generated reference pages) reads Markdown.

A role becomes an optional cross-reference of mkdocs-autorefs: a link where the object is
documented on the site, its name in code where it is not (no broken link either way).
"""

import re

__all__ = ["markdown"]

_ROLE = re.compile(r":(?:py:)?(?:class|func|mod|data|attr|meth|obj|exc|const|type):`(~?)([^`<]*?)(?:\s*<([^`>]+)>)?`")
_LITERAL_BLOCK = re.compile(r"(?<=\S)::(?=[ \t]*\n[ \t]*\n[ \t]+\S)")


def markdown(text: str, module: str | None = None, *, package: bool = False) -> str:
    """``text`` with each Sphinx role as an optional autorefs reference (``~`` shows the last part of
    the name; a name starting with ``.`` is relative to the package of ``module``, or to ``module``
    itself when it is a ``package``; a bare name is looked up in ``module``) and each ``::`` that
    opens a literal block as ``:``."""

    def reference(match: re.Match) -> str:
        short, name, target = match[1], match[2].strip(), match[3]
        identifier = _absolute((target or name).removesuffix("()"), module, package)
        title = name if target else (name.rsplit(".", 1)[-1] if short else name.lstrip("."))
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return _LITERAL_BLOCK.sub(":", _ROLE.sub(reference, text))


def _absolute(name: str, module: str | None, package: bool) -> str:
    """``name`` as a full dotted path, relative names resolved against ``module``."""
    if module is None or name.startswith("purerl"):
        return name
    if name.startswith("."):
        up = len(name) - len(name.lstrip(".")) - package  # ".x" in a package is that package's x
        base = module.rsplit(".", up)[0] if up else module
        return f"{base}.{name.lstrip('.')}"
    return f"{module}.{name}"
