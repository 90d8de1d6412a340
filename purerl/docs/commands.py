"""Every command's flags, read from its argparse parser (built, never run): the experiment scripts
(the job's command line, :func:`purerl.config.command_line.job_parser`), ``python3 -m purerl.report``,
``python3 -m purerl.replay``, ``python3 -m purerl.tinker``, ``python3 -m purerl.model_check`` and
``bench/seeds.py``. Each exposes a ``parser()`` function; a script is loaded from its file under a name
that is not ``__main__``, so nothing of it runs. The scripts are files of a checkout, not of the installed
package: the flags page is built from a clone (an installed package raises :class:`CheckoutMissing`,
naming the file)."""

import argparse
import importlib
import importlib.util
import json
from pathlib import Path

import attrs

__all__ = ["COMMANDS", "CheckoutMissing", "Command", "Flag", "flags", "parser_of"]

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root, where a clone has ``experiments/`` and ``bench/`` (for an installed package: the
folder that holds it, e.g. ``site-packages``, which has neither)."""


class CheckoutMissing(FileNotFoundError):
    """A script the documentation reads is not here: the package was installed, not run from a clone."""


@attrs.frozen
class Command:
    """How a command is run (``python3 -m purerl.report``), and where its ``parser()`` is: a module
    name, or a script's path from the repository's root."""

    run: str
    module: str | None = None
    script: str | None = None


COMMANDS = (
    Command("python3 experiments/grpo_math.py", script="experiments/grpo_math.py"),
    Command("python3 experiments/tool_math.py", script="experiments/tool_math.py"),
    Command("python3 -m purerl.report", module="purerl.report"),
    Command("python3 -m purerl.replay", module="purerl.replay"),
    Command("python3 -m purerl.tinker", module="purerl.tinker.__main__"),
    Command("python3 -m purerl.model_check", module="purerl.model_check"),
    Command("python3 bench/seeds.py", script="bench/seeds.py"),
)
"""The commands whose flags the site documents."""


@attrs.frozen
class Flag:
    """One argument of a parser: how it is written (``-o FILE, --output FILE``), its default as text
    ("" when it has none to show), its help, and ``dest`` (for the job's flags, the config key)."""

    usage: str
    default: str
    help: str
    dest: str


def parser_of(command: Command) -> argparse.ArgumentParser:
    """``command``'s parser, from its module's or script's ``parser()``."""
    if command.module is not None:
        return importlib.import_module(command.module).parser()
    path = ROOT / str(command.script)
    if not path.is_file():
        raise CheckoutMissing(f"purerl.docs: {command.script} is not in {ROOT}: the flags page documents the "
                              "scripts of a checkout, which an installed purerl does not have; build the "
                              "documentation from a clone of the purerl repository")
    spec = importlib.util.spec_from_file_location(f"purerl_docs_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.parser()


def flags(parser: argparse.ArgumentParser) -> list[Flag]:
    """The arguments of ``parser`` in its order, ``--help`` left out."""
    formatter = parser._get_formatter()  # argparse's own rendering of an argument
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        usage = formatter._format_action_invocation(action)
        found.append(Flag(usage, _default(action), " ".join((action.help or "").split()), action.dest))
    return found


def _default(action: argparse.Action) -> str:
    """What an argument is when it is not given, as text; "" for switches, None and empty lists."""
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    if isinstance(action.default, Path):
        path = action.default
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    if isinstance(action.default, (list, tuple)):
        values = list(action.default)
        if len(values) > 2 and all(isinstance(v, int) for v in values) and values == list(
                range(values[0], values[-1] + 1)):
            return f"{values[0]}-{values[-1]}"  # a range of seeds, as the flag takes it
        return " ".join(map(str, values))
    text = action.default if isinstance(action.default, str) else json.dumps(action.default)
    home = str(Path.home())
    return "~" + text[len(home):] if text.startswith(home + "/") else text  # the same on every machine
