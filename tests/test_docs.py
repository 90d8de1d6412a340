"""The documentation site: its generated reference covers the code, it builds with no broken link
(``mkdocs build --strict``), and every code block of its pages runs as written.

A page's code block runs by its language: ``python`` is executed in a fresh namespace, ``bash``/``sh``
line by line (``python``/``python3`` being this interpreter), ``toml`` is built as a job config;
``text``, ``console``, ``json`` and the others are output, not code. An HTML comment line
``<!-- not run: REASON -->`` right before a block skips it with that reason. Each block is a test of
its own, ``test_code_block_runs[PAGE:LINE]``. Blocks run in a folder of their page's own whose
entries link to the checkout's (``experiments/``, ``examples/``, …), so a run's ``runs/…`` is new
each time and the checkout stays clean.
"""

import contextlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import typing
from pathlib import Path

import attrs
import pytest

from purerl.config.command_line import FLAGS
from purerl.config.job import JobConfig
from purerl.config.loading import build, keys_of, load_file
from purerl.docs.commands import COMMANDS, flags, parser_of
from purerl.docs.pages import PAGES, flags_page, settings_page
from purerl.docs.registries import DOCUMENTED, entries
from purerl.docs.roles import markdown
from purerl.docs.settings import settings
from tests import processes

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINE_TIMEOUT_S = 300


def test_the_settings_reference_lists_every_key_of_the_job_config_each_with_its_doc():
    found = settings()
    assert [s.key for s in found] == keys_of(JobConfig)
    undocumented = [s.key for s in found if not s.doc.strip()]
    assert not undocumented, ("settings without a docstring (a string literal right after the field, "
                              f"see purerl/docs/settings.py): {', '.join(undocumented)}")
    page = settings_page()
    assert all(f"{{#{s.key}}}" in page for s in found)


def _fields(cls: type, prefix: str = "") -> dict[str, attrs.Attribute]:
    hints, found = typing.get_type_hints(cls), {}
    for field in attrs.fields(cls):
        kind = hints[field.name]
        found.update(_fields(kind, f"{prefix}{field.name}.") if attrs.has(kind) else {prefix + field.name: field})
    return found


def test_every_check_of_a_setting_reads_as_words():
    fields = _fields(JobConfig)
    unreadable = [s.key for s in settings() if fields[s.key].validator is not None and not s.check]
    assert not unreadable, f"validators without words (give a custom one a docstring): {unreadable}"


def test_every_flag_of_the_job_names_a_setting_on_the_flags_page():
    keys = set(keys_of(JobConfig))
    assert {key for _, key, _ in FLAGS} <= keys
    page = flags_page()
    for flag, key, _ in FLAGS:
        assert f"`{flag}" in page and f"(settings.md#{key})" in page


def test_every_command_builds_its_parser_without_running():
    for command in COMMANDS:
        assert flags(parser_of(command)), command.run


def test_every_registry_entry_is_documented_and_reads_real_settings():
    keys = set(keys_of(JobConfig))
    for listing in DOCUMENTED:
        for entry in entries(listing):
            assert entry.doc.strip(), f"{listing.title}: {entry.names[0]} has no docstring"
            assert set(entry.reads) <= keys, (entry.names, entry.reads)
    losses = {e.names[0]: e for e in entries(next(d for d in DOCUMENTED if d.title == "Policy losses"))}
    assert losses["sapo"].reads == ("actor.loss_options.tau_pos", "actor.loss_options.tau_neg")
    estimators = {e.names[0]: e for e in entries(DOCUMENTED[0])}
    assert estimators["gae"].reads == ("algorithm.gamma", "algorithm.lam") and estimators["rloo"].reads == ()


def test_sphinx_roles_become_optional_cross_references():
    text = markdown("See :func:`~purerl.algo.kl.kl_loss`, :mod:`.job` and :class:`Estimator`::\n\n    x = 1\n",
                    "purerl.config", package=True)
    assert '<autoref identifier="purerl.algo.kl.kl_loss" optional><code>kl_loss</code></autoref>' in text
    assert 'identifier="purerl.config.job"' in text and 'identifier="purerl.config.Estimator"' in text
    assert "Estimator</code></autoref>:\n\n    x = 1" in text
    assert 'identifier="purerl.config.job"' in markdown(":mod:`.job`", "purerl.config.sections")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0, "\n".join(problems) or done.stderr[-3000:]
    for page in PAGES:
        assert (tmp_path / "site" / page.removesuffix(".md") / "index.html").is_file()
    print(f"mkdocs build --strict: {time.monotonic() - start:.1f} s")


