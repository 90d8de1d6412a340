"""The generated reference pages of the documentation site, as Markdown: the settings
(:mod:`.settings`), the command-line flags (:mod:`.commands`), the registries (:mod:`.registries`)
and the API (mkdocstrings directives, one per public module). ``docs/hooks.py`` adds them to the
site at build time; nothing of them is kept in ``docs/``."""

import inspect
import re
import typing
from collections.abc import Callable
from pathlib import Path

from purerl.config.job import JobConfig
from purerl.docs.commands import COMMANDS, Flag, flags, parser_of
from purerl.docs.registries import DOCUMENTED, entries
from purerl.docs.roles import markdown
from purerl.docs.settings import Setting, settings

__all__ = ["PAGES", "api_modules", "api_page", "flags_page", "registries_page", "settings_page"]

PACKAGE = Path(__file__).resolve().parents[1]
GENERATED = "*Generated from the code when the site is built: a change to the code changes this page.*"


def settings_page() -> str:
    """``reference/settings.md``: every key of the job's config, section by section."""
    lines = ["# Settings", "", GENERATED, "", _md(
             "Every key of the job's configuration (:class:`~purerl.config.job.JobConfig`). Set a key in a TOML "
             "or YAML file passed with `--config` (`[actor]` then `lr = 1e-6`), or on the command line as "
             "`section.key=value` (`actor.lr=1e-6`); some keys have a shorter [flag](flags.md). TOML has no "
             "null: `\"none\"` sets a key that may be None. A check is tested as the config is built, and "
             "rules across sections (:mod:`purerl.config.rules`) before anything loads.", None), ""]
    hints = typing.get_type_hints(JobConfig)
    by_section: dict[str, list[Setting]] = {}
    for setting in settings():
        by_section.setdefault(setting.key.split(".")[0], []).append(setting)
    for section, found in by_section.items():
        cls = hints[section]
        lines += [f"## {section} {{#{section}}}", "", _md(inspect.getdoc(cls) or "", cls.__module__), ""]
        for setting in found:
            facts = [f"type `{setting.type}`", f"default `{setting.default}`"]
            if setting.check:
                facts.append(f"check: {_md(setting.check, setting.module)}")
            if setting.flags:
                facts.append("flag " + ", ".join(f"[`{flag}`](flags.md#job)" for flag in setting.flags))
            lines += [f"### `{setting.key}` {{#{setting.key}}}", "", " · ".join(facts), "",
                      _md(setting.doc, setting.module), ""]
    return "\n".join(lines)


def flags_page() -> str:
    """``reference/flags.md``: each command's arguments, from its parser; a command whose flags are
    another's shows only where they differ."""
    lines = ["# Command-line flags", "", GENERATED, "",
             "The job's flags are shorthands for [settings](settings.md): any other key is set as "
             "`section.key=value` after the flags, and `--config FILE` files come first "
             "(defaults ← files ← flags ← `key=value`).", ""]
    shown: dict[str, list[Flag]] = {}
    for command in COMMANDS:
        parser = parser_of(command)
        found = flags(parser)
        anchor = "job" if command.script and command.script.startswith("experiments/") and not shown else \
            re.sub(r"\W+", "-", command.run.removeprefix("python3 ")).strip("-")
        lines += [f"## `{command.run}` {{#{anchor}}}", "", _md(parser.description or "", command.module), ""]
        same = next((run for run, other in shown.items() if [f.usage for f in other] == [f.usage for f in found]),
                    None)
        if same is not None:
            changed = [f for f, other in zip(found, shown[same]) if f != other]
            lines += [f"The flags of `{same}`" + (", except:" if changed else "."), ""]
            found = changed
        if found:
            lines += _flag_table(found)
        shown[command.run] = flags(parser)
    return "\n".join(lines)


