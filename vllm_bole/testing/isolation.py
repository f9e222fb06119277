"""Subprocesses that cannot outlive their caller: every vLLM engine of the tests and of the main job
runs in one (own session, timeout, whole process group killed afterwards in every case), so no engine
process is ever orphaned.

Inside :func:`forked_runs` (the test session), a ``python -m MODULE ...`` run given a ``preload``
instead forks from a server process that has run the preload (importing vLLM: ~13 s on 2 cores) once:
the child is a fresh copy of that process, in its own session, timed out and killed as a group alike.
The server only imports (what multiprocessing's fork start method does after ``import torch``): it
must never run a tensor operation, since a child forked after OpenMP's thread pool started can hang.

    python -m vllm_bole.testing.isolation --serve PRELOAD   (the server; requests on stdin)
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


class RunnerError(RuntimeError):
    pass


def kill_group(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.5)


def tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def run_isolated(argv: list[str], timeout: float, env: dict | None = None, preload: str | None = None) -> str:
    """Run ``argv`` in a new session; return its combined output. Raise RunnerError on a non-zero
    exit or a timeout. The whole process group is killed afterwards whatever happened. ``preload``
    (``argv`` being ``python -m ...``): comma-separated modules to import, ``MODULE:FUNCTION`` to call;
    inside :func:`forked_runs`, ``argv`` forks from the server of that preload and ``env`` (up to pytest's
    per-test ``PYTEST_CURRENT_TEST``; the child then runs with ``env`` itself)."""
    if _servers is not None and preload and argv[:2] == [sys.executable, "-m"]:
        env = dict(os.environ if env is None else env)
        key = json.dumps([preload, {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}], sort_keys=True)
        if key not in _servers:
            _servers[key] = ForkServer(preload, env, timeout)
        return _servers[key].run(argv[2:], env, timeout)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            out, _ = proc.communicate()
            raise RunnerError(f"{argv} timed out after {timeout:.0f} s; output tail:\n{tail(out)}")
    finally:
        kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RunnerError(f"{argv} exited with {proc.returncode}; output tail:\n{tail(out)}")
    return out


def engine_env(multiprocessing: bool = True) -> dict:
    """Environment for an engine subprocess. ``multiprocessing=False`` runs vLLM's engine core and its
    worker inside the subprocess itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): about 30 s faster per
    engine on CPU than the default engine-core + worker processes, each spawned and importing vLLM."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    return env


_servers: dict[str, ForkServer] | None = None  # [preload, env] -> its server, inside forked_runs()


@contextlib.contextmanager
def forked_runs():
    """Within: runs with a ``preload`` fork from its server (module docstring); servers closed after."""
    global _servers
    _servers = {}
    try:
        yield
    finally:
        for server in _servers.values():
            server.close()
        _servers = None


class ForkServer:
    """The parent side of ``--serve``: one run at a time, each answered ``pid N`` then ``rc N``."""

    def __init__(self, preload: str, env: dict, timeout: float):
        self.log, self._buf = tempfile.TemporaryFile(mode="w+"), b""
        self.proc = subprocess.Popen([sys.executable, "-m", "vllm_bole.testing.isolation", "--serve", preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True, env=env)
        if self._line(timeout) != "ready":
            self.close()
            raise RunnerError(f"fork server {preload} did not start; output tail:\n{self._tail()}")

    def _tail(self) -> str:
        self.log.seek(0)
        return tail(self.log.read())

    def _line(self, timeout: float) -> str | None:
        """The server's next line, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RunnerError(f"fork server exited with {self.proc.wait()}; output tail:\n{self._tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def run(self, argv: list[str], env: dict, timeout: float) -> str:
        """Like :func:`run_isolated` for ``python -m`` + ``argv``."""
        with tempfile.TemporaryDirectory(prefix="vllm_bole_fork") as tmp:
            log = Path(tmp) / "log"
            self.proc.stdin.write((json.dumps(dict(argv=argv, env=env, log=str(log))) + "\n").encode())
            self.proc.stdin.flush()
            pid = self._line(60)
            if pid is None:
                raise RunnerError(f"fork server did not start {argv}; output tail:\n{self._tail()}")
            pid = int(pid.split()[1])
            try:
                rc = self._line(timeout)
                if rc is None:
                    kill_group(pid)
                    self._line(60)
            finally:
                kill_group(pid)
            out = log.read_text()
        if rc is None:
            raise RunnerError(f"{argv} timed out after {timeout:.0f} s; output tail:\n{tail(out)}")
        if rc != "rc 0":
            raise RunnerError(f"{argv} exited with {rc.split()[1]}; output tail:\n{tail(out)}")
        return out

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _serve(preload: str) -> int:
    """Do ``preload``, then fork every requested ``python -m`` run: the child starts its own session,
    takes the request's environment, writes stdout and stderr to its log and exits with the module's
    exit status."""
    out = os.fdopen(os.dup(1), "w")  # the answers; anything else printed goes to stderr
    os.dup2(2, 1)
    for step in preload.split(","):
        module, _, func = step.partition(":")
        m = importlib.import_module(module)
        if func:
            getattr(m, func)()
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setsid()
            out.close()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.clear()
            os.environ.update(req["env"])
            rc = 1
            try:
                sys.argv = list(req["argv"])
                runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:  # noqa: BLE001 - reported like an uncaught exception
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        print(f"pid {pid}", file=out, flush=True)
        print(f"rc {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", file=out, flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        print("usage: python -m vllm_bole.testing.isolation --serve PRELOAD", file=sys.stderr)
        sys.exit(2)
    sys.exit(_serve(sys.argv[2]))
