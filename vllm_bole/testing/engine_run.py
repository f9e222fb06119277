"""vLLM engines with or without vllm-bole's tree speculation, each in an isolated subprocess, for the
tests and the main job (:mod:`vllm_bole.smoke`).

Parent side (imports neither vllm nor transformers): :func:`run_engine` writes a request JSON, starts
``python -m vllm_bole.testing.engine_run REQUEST RESULT`` through
:func:`~vllm_bole.testing.isolation.run_isolated` and returns the child's result. One engine runs a
list of jobs in order, so the tests pay one engine start (~20 s on 2 cores) per configuration, not
per check:

* :func:`generate_job`: ``LLM.generate`` on token-id prompts, greedy (or the given sampling params),
  ``ignore_eos``; returns tokens and optionally top-k logprobs per position. ``rescore=k`` then
  scores every prompt + generated stream again as one prompt (``prompt_logprobs=k``): the same
  engine's logprobs at the same positions, computed by its prefill path instead of its decode path,
  which is the engine's own numerical noise (:mod:`vllm_bole.testing.lossless`).
* :func:`mixed_job`: drives ``LLMEngine`` step by step: requests arrive at given steps (so prefill
  chunks share batches with tree decodes), some are aborted after a given number of steps; returns
  each request's tokens and finish reason.
* :func:`gate_job`: waits for a go file, so that engines started side by side are timed one at a time.

Every job result carries the tree runner's counters of that job (``bole_stats`` through
``collective_rpc``, the difference across the job) when tree speculation is on, and its seconds.
``hf_job=i`` runs transformers' teacher-forced reference (:mod:`vllm_bole.testing.hf_reference`)
on job ``i``'s greedy streams after the engine has shut down; ``probe=True`` reports from inside
the worker whether the plugin was registered there (:class:`PluginProbe`). ``fault`` injects a
known bug into the tree runner, to show that a check catches it, or a hostile condition the runner
must withstand (:data:`FAULTS`).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from vllm_bole.testing.isolation import RunnerError, engine_env, kill_group, run_isolated, tail

ENGINE_TIMEOUT_S = 600
PROBE_CLS = "vllm_bole.testing.engine_run.PluginProbe"
# vLLM's jit monitor: "Triton kernel JIT compilation during inference: <kernel> (<constants>). This causes..."
JIT_KERNEL = re.compile(r"during inference: ([\w.]+)")
JIT_COMPILED = re.compile(r"during inference: (.+?)\. This causes")  # the kernel with its constants
JOB_MARK = "engine_run: job "  # the child's mark on stderr before each job
# what an in-process engine run does first (``from vllm import LLM``; with ``hf_job`` after hiding FLA),
# done once by a fork server (``isolation.forked_runs``)
PRELOAD = "vllm.entrypoints.llm"
PRELOAD_HF = "vllm_bole.testing.tiny_models:hide_fla," + PRELOAD


def checkpoint_dtype(model_dir) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def prompt_token_ids(model_dir, prompts) -> list[list[int]]:
    """Tokenise with the checkpoint's own tokenizer (``tokenizers`` only, no special tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return [tok.encode(p, add_special_tokens=False).ids for p in prompts]


def build_models(out_dir, archs=None, timeout: float = 600) -> dict[str, Path]:
    """Build (or reuse, see ``tiny_models``) the tiny checkpoints under ``out_dir`` in a subprocess,
    which keeps transformers out of the calling process. Returns {arch: path}."""
    from vllm_bole.testing.tiny_models import ARCHS

    archs = list(archs or ARCHS)
    argv = [sys.executable, "-m", "vllm_bole.testing.tiny_models", "--out", str(out_dir)]
    for a in archs:
        argv += ["--arch", a]
    out = run_isolated(argv, timeout=timeout, env=engine_env())
    paths = dict(line.split("\t") for line in out.splitlines() if line.count("\t") == 1)
    missing = [a for a in archs if a not in paths]
    if missing:
        raise RunnerError(f"tiny model build did not report {missing}; output tail:\n{tail(out)}")
    return {a: Path(paths[a]) for a in archs}