def _flag_table(found: list[Flag]) -> list[str]:
    defaults = {s.key: s.default for s in settings()}
    rows = ["| flag | default | setting | what it does |", "|---|---|---|---|"]
    for flag in found:
        key = flag.dest if flag.dest in defaults else None
        help_text = re.sub(r"\s*\[[\w.]+(, default .*)?\]$", "", flag.help) if key else flag.help
        default = f"`{defaults[key]}`" if key and defaults[key] not in ("none", "[]", '""') else \
            (f"`{flag.default}`" if flag.default else "")
        setting = f"[`{key}`](settings.md#{key})" if key else ""
        rows.append(f"| `{flag.usage}` | {default} | {setting} | {_cell(help_text)} |")
    return [*rows, ""]


def registries_page() -> str:
    """``reference/registries.md``: every entry of the registries the site documents, its names,
    the settings it reads and its documentation."""
    lines = ["# Registries", "", GENERATED, "", _md(
             "Named registries map the strings of a config to functions and records "
             "(:class:`~purerl.registry.Registry`). A new entry registered in your own code is selectable at once "
             "by its name.", None), ""]
    for listing in DOCUMENTED:
        slug = re.sub(r"\W+", "-", listing.title.lower())
        lines += [f"## {listing.title} {{#{slug}}}", "", _md(listing.summary, None)]
        if listing.selected_by:
            lines += ["", "Selected by " + ", ".join(f"[`{key}`](settings.md#{key})" for key in listing.selected_by)
                      + "."]
        lines.append("")
        for entry in entries(listing):
            name, aliases = entry.names[0], entry.names[1:]
            lines += [f"### `{name}` {{#{slug}.{name}}}", ""]
            facts = []
            if aliases:
                facts.append("also " + ", ".join(f"`{alias}`" for alias in aliases))
            if entry.reads:
                facts.append("reads " + ", ".join(f"[`{key}`](settings.md#{key})" for key in entry.reads))
            if entry.source is not None and not entry.source.__name__.startswith(("_", "<")):
                facts.append("function " + _md(f":func:`{entry.source.__module__}.{entry.source.__qualname__}`", None))
            if facts:
                lines += [" · ".join(facts), ""]
            module = entry.source.__module__ if entry.source is not None else None
            lines += [_md(entry.doc, module), ""]
    return "\n".join(lines)


API_ORDER = ("purerl", "purerl.tree", "purerl.state", "purerl.batch", "purerl.checks", "purerl.registry",
             "purerl.config", "purerl.algo", "purerl.optim", "purerl.step", "purerl.models", "purerl.rollout",
             "purerl.rewards", "purerl.environments", "purerl.episodes", "purerl.agents", "purerl.executors",
             "purerl.loop", "purerl.io", "purerl.run", "purerl.assembly")
"""Where the API page starts: the pure core, then the effects, as a step uses them; the other
modules follow by name."""


def api_modules() -> list[str]:
    """Every public module of purerl (none whose name has a part starting with ``_``), in
    :data:`API_ORDER`, each package before its modules."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            found.append(".".join(parts))

    def place(module: str) -> tuple[int, str]:
        under = [i for i, top in enumerate(API_ORDER) if module == top or (i and module.startswith(top + "."))]
        return (under[-1] if under else len(API_ORDER)), module

    return sorted(found, key=place)


def api_page() -> str:
    """``reference/api.md``: each public module's docstrings, rendered by mkdocstrings."""
    lines = ["# API", "", GENERATED, "",
             "Each public module of purerl with its documented members, from their docstrings. The "
             "[settings](settings.md) page lists the job's configuration key by key.", ""]
    for module in api_modules():
        lines += [f"::: {module}", ""]
    return "\n".join(lines)


def _md(text: str, module: str | None) -> str:
    """Docstring text as the site's Markdown (:func:`~purerl.docs.roles.markdown`)."""
    return markdown(text, module)


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("<", "&lt;")


PAGES: dict[str, Callable[[], str]] = {
    "reference/settings.md": settings_page,
    "reference/flags.md": flags_page,
    "reference/registries.md": registries_page,
    "reference/api.md": api_page,
}
"""The generated pages by their path under ``docs/``."""
