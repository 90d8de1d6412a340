"""``python3 SCRIPT …`` and ``python3 -m MODULE …`` for the tests, run in a fork of an interpreter
that has already imported torch, transformers and purerl.

Why: a tiny job does ~0.3 s of work after ~3.5 s of importing (measured on a 2-core box; each of
the suite's ~150 script runs paid it). :func:`run` and :class:`Popen` take the arguments the tests
gave ``subprocess`` (a subset) and return what it returns; the command runs in a child of a
``multiprocessing`` fork server that preloaded :data:`PRELOAD`, set up as ``python3`` would set it
up: the working folder, the environment, ``sys.argv``, ``sys.path`` (the script's folder, then
``PYTHONPATH``, then the interpreter's own), standard streams on the given files, ``__main__``;
at the end the interpreter's own exit (non-daemon threads joined, ``atexit`` handlers, the exit
status of ``SystemExit``, a traceback and status 1 for an uncaught exception, death by SIGINT for
an uncaught ``KeyboardInterrupt``). Its PID is real: signals and ``/proc`` reach it.

What still differs from a fresh interpreter, and how the tests keep it out:

- The preloaded modules ran their module-level code once, in the server, under the server's
  environment. A command whose environment differs from the server's in a variable read while
  those modules load (:data:`IMPORT_TIME_ENV`: thread counts, ATen's kernels, hash seed, …) runs
  as a fresh ``subprocess`` instead, as does any other command (another program, other interpreter
  flags, ``preexec_fn``).
- What happens while torch loads (a Ctrl-C then) cannot happen here: the tests of the script's
  start (``tests/test_reliability.py``) and ``tests/test_experiment.py`` call ``subprocess``
  themselves, so the suite still runs the script as users do.

``PURERL_FRESH_PROCESSES=1`` runs every command as a fresh ``subprocess`` (to rule this module out).
"""

import io
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["IMPORT_TIME_ENV", "PRELOAD", "Popen", "run"]

PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "matplotlib.pyplot", "purerl.command",
           "purerl.run", "purerl.report", "purerl.replay"]
"""What the fork server imports once (purerl.command: the job's command line; purerl.run: everything it runs;
pyplot: its ``curve.png``)."""

IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_", "ONEDNN_", "DNNL_", "TORCH", "PYTORCH_", "CUDA_",
                   "TRANSFORMERS_", "HF_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONIOENCODING", "PYTHONUTF8",
                   "PYTHONDONTWRITEBYTECODE", "LANG", "LC_", "LD_", "MPL")
"""Prefixes of environment variables that the preloaded modules (or the interpreter) read as they
load: a command that sets any of them otherwise than the server had them runs fresh."""

_context = None
_server_env: dict[str, str] = {}
_base_path: list[str] = []


def _forkserver() -> multiprocessing.context.BaseContext:
    """The fork server's context, started (with this process's environment) on first use."""
    global _context, _server_env, _base_path
    if _context is None:
        done = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                              capture_output=True, text=True, check=True, cwd="/",
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        import json

        _base_path = json.loads(done.stdout)[1:]  # what a fresh interpreter has after its first entry
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server_env, _context = dict(os.environ), context
    return _context


def _forkable(cmd: Sequence[str], env: Mapping[str, str]) -> bool:
    if os.environ.get("PURERL_FRESH_PROCESSES") == "1":
        return False
    if len(cmd) < 2 or cmd[0] not in (sys.executable, "python", "python3"):
        return False
    if cmd[1].startswith("-") and cmd[1] not in ("-m", "-c"):
        return False
    server = _server_env if _context is not None else os.environ
    keys = {k for k in (*env, *server) if k.startswith(IMPORT_TIME_ENV)}
    return all(env.get(k) == server.get(k) for k in keys)


def _child(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, base_path: list[str]) -> None:
    """In the forked child: become ``python3 *argv`` (module docstring) and exit as it would."""
    import atexit
    import runpy
    import threading
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(target, fd)
        os.close(target)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                   line_buffering=False, write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", line_buffering=True,
                                                   write_through=unbuffered)
    multiprocessing.current_process()._config.pop("daemon", None)  # it may start processes of its own
    kind, target, args = ("-m", argv[1], argv[2:]) if argv[0] == "-m" else \
        ("-c", argv[1], argv[2:]) if argv[0] == "-c" else ("", argv[0], argv[1:])
    first = os.path.dirname(os.path.abspath(target)) if not kind else "" if kind == "-c" else os.getcwd()
    sys.path[:] = [first, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *base_path]
    code: int = 0
    try:
        if kind == "-m":
            sys.argv = [target, *args]
            runpy._run_module_as_main(target)  # what `python -m` calls: sys.argv[0] becomes the file
        elif kind == "-c":
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the command's frames, as python3
        code = -signal.SIGINT
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    threading._shutdown()  # the interpreter's exit: non-daemon threads, then atexit, then the streams
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # an uncaught KeyboardInterrupt: CPython dies by the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


class _Output:
    """``proc.stdout`` of a forked command: its text once it has ended (``read`` waits for that)."""

    def __init__(self, proc: "Popen", path: str) -> None:
        self._proc, self._path = proc, path

    def read(self, size: int | None = -1) -> str:
        self._proc.wait()
        return Path(self._path).read_text(encoding="utf-8", errors="replace")


class Popen:
    """``subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE or STDOUT, text=True, cwd=…, env=…)`` for a
    Python command in the fork server (a fresh ``subprocess.Popen`` otherwise: module docstring)."""

    def __init__(self, cmd: Sequence[str], *, cwd: str | Path | None = None, env: Mapping[str, str] | None = None,
                 merge_stderr: bool = False, preexec_fn: object = None) -> None:
        cmd, env = [str(c) for c in cmd], dict(os.environ if env is None else env)
        self.args, self.returncode = cmd, None
        self._fresh: subprocess.Popen | None = None
        if preexec_fn is not None or not _forkable(cmd, env):
            self._fresh = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, text=True,
                                           stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                           preexec_fn=preexec_fn)
            self.pid, self.stdout, self.stderr = self._fresh.pid, self._fresh.stdout, self._fresh.stderr
            return
        context = _forkserver()
        folder = tempfile.mkdtemp(prefix="purerl-forked-")
        weakref.finalize(self, shutil.rmtree, folder, True)
        out = os.path.join(folder, "stdout")
        err = out if merge_stderr else os.path.join(folder, "stderr")
        for path in {out, err}:
            Path(path).touch(0o600)
        argv = cmd[1:]
        self._process = context.Process(target=_child, daemon=False, name=f"forked {' '.join(argv)[:60]}",
                                        args=(argv, str(cwd or os.getcwd()), env, out, err, _base_path))
        self._process.start()
        self.pid = self._process.pid
        self.stdout = _Output(self, out)
        self.stderr = None if merge_stderr else _Output(self, err)

    def poll(self) -> int | None:
        if self._fresh is not None:
            self.returncode = self._fresh.poll()
        elif self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._fresh is not None:
            self.returncode = self._fresh.wait(timeout)
            return self.returncode
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        if self._fresh is not None:
            out, err = self._fresh.communicate(timeout=timeout)
            self.returncode = self._fresh.returncode
            return out, err
        self.wait(timeout)
        return self.stdout.read(), None if self.stderr is None else self.stderr.read()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(cmd: Sequence[str], *, cwd: str | Path | None = None, env: Mapping[str, str] | None = None,
        timeout: float | None = None, check: bool = False, preexec_fn: object = None
        ) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, …)`` for a Python command (module docstring)."""
    proc = Popen(cmd, cwd=cwd, env=env, preexec_fn=preexec_fn)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