def generate_job(prompts, max_tokens: int = 64, *, logprobs: int | None = None, sampling: dict | list | None = None,
                 rescore: int | None = None, budget: int | str | None = None, concurrency: int | None = None,
                 warm_up: bool = False, tree_graphs: bool = False) -> dict:
    """``sampling``: extra ``SamplingParams`` fields for every prompt, or a list of them, one per prompt.
    A ``stop_token_ids`` value ``{"from_job": j, "prompt": p, "start": a, "end": b}`` means the distinct
    tokens ``a:b`` of an earlier job's stream ``p``. ``budget``: the tree node budget from this job on
    (``bole_set_budget``).
    ``concurrency``: at most that many requests in flight, each finished one replaced by the next (:func:`_stream`).
    ``warm_up``: the tree runner's warm-up steps first (``bole_warm_up``; its report in ``warm_up``).
    ``tree_graphs``: then the tree-step graphs (``bole_capture_tree_graphs``, with ``VLLM_BOLE_TREE_GRAPHS=1``
    in the engine's environment; its bucket count in ``tree_graphs``)."""
    return dict(kind="generate", prompts=prompts, max_tokens=max_tokens, logprobs=logprobs,
                sampling=sampling or {}, rescore=rescore, budget=budget, concurrency=concurrency, warm_up=warm_up,
                tree_graphs=tree_graphs)


def gate_job(ready, go) -> dict:
    """Create the file ``ready`` (the engine has started), then wait until the file ``go`` exists: engines
    started side by side then run their jobs one at a time (``benchmarks/bench_e2e.py --parallel``)."""
    return dict(kind="gate", ready=str(ready), go=str(go))


def mixed_job(requests: list[dict], max_tokens: int, logprobs: int | None = None, rescore: int | None = None) -> dict:
    """Requests arriving at given engine steps (``arrive``), some aborted (``abort_after`` steps), each with
    its own params; ``logprobs=k``: the greedy requests' top-k per position (``top``), ``rescore=k``: then
    their streams scored again through the prefill path (``rescored``), as :func:`generate_job`'s."""
    return dict(kind="mixed", requests=requests, max_tokens=max_tokens, logprobs=logprobs, rescore=rescore)


def mixed_streams(outputs: dict, ids) -> dict:
    """The mixed job's requests ``ids`` as a generate job's result (``tokens``, ``top``, ``rescored`` where the
    job recorded them), in that order: what :func:`~vllm_bole.testing.lossless.compare_greedy` reads."""
    return {key: [outputs[i][key] for i in ids] for key in ("tokens", "top", "rescored") if key in outputs[ids[0]]}


def soak_job(prompts, seconds: float, *, seed: int = 0, concurrency: int = 24, max_tokens: int = 96) -> dict:
    """Requests arriving at random for ``seconds`` (then drained), at most ``concurrency`` at once:
    half greedy, half sampled, some with penalties or a stop string, some aborted at a random step;
    GPU memory sampled as it runs. Returns every request (prompt, params, tokens, finish reason).
    Request ``i`` is ``soak_requests(prompts, i + 1, seed, max_tokens)[i]`` whatever the timing (arrivals
    draw from a stream of their own), so its baseline can run beside the soak."""
    return dict(kind="soak", prompts=prompts, seconds=seconds, seed=seed, concurrency=concurrency,
                max_tokens=max_tokens)


def soak_requests(prompts, n: int, seed: int = 0, max_tokens: int = 96) -> list[dict]:
    """The first ``n`` requests of :func:`soak_job`: {prompt, params, abort_after (engine steps after
    arrival, or None)}."""
    import random

    rng = random.Random(seed)
    return [_soak_request(rng, prompts, max_tokens) for _ in range(n)]


def _soak_request(rng, prompts, max_tokens: int) -> dict:
    p = dict(max_tokens=rng.randint(8, max_tokens), ignore_eos=True)
    if rng.random() < 0.5:
        p.update(temperature=0.0)
    else:
        p.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30))
    if rng.random() < 0.3:
        p.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
    if rng.random() < 0.2:
        p.update(stop=[" the", "\n\n"])
    return dict(prompt=rng.choice(prompts), params=p, abort_after=rng.randint(1, 40) if rng.random() < 0.1 else None)


