"""Small file-system helpers shared by the modules that write a run's files."""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["make_readable", "whole_folder"]


@contextlib.contextmanager
def whole_folder(path: str | Path) -> Iterator[Path]:
    """A folder written whole or not at all: the block writes into a temporary sibling, which
    replaces ``path`` when the block ends without an error (a full disk, a crash) and is removed
    when it raises. Yields the temporary folder. The old folder is moved aside before the new one
    takes its name and deleted only after, so a failed swap leaves it in place; ``path`` that is a
    file or a link (not a folder) is refused before the block runs (``FileExistsError``)."""
    path = Path(os.path.abspath(path))  # "." and "x/.." name a folder with a parent, links not followed
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise FileExistsError(f"{path}: not a folder; a folder is written there only in place of a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".tmp_{path.name}_", dir=path.parent))
    try:
        yield partial
        partial.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700
        old = Path(tempfile.mkdtemp(prefix=f".old_{path.name}_", dir=path.parent)) / "old"
        try:
            if path.exists():
                path.rename(old)
            try:
                partial.rename(path)
            except BaseException:
                if old.exists():
                    old.rename(path)
                raise
        finally:
            shutil.rmtree(old.parent, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def make_readable(path: Path) -> None:
    """Give a file safetensors wrote (0600) the permissions of any other new file (0666 less the umask)."""
    Path(path).chmod(0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without setting it: ``os.umask`` can only be read by changing it,
    and a file another thread creates in that moment would get the temporary mask."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    with tempfile.TemporaryDirectory() as folder:  # elsewhere: what a new file gets
        probe = Path(folder) / "probe"
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o666))
        return 0o666 & ~probe.stat().st_mode & 0o777
