"""Small file-system helpers shared by the modules that write a run's files."""

import os
from pathlib import Path

__all__ = ["make_readable"]


def make_readable(path: Path) -> None:
    """Give a file safetensors wrote (0600) the permissions of any other new file (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    Path(path).chmod(0o666 & ~umask)