def run_engine(model_dir, jobs: list[dict], *, spec: dict | None = None, llm_kwargs: dict | None = None,
               hf_job: int | None = None, probe: bool = False, fault: str | None = None,
               multiprocessing: bool = False, timeout: float = ENGINE_TIMEOUT_S, env: dict | None = None) -> dict:
    """One engine in a subprocess running ``jobs`` (module docstring). ``spec``: the user speculative
    config (None: no speculation). Returns {jobs: [result per job], start_s, seconds, log (its tail),
    plugin_lines (the log's lines from the plugin)[, workers]}."""
    model_dir = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="vllm_bole_engine") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(dict(model=str(model_dir), spec=spec, jobs=jobs, llm_kwargs=llm_kwargs or {},
                                       hf_job=hf_job, probe=probe, fault=fault)))
        e = engine_env(multiprocessing)
        e.update(env or {})
        preload = None if multiprocessing or env else PRELOAD_HF if hf_job is not None else PRELOAD
        t0 = time.monotonic()
        log = run_isolated([sys.executable, "-m", "vllm_bole.testing.engine_run", str(req), str(res)],
                           timeout=timeout, env=e, preload=preload)
        if not res.exists():
            raise RunnerError(f"runner wrote no result; output tail:\n{tail(log)}")
        result = json.loads(res.read_text())
    result["seconds"] = time.monotonic() - t0
    result["log"] = tail(log, 3000)
    result["plugin_lines"] = [ln for ln in log.splitlines() if "vllm-bole" in ln][:50]
    # Triton kernels compiled while serving (vLLM's jit monitor; every compilation with its constants and
    # signature where the engine runs ``jit_monitor_verbose``): per engine, and per job from its log lines
    jit = [ln for ln in log.splitlines() if "JIT compilation during inference" in ln]
    result["jit_warnings"] = len(jit)
    result["jit_kernels"] = sorted({m.group(1) for m in map(JIT_KERNEL.search, jit) if m})
    for i, lines in _job_logs(log).items():
        if i < len(result["jobs"]):
            result["jobs"][i]["jit_compiled"] = [m.group(1)[:600] for m in map(JIT_COMPILED.search, lines) if m]
    return result


def _job_logs(log: str) -> dict[int, list[str]]:
    """{job index: the log's lines after its mark and before the next} (the driver marks each job's start
    on stderr; its engine core's and workers' lines land in the same log)."""
    out: dict[int, list[str]] = {}
    cur = None
    for ln in log.splitlines():
        if ln.startswith(JOB_MARK):
            cur = int(ln[len(JOB_MARK):])
            out[cur] = []
        elif cur is not None:
            out[cur].append(ln)
    return out


# ----------------------------------------------------------------------------- child side

class PluginProbe:
    """vLLM worker extension (``worker_extension_cls``): adds ``vllm_bole_probe`` to the worker."""

    def vllm_bole_probe(self) -> dict:
        import vllm.plugins

        import vllm_bole.plugin as plugin

        registered = plugin._registered
        checks = []
        original = plugin.check_vllm_version

        def counting_check(version):
            checks.append(version)
            return original(version)

        plugin.check_vllm_version = counting_check
        try:
            plugin.register()  # must do nothing: vLLM's loader already ran it in this process
            plugin.register()
        finally:
            plugin.check_vllm_version = original
        return dict(pid=os.getpid(), registered=registered, plugins_loaded=vllm.plugins.plugins_loaded,
                    repeat_register_checks=len(checks), registered_after=plugin._registered)


def _fault_gdn_commit_parent() -> None:
    """GDN states committed from the parent of the accepted leaf (the last accepted token is lost
    from every Gated DeltaNet state; conv states and K/V stay right)."""
    from vllm_bole import gdn

    orig = gdn.stash_accepted_path

    def stash(pending, slots, tree, accepted, *args, **kwargs):
        acc = accepted.clone()
        n = (acc >= 0).sum(1)
        rows = (n >= 2).nonzero().flatten()
        acc[rows, n[rows] - 1] = -1
        return orig(pending, slots, tree, acc, *args, **kwargs)

    gdn.stash_accepted_path = stash


