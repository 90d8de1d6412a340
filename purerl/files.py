"""Small file-system helpers shared by the modules that write a run's files."""

import os
import tempfile
from pathlib import Path

__all__ = ["make_readable"]


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
