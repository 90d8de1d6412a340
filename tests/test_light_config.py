"""Reading a config is light: building the job's config, or its command line's ``--help``, imports
neither torch nor the agents' endpoint (registries know their names before their entries load).
Each check runs in a fresh interpreter (the fork server of :mod:`tests.processes` holds torch)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from purerl.registry import Registry

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_building_the_job_config_imports_neither_torch_nor_the_endpoint():
    done = _fresh("""
        import sys
        from purerl.config.job import JobConfig
        JobConfig(); JobConfig().algorithm  # every default and every validator ran
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("purerl.agents", "transformers")))
        assert not heavy, heavy
    """)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_main_scripts_help_imports_no_torch():
    done = _fresh("""
        import runpy, sys
        sys.argv = ["grpo_math.py", "--help"]
        try:
            runpy.run_path("experiments/grpo_math.py", run_name="__main__")
        except SystemExit as stop:
            assert stop.code == 0, stop.code
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("purerl.agents"))
        assert not heavy, heavy
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--adv-estimator" in done.stdout and "algorithm.adv_estimator" in done.stdout


def test_an_unknown_estimator_is_named_with_a_suggestion_without_torch():
    done = _fresh("""
        import sys
        from purerl.config.job import JobConfig
        from purerl.config.loading import ConfigError, build
        try:
            build(JobConfig, {"algorithm": {"adv_estimator": "grop"}})
        except ConfigError as err:
            print(err)
        assert "torch" not in sys.modules
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unknown advantage estimator 'grop'; did you mean 'grpo'?" in done.stdout


@pytest.mark.slow
def test_every_declared_algorithm_name_is_registered_by_its_module_and_no_other():
    """The names the registries declare (light) are exactly those their modules register."""
    done = _fresh("""
        from purerl.algo import registries
        from purerl.registry import Registry
        for name in registries.__all__:
            registry = getattr(registries, name)
            if not isinstance(registry, Registry):  # the protocols of their entries
                continue
            declared = registry.names()
            registered = sorted(n for names, _ in registry.entries() for n in names)
            assert registered == declared, (name, declared, registered)
    """)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_declared_name_is_known_before_its_entry_and_loads_its_module_on_lookup(tmp_path, monkeypatch):
    (tmp_path / "light_config_entries.py").write_text(
        "from tests.test_light_config import REGISTRY\nREGISTRY.register('a', 'b')(len)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "light_config_entries", raising=False)
    registry = Registry("thing", names=("a", "b"), loaders=("light_config_entries",))
    monkeypatch.setitem(globals(), "REGISTRY", registry)
    assert "a" in registry and "c" not in registry and registry.names() == ["a", "b"]
    assert "light_config_entries" not in sys.modules
    assert registry["b"] is len and "light_config_entries" in sys.modules
    assert registry.entries() == [(("a", "b"), len)]
    with pytest.raises(ValueError, match="unknown thing 'c'; known: a, b"):
        registry["c"]


def test_a_declared_name_its_module_does_not_register_fails_naming_it(tmp_path, monkeypatch):
    (tmp_path / "light_config_nothing.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("thing", names=("a",), loaders=("light_config_nothing",))
    with pytest.raises(LookupError, match="thing a: declared, but light_config_nothing registered no entry"):
        registry["a"]