@attrs.frozen
class Block:
    page: str
    line: int
    language: str
    code: str
    skip: str | None


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*\{?\.?(?P<language>[\w+-]*)")
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->")
_RUN = {"python": "python", "py": "python", "python3": "python", "bash": "bash", "sh": "bash", "shell": "bash",
        "toml": "toml"}


def code_blocks() -> list[Block]:
    """Every fenced block of the hand-written pages whose language runs (not the generated reference)."""
    found = []
    for path in sorted(DOCS.rglob("*.md")):
        page = path.relative_to(DOCS).as_posix()
        if page.startswith("reference/"):
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if not opening:
                i += 1
                continue
            fence, indent = opening["fence"], opening["indent"]
            end = next((j for j in range(i + 1, len(lines))
                        if re.fullmatch(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", lines[j])), len(lines))
            body = [line.removeprefix(indent) for line in lines[i + 1:end]]
            before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            skip = _NOT_RUN.fullmatch(before)
            language = _RUN.get(opening["language"].lower())
            if language:
                found.append(Block(page, i + 1, language, textwrap.dedent("\n".join(body)) + "\n",
                                   skip["reason"] if skip else None))
            i = end + 1
    return found


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory):
    """A working folder per page: links to the checkout's entries, with a ``runs/`` of its own."""
    made: dict[str, Path] = {}

    def folder(page: str) -> Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(re.sub(r"\W+", "_", page))
            for entry in ROOT.iterdir():
                if entry.name not in (".git", "runs", "site", "build"):
                    (made[page] / entry.name).symlink_to(entry)
        return made[page]

    return folder


def _commands(code: str) -> list[str]:
    """A shell block's commands: continued lines joined, blank lines and comments left out."""
    joined = re.sub(r"\\\n[ \t]*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


_FETCHES = re.compile(r"(^|[;&|]\s*)(sudo\s|apt(-get)?\s|(python3?\s+-m\s+)?pip\s|uv\s+pip\s|git\s+clone|curl\s|"
                      r"wget\s)")
"""A command that installs or downloads, which a test never runs."""


_PLAIN_PYTHON = re.compile(r"python3?\s[^|&;<>()$`*?~{}\\\n]*")
"""A shell line that is one Python command and nothing a shell would expand or redirect."""


_OWN_PROCESS = re.compile(r"^(import|from)\s+tinker\b", re.MULTILINE)
"""Python blocks run in a process of their own: the tinker SDK's event-loop thread leaves sockets to the
collector after its client closes, which would otherwise close them during a later test."""


@contextlib.contextmanager
def _registries_kept():
    """While entered, what a page's code registers (an estimator of its own, …) stays the page's: every
    registry's entries are put back after it, so later tests see purerl's own."""
    from purerl.registry import Registry

    found = {id(value): value for name, module in list(sys.modules.items()) if name.split(".")[0] == "purerl"
             for value in list(vars(module).values()) if isinstance(value, Registry)}  # registries live in modules
    kept = [(registry, dict(registry._entries)) for registry in found.values()]
    try:
        yield
    finally:
        for registry, entries in kept:
            registry._entries = entries


@pytest.mark.slow
@pytest.mark.parametrize("block", code_blocks(), ids=lambda b: f"{b.page}:{b.line}")
def test_code_block_runs(block, page_folders, monkeypatch):
    if block.skip:
        pytest.skip(block.skip)
    where = page_folders(block.page)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    if block.language == "python" and _OWN_PROCESS.search(block.code):
        script = where / f"block_{block.line}.py"
        script.write_text(block.code)
        done = processes.run([sys.executable, script.name], cwd=where, timeout=LINE_TIMEOUT_S, env=env)
        assert done.returncode == 0, f"docs/{block.page}:{block.line} (exit {done.returncode}):\n{done.stderr[-3000:]}"
    elif block.language == "python":
        monkeypatch.chdir(where)
        with _registries_kept():
            exec(compile(block.code, f"docs/{block.page}:{block.line}", "exec"), {"__name__": "__main__"})
    elif block.language == "toml":
        path = where / f"block_{block.line}.toml"
        path.write_text(block.code)
        build(JobConfig, load_file(path))
    else:
        for command in _commands(block.code):
            assert not _FETCHES.search(command), (f"{command!r} installs or downloads: mark the block "
                                                  "<!-- not run: REASON -->")
            if _PLAIN_PYTHON.fullmatch(command):  # no shell syntax: the same argv without a shell
                done = processes.run([sys.executable, *shlex.split(command, comments=True)[1:]], cwd=where, timeout=LINE_TIMEOUT_S,
                                     env=env)
            else:
                line = re.sub(r"(?<![\w/.-])python3?(?=\s|$)", sys.executable, command)
                done = subprocess.run(["bash", "-c", line], cwd=where, capture_output=True, text=True,
                                      timeout=LINE_TIMEOUT_S, env=env)
            assert done.returncode == 0, f"{command} (exit {done.returncode}):\n{done.stderr[-3000:]}"