def _fault_pool_reuse() -> None:
    """Not a bug: what vLLM's piecewise CUDA graphs do to a splitting op's inputs, on CPU. Each recurrent
    layer's tree-token rows of the input vLLM handed it (GDN's ``mixed_qkv``, Mamba2's conv and dt columns of
    the projected states) are overwritten with NaN right after the layer's tree forward, as the next graph
    piece overwrites pool memory; the commit after the whole forward must not read them (outputs unchanged)."""
    from vllm_bole.adapter.layers.gdn import GDNLayer
    from vllm_bole.adapter.layers.mamba2 import Mamba2Layer

    tree_core, tree_forward = GDNLayer._tree_core, Mamba2Layer._tree_forward

    def gdn_core(self, step, mixed_qkv, *args):
        tree_core(self, step, mixed_qkv, *args)
        mixed_qkv[step.tok_start : step.tok_start + step.num_tokens].fill_(float("nan"))

    def mamba2_forward(self, step, projected_states, output):
        tree_forward(self, step, projected_states, output)
        s, T = step.tok_start, step.num_tokens
        projected_states[s : s + T, self.module.tped_intermediate_size :].fill_(float("nan"))  # the gate stays

    GDNLayer._tree_core, Mamba2Layer._tree_forward = gdn_core, mamba2_forward


def _fault_piecewise_padding() -> None:
    """Not a bug: what vLLM's piecewise CUDA graphs do to a split step's plain rows
    (``TreeRunnerMixin._bole_plain_graph``), on CPU: their forward padded to the next multiple of 64 tokens
    (the padding rows hold the trees' own tokens in vLLM's buffers, KV slot -1), run eagerly; the outputs
    must stay non-speculative vLLM's."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from vllm_bole.adapter.runner import TreeRunnerMixin

    TreeRunnerMixin._bole_plain_graph = lambda self, n: (CUDAGraphMode.NONE, BatchDescriptor(num_tokens=n + 64 - n % 64))


FAULTS = {"gdn_commit_parent": _fault_gdn_commit_parent, "pool_reuse": _fault_pool_reuse,
          "piecewise_padding": _fault_piecewise_padding}


def _llm(req):
    from vllm import LLM

    kwargs = dict(model=req["model"], dtype=checkpoint_dtype(req["model"]), enforce_eager=True, seed=0,
                  max_model_len=512, max_num_seqs=16)
    if req["spec"] is not None:
        kwargs["speculative_config"] = req["spec"]
    if req["probe"]:
        kwargs["worker_extension_cls"] = PROBE_CLS
    kwargs.update(req["llm_kwargs"])
    return LLM(**kwargs)


def _stats(llm, req):
    if (req["spec"] or {}).get("method") != "bole_tree":
        return None
    return llm.collective_rpc("bole_stats")[0]


def _counters(llm) -> dict:
    """vLLM's spec-decode counters and ``engine_steps`` / ``engine_step_tokens`` (its engine steps and their
    tokens, from the ``vllm:iteration_tokens_total`` histogram: any engine, AR included) of
    ``disable_log_stats=False`` engines; else empty."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats logging off
        return {}
    out = {m.name: m.value for m in metrics if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
           and isinstance(m.value, (int, float))}
    for m in metrics:
        if m.name == "vllm:iteration_tokens_total" and hasattr(m, "count"):
            out["engine_steps"] = out.get("engine_steps", 0) + m.count
            out["engine_step_tokens"] = out.get("engine_step_tokens", 0) + m.sum
    return out


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """Counters as differences (``branch_by_depth``'s per-depth counts too); the logs (each list ``log`` beside a
    counter ``{log}_total`` of its records ever appended: accept log, slow steps, step log) as the records appended
    since ``before`` (a log keeps only its latest records); other values (lists, rates) as they are now."""
    if after is None:
        return None
    out = {k: v - before.get(k, 0) if isinstance(v, (int, float)) else v for k, v in after.items()}
    if "budget_buckets" in after:  # choices per token bucket
        was = before.get("budget_buckets", {})
        out["budget_buckets"] = {k: v - was.get(k, 0) for k, v in after["budget_buckets"].items() if v > was.get(k, 0)}
    if "branch_by_depth" in after:
        out["branch_by_depth"] = {c: [a - b for a, b in zip(v, before["branch_by_depth"][c])]
                                  for c, v in after["branch_by_depth"].items()}
    for log in [k.removesuffix("_total") for k in after if k.endswith("_total") and k.removesuffix("_total") in after]:
        rec = after[log]  # the records appended since (those the log still keeps)
        out[log] = rec[max(len(rec) - out[f"{log}_total"], 0):]
    return out


def _top_rows(rows) -> list:
    """vLLM logprob dicts -> [[token, logprob], ...] best first, per position."""
    return [sorted(([int(t), lp.logprob] for t, lp in step.items()), key=lambda x: -x[1]) for step in rows]


