"""User objects named by a spec: ``"package.module:name"`` imports the module;
``"path/to/file.py:name"`` (any spec whose module part ends in ``.py`` or holds a ``/``) loads the
file as the module named by its stem, with its folder on ``sys.path``. Either way the object is an
attribute of an importable module, so it pickles by reference and the worker processes of
:mod:`purerl.sandbox.processes` import it by name. Reward functions (``reward.fn``) and
environments (``env.name``) are loaded this way.
"""

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_object"]

_log = logging.getLogger("purerl")
_USAGE = "expected 'package.module:function' or 'path/to/file.py:function'"


def load_object(spec: str, what: str = "reward function") -> object:
    """The attribute ``spec`` (``module:name`` or ``file.py:name``) names; a one-line
    :class:`ValueError` naming the ``what``, the spec and what is wrong otherwise."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where.strip() or not name.strip():
        raise ValueError(f"{what} {spec!r}: {_USAGE}")
    where, name = where.strip(), name.strip()
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    module = _load_file(spec, Path(where), what) if is_file else _import(spec, where, what)
    found: object = module
    for part in name.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{what} {spec!r}: {module.__name__} ({getattr(module, '__file__', '?')}) "
                             f"has no attribute {name!r}")
        found = getattr(found, part)
    return found


def _import(spec: str, module: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module != err.name and not module.startswith(err.name + "."):
            raise ValueError(f"{what} {spec!r}: importing {module} failed: {type(err).__name__}: "
                             f"{err}") from None  # the module exists; something it imports does not
        raise ValueError(f"{what} {spec!r}: no module named {module!r} (give an importable module, "
                         "or a path ending in .py)") from None
    except Exception as err:  # noqa: BLE001 - the module's own import-time failure
        raise ValueError(f"{what} {spec!r}: importing {module} failed: {type(err).__name__}: "
                         f"{err}") from None


def _load_file(spec: str, path: Path, what: str) -> ModuleType:
    """The file as the module named by its stem, its folder on ``sys.path`` (so that pickles of
    its functions load by name in other processes)."""
    if path.suffix != ".py":
        raise ValueError(f"{what} {spec!r}: {path} is not a .py file ({_USAGE})")
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: no such file {path}")
    stem = path.stem
    if not stem.isidentifier():
        raise ValueError(f"{what} {spec!r}: {path.name} cannot be imported by name (its stem "
                         f"{stem!r} is not a Python identifier); rename the file")
    loaded = sys.modules.get(stem)
    if loaded is not None:
        if getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
            return loaded
        raise ValueError(f"{what} {spec!r}: the file's module name {stem!r} is already taken by "
                         f"{getattr(loaded, '__file__', None) or 'a built-in module'}; rename the file")
    if stem in sys.stdlib_module_names:
        raise ValueError(f"{what} {spec!r}: the file's module name {stem!r} would shadow the "
                         "standard library module of that name; rename the file")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
        _warn_of_shadows(spec, path.parent, what)
    importlib.invalidate_caches()
    module_spec = importlib.util.spec_from_file_location(stem, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what} {spec!r}: cannot load {path} as a module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[stem] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[stem]
        raise ValueError(f"{what} {spec!r}: running {path} failed: {type(err).__name__}: {err}") from None
    return module


def _warn_of_shadows(spec: str, folder: Path, what: str) -> None:
    """Warn (one line) when ``folder``, now first on ``sys.path``, holds modules named like the
    standard library's: a reward or step process imports its modules afresh, so it would take
    ``folder/json.py`` for ``json`` where this process, which imported ``json`` before, does not."""
    shadows = sorted(p.name for p in folder.iterdir() if p.stem in sys.stdlib_module_names
                     and (p.suffix == ".py" or (p / "__init__.py").is_file()))
    if shadows:
        _log.warning("%s %r: its folder %s holds %s, which the reward processes import in place of the "
                     "standard library's module of that name; rename or move them", what, spec, folder,
                     ", ".join(shadows))
