"""The layers show: import-linter's contracts (pyproject.toml) hold, no module outgrows one idea."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = ("algo", "optim", "config", "tree.py", "state.py", "batch.py", "checks.py", "registry.py")


def test_the_import_contracts_hold():
    """The pure core imports no effect package (executors, engine backends, loops, IO, Ray, vLLM),
    and no import cycle exists anywhere in purerl."""
    command = shutil.which("lint-imports")
    if command is None:
        pytest.fail("lint-imports is not installed (pip install import-linter; it is a test dependency)")
    done = subprocess.run([command, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_pure_core_never_imports_torch_distributed():
    # import-linter checks external packages as a whole (torch), so the submodule is checked here;
    # the pure core imports only itself within purerl (the contract above), so this covers chains too
    for entry in PURE:
        for path in sorted((ROOT / "purerl" / entry).rglob("*.py")) if entry.count(".") == 0 else [
                ROOT / "purerl" / entry]:
            offending = {name for name in _imports(path) if name.startswith("torch.distributed")}
            assert not offending, f"{path.relative_to(ROOT)} imports {offending}"


def test_no_module_is_over_380_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "purerl").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 380}
    assert not long, long


def test_no_code_compares_a_kind_by_its_name():
    """Executors, engines and every registry's entries are records: callers read their facts, and no code
    compares an executor kind's name (or any ``kind``) with a string."""
    import re

    compared = re.compile(r"""== *["'](ray|local)["']|kind *== *["']""")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "purerl").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line)]
    assert not found, found


def test_the_algorithm_registries_are_typed_by_what_they_hold():
    """Every built-in entry is an instance of the protocol its registry declares (what callers read of it)."""
    from purerl.algo import registries

    typed = ((registries.ADVANTAGE_ESTIMATORS, registries.EstimatorRecord),
             (registries.POLICY_LOSSES, registries.PolicyLossRecord),
             (registries.LOSS_AGGREGATIONS, registries.AggregationRecord))
    for registry, protocol in typed:
        wrong = [names for names, entry in registry.entries() if not isinstance(entry, protocol)]
        assert not wrong, (registry.kind, wrong)
    assert "Registry[Any]" not in (ROOT / "purerl" / "algo" / "registries.py").read_text()


def test_the_main_script_is_thin():
    assert len((ROOT / "experiments" / "grpo_math.py").read_text().splitlines()) <= 200
    assert sys.modules.get("grpo_math") is None  # no test imported it through sys.path


def test_nothing_below_the_assembly_names_the_job_config():
    """Stages take their settings, loops and executors their sections: the job's tree stops at
    ``purerl.assembly`` (the import contract forbids the module; this, the name)."""
    below = ("step", "loop", "rewards", "episodes", "io", "executors", "sandbox", "algo", "optim", "rollout")
    naming = [str(p.relative_to(ROOT)) for package in below for p in (ROOT / "purerl" / package).rglob("*.py")
              if "JobConfig" in p.read_text()]
    assert not naming, naming


def test_the_custom_step_example_is_short_and_builds_no_job_config():
    text = (ROOT / "examples" / "custom_step.py").read_text()
    assert len(text.splitlines()) <= 30
    assert "JobConfig" not in text