def _stop_ids(value, done: list) -> list[int]:
    if isinstance(value, dict):
        stream = done[value["from_job"]]["tokens"][value["prompt"]]
        return sorted(set(stream[value["start"]: value["end"]]))
    return value


def _generate(llm, job, done: list) -> dict:
    from vllm import SamplingParams

    per_prompt = job["sampling"] if isinstance(job["sampling"], list) else [job["sampling"]] * len(job["prompts"])
    params = []
    for extra in per_prompt:
        sp = dict(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
        sp.update(extra)
        if "logit_bias" in sp:  # JSON object keys arrive as strings
            sp["logit_bias"] = {int(t): b for t, b in sp["logit_bias"].items()}
        if "stop_token_ids" in sp:
            sp["stop_token_ids"] = _stop_ids(sp["stop_token_ids"], done)
        if job["logprobs"]:
            sp["logprobs"] = job["logprobs"]
        params.append(SamplingParams(**sp))
    outs, times, t0 = _stream(llm, job["prompts"], params, job.get("concurrency") or len(params))
    out = dict(tokens=[list(o.outputs[0].token_ids) for o in outs], generate_s=time.monotonic() - t0, top=None,
               times=times)
    if job["logprobs"]:
        out["top"] = [_top_rows(o.outputs[0].logprobs) for o in outs]
    if job["rescore"]:
        out["rescored"] = _rescore(llm, job["prompts"], out["tokens"], job["rescore"])
    return out


def _rescore(llm, prompts, streams, k: int) -> list:
    """Each stream's top-k logprobs per position once more, through the prefill path (its prompt + stream)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    again = llm.generate([dict(prompt_token_ids=list(p) + list(t)) for p, t in zip(prompts, streams)], sp,
                         use_tqdm=False)
    return [_top_rows(o.prompt_logprobs[len(p):]) for o, p in zip(again, prompts)]


def _stream(llm, prompts, params, limit: int):
    """``prompts`` through the engine with at most ``limit`` requests in flight, a finished one replaced at once
    by the next (``vllm bench serve --max-concurrency``; all at once: ``LLM.generate``'s own loop). Returns
    the final outputs in submission order, per request [submitted, first token, finished] seconds from the
    start, and the start (``time.monotonic``)."""
    engine, t0 = llm.llm_engine, time.monotonic()
    ids = [str(next(llm.request_counter)) for _ in prompts]
    final, times, nxt, live = {}, {}, 0, 0
    while nxt < len(prompts) or live:
        while nxt < len(prompts) and live < limit:
            engine.add_request(ids[nxt], dict(prompt_token_ids=prompts[nxt]), params[nxt])
            times[ids[nxt]] = [time.monotonic() - t0, None, None]
            nxt, live = nxt + 1, live + 1
        for o in engine.step():
            t = times[o.request_id]
            if t[1] is None and o.outputs and o.outputs[0].token_ids:
                t[1] = time.monotonic() - t0
            if o.finished:
                t[2], final[o.request_id], live = time.monotonic() - t0, o, live - 1
    return [final[i] for i in ids], [times[i] for i in ids], t0


def _gate(llm, job, done: list) -> dict:
    Path(job["ready"]).touch()
    t0 = time.monotonic()
    while not Path(job["go"]).exists():
        time.sleep(0.01)
    return dict(waited_s=time.monotonic() - t0)


def _mixed(llm, job, done: list) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    pending = sorted(job["requests"], key=lambda r: r.get("arrive", 0))
    aborts = {r["id"]: r["abort_after"] for r in pending if r.get("abort_after") is not None}
    added_at, outputs, finished, step = {}, {}, {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].get("arrive", 0) <= step:
            r = pending.pop(0)
            params = dict(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
            params.update(r.get("params", {}))
            if job.get("logprobs") and params["temperature"] == 0:
                params["logprobs"] = job["logprobs"]
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
            if c is not None and c.logprobs:
                outputs[rid]["top"] = _top_rows(c.logprobs)
            if o.finished:
                finished[rid] = step
        step += 1
        if step > 10_000:
            raise RuntimeError("mixed scenario did not finish")
    if job.get("rescore"):
        reqs = [r for r in job["requests"] if "top" in outputs.get(r["id"], {})]
        rescored = _rescore(llm, [r["prompt"] for r in reqs], [outputs[r["id"]]["tokens"] for r in reqs], job["rescore"])
        for r, rows in zip(reqs, rescored):
            outputs[r["id"]]["rescored"] = rows
    return dict(outputs=outputs, finished_step=finished, added_step=added_at, steps=step)


def _soak(llm, job, done: list) -> dict:
    import random

    import torch
    from vllm import SamplingParams

    engine = llm.llm_engine
    content, arrivals = random.Random(job["seed"]), random.Random(job["seed"] + 1)
    live: dict[str, int] = {}  # request id -> step to abort at (or -1)
    reqs, memory, step, t0 = {}, [], 0, time.monotonic()
    while True:
        arriving = time.monotonic() - t0 < job["seconds"]
        if not arriving and not engine.has_unfinished_requests():
            break
        while arriving and len(live) < job["concurrency"] and arrivals.random() < 0.5:
            rid = f"s{len(reqs)}"
            r = _soak_request(content, job["prompts"], job["max_tokens"])
            engine.add_request(rid, dict(prompt_token_ids=r["prompt"]), SamplingParams(**r["params"]))
            reqs[rid] = dict(prompt=r["prompt"], params=r["params"], tokens=[], finish_reason=None, aborted=False)
            live[rid] = -1 if r["abort_after"] is None else step + r["abort_after"]
        for rid, at in list(live.items()):
            if at == step:
                engine.abort_request([rid])
                reqs[rid]["aborted"] = True
                del live[rid]
        for o in engine.step():
            r = reqs[o.request_id]
            if r["aborted"]:
                continue
            r["tokens"] = list(o.outputs[0].token_ids) if o.outputs else []
            if o.finished:
                r["finish_reason"] = o.outputs[0].finish_reason if o.outputs else None
                live.pop(o.request_id, None)
        if torch.cuda.is_available() and step % 500 == 0:
            memory.append([round(time.monotonic() - t0, 1), torch.cuda.memory_allocated()])
        step += 1
    return dict(requests=reqs, steps=step, memory=memory)


def _run(req) -> dict:
    if req["hf_job"] is not None:
        from vllm_bole.testing.tiny_models import hide_fla

        hide_fla()  # before vllm imports transformers
    if req["fault"]:
        FAULTS[req["fault"]]()
    t0 = time.monotonic()
    llm = _llm(req)
    out: dict = dict(start_s=time.monotonic() - t0, jobs=[])
    try:
        if req["probe"]:
            import vllm_bole.plugin

            out["driver"] = dict(pid=os.getpid(), registered=vllm_bole.plugin._registered)
            out["workers"] = llm.collective_rpc("vllm_bole_probe")
        for i, job in enumerate(req["jobs"]):
            print(f"{JOB_MARK}{i}", file=sys.stderr, flush=True)  # the log's lines from here on are this job's
            if job.get("deadline") and time.time() > job["deadline"]:
                out["jobs"].append(dict(skipped="deadline"))
                continue
            if job.get("budget") is not None:
                llm.collective_rpc("bole_set_budget", args=(job["budget"],))
            warm = llm.collective_rpc("bole_warm_up") if job.get("warm_up") else None
            graphs = llm.collective_rpc("bole_capture_tree_graphs") if job.get("tree_graphs") else None
            before, counters, t1 = _stats(llm, req), _counters(llm), time.monotonic()
            res = dict(generate=_generate, mixed=_mixed, soak=_soak, gate=_gate)[job["kind"]](llm, job, out["jobs"])
            res["seconds"] = time.monotonic() - t1
            res["stats"] = stats_delta(before, _stats(llm, req))
            res["counters"] = {k: v - counters.get(k, 0) for k, v in _counters(llm).items()}
            if warm is not None:
                res["warm_up"] = warm
            if graphs is not None:
                res["tree_graphs"] = graphs
            out["jobs"].append(res)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    if req["hf_job"] is not None:
        from vllm_bole.testing.hf_reference import teacher_forced

        job, res = req["jobs"][req["hf_job"]], out["jobs"][req["hf_job"]]
        res["hf"] = teacher_forced(req["model"], checkpoint_dtype(req["model"]), job["prompts"], res["tokens"],
                                   res["top"])
    out["pid"] = os.getpid()
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m vllm_bole.testing.engine_run REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    Path(argv[1]).write_text(json.dumps(_run(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
