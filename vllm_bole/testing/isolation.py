"""Subprocesses that cannot outlive their caller: every vLLM engine of the tests and of the main job
runs in one (own session, timeout, whole process group killed afterwards in every case), so no engine
process is ever orphaned."""
from __future__ import annotations

import os
import signal
import subprocess
import time


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


def run_isolated(argv: list[str], timeout: float, env: dict | None = None) -> str:
    """Run ``argv`` in a new session; return its combined output. Raise RunnerError on a non-zero
    exit or a timeout. The whole process group is killed afterwards whatever happened."""
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
