"""End-to-end decoding speed inside vLLM 0.33 on the H200: no speculation (``ar``), vLLM's own chain
speculation (``vllm_chain``) and vllm-bole's trees (``bole_tree``; ``bole_chain``: our verifier on
chain-shaped trees, ``top_k`` 1), on the trained pair of ``benchmarks/train_pair.py``.

    python3 benchmarks/bench_e2e.py --part trees --pair /tmp/pair --data .pair/data   # ar, bole_tree x 2 drafters
    python3 benchmarks/bench_e2e.py --part chains --pair /tmp/pair --data .pair/data  # vllm_chain, bole_chain
    python3 benchmarks/bench_e2e.py --plot benchmarks/results                          # the plots, on the CPU
    python3 benchmarks/bench_e2e.py --part all --pair /tmp/pair_tiny --eager --dtype float32 --quick  # CPU dry run

Run it under an outer ``timeout`` of at least ``--seconds`` + 90: an engine stops taking cells at the
deadline but returns its rows only when it shuts down. Every engine runs in its own subprocess
(``vllm_bole.testing.engine_run``), one after another (the GPU is the engine's alone while it is timed);
``--parallel`` starts them all at once (8 GiB of KV cache each; starts of 120-150 s each were most of a
run's ten minutes) and then lets one engine at a time run, stage by stage (a stage: one dataset, temperature
and concurrency), AR's cell of each stage before and after the other engines' (``run_parallel``; AR's row the
mean of its two runs, with ``tokens_per_s_runs`` and ``run_spread``: the baseline's own drift within the run).
CUDA graphs
on (vLLM's default FULL_AND_PIECEWISE; tree steps run PIECEWISE), bf16, ``TRITON_ATTN`` (the bundle has no FlashAttention 3), prefix caching off in
every mode (tree speculation refuses it; the baselines match). Each engine decodes cells of
(dataset, temperature, concurrency): ``concurrency`` prompts per ``LLM.generate`` call, 128 new tokens
each (``ignore_eos``), ``max(WAVES * concurrency, REQUESTS_MIN)`` requests per cell, at most ``concurrency``
in flight, a finished request replaced at once by the next (``vllm bench serve --max-concurrency``;
until 6088b99 the requests went in groups of ``concurrency`` with a barrier after each, so a group lasted
as long as its slowest request: on the H200 a tree engine's groups at c >= 8 took 1.6-3x the steps of
their mean acceptance, AR's none); datasets MT-Bench first turns, HumanEval prompts, held-out ShareGPT first turns (chat
template; ``pair_data.py``).

Engines and cells (``ENGINES``): ``ar`` and ``vllm_chain`` (n-gram and ``draft_model`` at
``num_speculative_tokens`` in ``CHAIN_K``, a sweep; a mode vLLM refuses or fails on the hybrid is
recorded with its error) decode every cell. One ``bole_tree`` engine per drafter (the pair's block
drafter first, n-grams, its MTP drafter, then its draft model; the heads when the pair has them:
``pair/block``, ``pair/mtp``) sweeps the node
budget in place (``bole_set_budget``; the same engine, so the same graphs and caches) over
``BUDGETS`` and ``budget: "auto"`` (the budget controller) cell by cell on the sweep cells (MT-Bench
and HumanEval, greedy; the cell's requests in ``SWEEP_PARTS`` parts, each budget on the first part in order, then
on the next in reverse, forth and back, merged into one row with ``parts`` and each part's ``tokens_per_s_runs``:
``swept``), then runs ``"auto"`` on
every other cell. Order is by importance and every engine checks a deadline, so a
run cut short still writes what it measured; unmeasured cells are absent.

Per cell: ``tokens_per_s`` (output tokens / generate seconds), ``accept_len`` (tokens per request
per target step: 1 for ``ar``; vLLM's spec-decode counters for ``vllm_chain``; the tree runner's
counters for ours), ``tpot_ms`` (vLLM's TPOT: per request, from its first token to its last over its
other tokens, averaged over the cell's requests), and for ours the split per step:
``draft_ms`` (``propose_ms`` of it the drafter's own, ``choose_ms`` the budget controller's choice and the cut to
it, the rest building trees), ``verify_commit_ms``
(tree verification and commit of the recurrent layers, inside the step), ``finish_ms`` (the tree
step's results to the host, which waits for its forward, and the counters), ``forward_ms`` (the
target forward of a tree step, GPU time), ``prepare_ms`` (input preparation per step, host;
``prepare_vllm_ms`` of it vLLM's own), ``step_ms`` (whole engine step; the rest is vLLM's
scheduler, sampler and output processing; for AR and vLLM's chain from ``engine_steps``, vLLM's own count of its
engine steps), ``step_ms_by_kind`` / ``steps_by_kind`` (engine steps of trees
alone, of trees beside prompt rows (``mixed``), without trees (``plain``) and of trees right after a step
without trees (``catchup``: the draft catching up on a prompt or on plain decoding): their mean wall time and
count; where a cell's steps differ from its steady state), ``phase_ms_by_kind`` (per step kind its steps and the
mean milliseconds per step of each timed part, ``tree_step.PHASES``: ``prepare``, ``prepare_vllm``, ``draft``,
``forward``, ``verify_commit``, ``finish``, ``settle``, and the host's timeline that tiles the step: ``prepare``,
``forward_host``, ``between``, ``sample``, ``engine``, ``update``), ``step_spread`` (the same per timed step: [p50, p90, max] of its wall
and parts' milliseconds per kind, and the five slowest steps whole), ``plain_full_steps`` /
``plain_piecewise_steps`` / ``plain_eager_steps`` (the steps without trees by the CUDA-graph mode vLLM
dispatched them to), ``plain_drafts`` / ``plain_draft_ms`` (drafts made
after a step without trees, the draft catching up: count and mean milliseconds), ``accept_len_by_request`` (min / p10 / p50 / p90 over the
cell's requests of their tokens per tree step: the cell ends with its slowest request), ``branch_by_depth`` (per depth 1..8 the cell's main-path and sibling nodes reached and
accepted: where the budget paid, issue 16 item 5). Writes ``$OUT/e2e_throughput.json`` (``rows``:
``mode, drafter, budget, batch, dataset, temperature, tokens_per_s, accept_len, tpot_ms``, ...) and
``$OUT/controller.json`` (``rows``: ``batch, dataset, controller_tps, best_fixed_tps,
best_fixed_budget, global_fixed_tps`` per drafter; ``chosen``: the controller's mean budgets).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_bole.adapter.tree_step import HOST_PHASES, PHASES, STEP_KINDS  # noqa: E402
from vllm_bole.testing import engine_run  # noqa: E402

STORE = Path("/tmp/bole_bench")
MAX_TOKENS, REQUESTS_MIN, WAVES, WARM_TOKENS = 128, 16, 4, 16
SWEEP_PARTS = 4  # a swept cell's requests in this many parts, the budgets forth and back over them (:func:`swept`)
CONCURRENCY = (1, 8, 32, 128)
DATASETS = ("mt_bench", "humaneval", "sharegpt")
TEMPERATURES = (0.0, 1.0)
CHAIN_K = (2, 4)
BUDGETS = (2, 4, 8, 16, 32)
DRAFT_BEAM = 4  # bole_tree's node-by-node drafting engine
ASYNC_BUDGET = 8  # draft nodes the async-scheduling engine books per request (its fixed budget, the controller's cap)
MAX_DEPTH = 8
SWEEP_DATASETS = ("mt_bench", "humaneval")
CAPTURE = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
ENGINE_TIMEOUT_S = 560
EOS: dict = {}  # {"id": the pair's end-of-sequence token} from its train_pair.json, when there is one


def cells(datasets=DATASETS, temperatures=TEMPERATURES, concurrency=CONCURRENCY) -> list[tuple]:
    """(dataset, temperature, concurrency), most important first: MT-Bench greedy, then the rest."""
    out = [(d, t, c) for t in temperatures for d in datasets for c in concurrency]
    return sorted(out, key=lambda x: (x[1] != 0.0, x[0] != "mt_bench", DATASETS.index(x[0])))


def prompts_for(prompts: dict, dataset: str, n: int) -> list[list[int]]:
    ps = prompts[dataset]
    return [ps[i % len(ps)] for i in range(n)]


def job(prompts, dataset, temperature, conc, deadline, budget=None, part=None) -> list[dict]:
    """The cell's timed job, after an untimed one of the same cell with ``WARM_TOKENS`` tokens: the Triton
    kernels of the cell's shapes are compiled and autotuned (keyed by size classes) before the timing (seen
    on the H200: fixed budgets' tokens/s jumping 2-3x between neighbouring cells). ``part`` 0 .. SWEEP_PARTS - 1:
    that part of the cell's requests (:func:`swept`; the untimed job before the first only)."""
    n = max(WAVES * conc, REQUESTS_MIN)
    ps = prompts_for(prompts, dataset, n)
    ps = ps if part is None else ps[part * n // SWEEP_PARTS: (part + 1) * n // SWEEP_PARTS]
    sampling = dict(temperature=temperature, seed=None) if temperature else {}
    out = []
    for tokens, cell in ((WARM_TOKENS, None), (MAX_TOKENS, dict(dataset=dataset, temperature=temperature,
                                                                  batch=conc, budget=budget, part=part))):
        if cell is None and part:
            continue
        j = engine_run.generate_job(ps, tokens, sampling=sampling, budget=budget, concurrency=conc)
        out.append(dict(j, deadline=deadline, cell=cell))
    return out


def engine_kwargs(args) -> dict:
    """``--parallel``: engines side by side, so each asks for a small share of the GPU (vLLM checks only that
    much is free when it starts) and a fixed KV cache (no profiling of memory that the others also move)."""
    # jit_monitor_verbose: every Triton compilation while serving is logged with its constants (per cell in
    # the rows' ``jit_compiled``)
    kw = dict(dtype=args.dtype, enforce_eager=args.eager, max_model_len=2048, max_num_seqs=max(CONCURRENCY),
              enable_prefix_caching=False, disable_log_stats=False, seed=0, jit_monitor_verbose=True)
    if not args.eager:
        kw.update(compilation_config={"cudagraph_capture_sizes": CAPTURE},
                  kv_cache_memory_bytes=(8 if args.parallel else 16) << 30, attention_backend="TRITON_ATTN",
                  gpu_memory_utilization=0.12 if args.parallel else 0.5)
    if "qwen3_next" in str(args.target):
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    return kw


def spec_for(mode: str, drafter: str, pair: Path, k: int | None = None, beam: int = 0,
             async_scheduling: bool = False) -> dict | None:
    """The engine's speculative config; the pair's draft model is ``pair/draft``, its heads ``pair/block`` and
    ``pair/mtp``. ``async_scheduling`` (trees): ``k`` draft nodes booked per request and step (the scheduler
    books ``num_speculative_tokens`` whatever the tree: a smaller tree is padded)."""
    if mode == "ar":
        return None
    if mode == "vllm_chain":
        if drafter == "ngram":
            return dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=4)
        return dict(method="draft_model", model=str(pair / "draft"), num_speculative_tokens=k)
    cfg = dict(method="bole_tree", drafter=drafter, num_speculative_tokens=k if async_scheduling else max(BUDGETS),
               max_depth=MAX_DEPTH, async_scheduling=async_scheduling)
    if mode == "bole_chain":
        cfg["top_k"] = 1
    if drafter == "draft_model":
        cfg.update(model=str(pair / "draft"), draft_beam=beam)
    if drafter in ("block", "mtp"):
        cfg.update(model=str(pair / drafter))
    return cfg


def engines(part: str, quick: bool, targets: bool = False) -> list[dict]:
    """The part's engines in order: {mode, drafter, k, jobs: [(cell..., budget)]}; ``targets``: only the cells
    the issue's targets are judged on (MT-Bench, greedy, every concurrency)."""
    narrow = quick or targets
    full = cells(temperatures=(0.0,), datasets=("mt_bench",)) if narrow else cells()
    sweep = cells(datasets=("mt_bench",) if narrow else SWEEP_DATASETS, temperatures=(0.0,))
    budgets = (2, 8) if quick else BUDGETS
    trees = [dict(mode="ar", drafter="none", k=None, cells=[c + (None, None) for c in full])]
    # per swept cell its fixed budgets and the controller side by side (a deadline leaves whole groups)
    grouped = swept(sweep, budgets + ("auto",)) + [c + ("auto", None) for c in full if c not in sweep]
    trees += [dict(mode="bole_tree", drafter=d, k=None, cells=grouped) for d in ("block", "ngram", "mtp", "draft_model")]
    # the same draft drafting its trees node by node (draft_beam): one engine, the sweep cells
    trees.insert(5, dict(mode="bole_tree", drafter="draft_model", k=None, draft_beam=DRAFT_BEAM,
                         cells=swept(sweep, budgets + ("auto",))))
    # the same draft under vLLM's async scheduling (AR's and vLLM's chain's default): the engine's booked drafts
    # ASYNC_BUDGET, its fixed budget and the controller within it, then the controller on every other cell, as the
    # synchronous engines (at temperature 1 the switch decodes plainly most steps, and a plain step of the
    # synchronous engine took ~1.2 ms more than AR's at 192c57d: async scheduling is what AR's step has beyond ours);
    # the block heads likewise since they run under it (2026-12-06), their engine last of the trees
    asynchronous = [dict(mode="bole_tree", drafter=d, k=ASYNC_BUDGET, async_scheduling=True,
                         cells=swept(sweep, (ASYNC_BUDGET, "auto")) + [c + ("auto", None) for c in full if c not in sweep])
                    for d in ("draft_model", "block")]
    trees.insert(6, asynchronous[0])
    trees.append(asynchronous[1])
    chains = [dict(mode="vllm_chain", drafter=d, k=k, cells=[c + (None, None) for c in full])
              for d in ("draft_model", "ngram") for k in CHAIN_K]
    chains += [dict(mode="bole_chain", drafter=d, k=None,
                    cells=[c + (b, None) for b in (budgets[:3] if not quick else budgets) for c in sweep])
               for d in ("block", "mtp", "draft_model")]
    return dict(trees=trees, chains=chains, all=trees + chains)[part]


def swept(sweep: list[tuple], budgets: tuple) -> list[tuple]:
    """A swept cell's budgets, each on the first of its ``SWEEP_PARTS`` parts of requests in the order given, then
    each on the next part in the reverse order, forth and back (``(dataset, temperature, concurrency, budget,
    part)``): in one engine the cells run one after another, and a drift of the engine's speed through the group
    (H100, a44eb73: vLLM's own input preparation 0.63 -> 0.85 ms a step from the budget-8 cell to the controller's,
    always the group's last) then weighs on every budget alike (the parts merged: ``merge_runs``). Four parts since
    2026-12-06 (two before): at ad1f02e the cells still moved with the host at the level of the controller's gaps
    (vLLM's own preparation 0.93 against 0.66 ms a step in two cells of one group); each part holds at least one
    wave of the concurrency (a cell has ``WAVES`` x concurrency requests or more)."""
    return [c + (b, p) for c in sweep for p in range(SWEEP_PARTS) for b in (budgets if p % 2 == 0 else budgets[::-1])]


def row_of(eng: dict, cell: dict, res: dict) -> dict:
    mode, conc = eng["mode"], cell["batch"]
    toks = sum(map(len, res["tokens"]))
    tpot = [(done - first) / (len(t) - 1) for (_, first, done), t in zip(res["times"], res["tokens"]) if len(t) > 1]
    row = dict(mode=mode, drafter=eng["drafter"], draft_beam=eng.get("draft_beam", 0),
               async_scheduling=eng.get("async_scheduling", False),
               budget=cell["budget"] if mode.startswith("bole") else eng["k"],
               batch=conc, dataset=cell["dataset"], temperature=cell["temperature"],
               tokens_per_s=toks / res["generate_s"], tpot_ms=1000 * float(np.mean(tpot)) if tpot else None,
               requests=len(res["tokens"]), tokens=toks, seconds=res["generate_s"])
    if cell.get("part") is not None:
        row["part"] = cell["part"]
    if not cell["temperature"]:  # greedy: each request's output, for the comparison with AR (same_as_ar)
        row["digests"] = [hashlib.sha1(str(list(t)).encode()).hexdigest()[:10] for t in res["tokens"]]
    st, cn = res.get("stats"), res.get("counters") or {}
    if st:
        row.update(accept_len=1 + st["accepted"] / max(st["verified_requests"], 1),
                   step_ms=1000 * res["generate_s"] / max(st["steps"], 1),
                   draft_ms=1000 * st["draft_s"] / max(st["steps"], 1),
                   propose_ms=1000 * st.get("propose_s", 0.0) / max(st["steps"], 1),
                   choose_ms=1000 * st.get("choose_s", 0.0) / max(st["steps"], 1),
                   verify_commit_ms=1000 * st["verify_commit_s"] / max(st["tree_steps"], 1),
                   finish_ms=1000 * st.get("finish_s", 0.0) / max(st["tree_steps"], 1),
                   forward_ms=1000 * st["forward_s"] / max(st["tree_steps"], 1),
                   prepare_ms=1000 * st["prepare_s"] / max(st["steps"], 1),
                   prepare_vllm_ms=1000 * st.get("prepare_vllm_s", 0.0) / max(st["steps"], 1),
                   tree_steps=st["tree_steps"], graph_tree_steps=st.get("graph_tree_steps", 0),
                   split_tree_steps=st.get("split_tree_steps", 0), mixed_tree_steps=st.get("mixed_tree_steps", 0),
                   split_piecewise_steps=st.get("split_piecewise_steps", 0),
                   **{f"plain_{m}_steps": st.get(f"plain_{m}_steps", 0) for m in ("full", "piecewise", "eager")},
                   steps_by_kind={k: st.get(f"timed_{k}_steps", 0) for k in STEP_KINDS},
                   step_ms_by_kind={k: 1000 * st[f"timed_{k}_steps_s"] / st[f"timed_{k}_steps"] for k in STEP_KINDS
                                    if st.get(f"timed_{k}_steps")},
                   phase_ms_by_kind=phase_ms_by_kind(st), step_spread=step_spread(st.get("step_log") or []),
                   chained_drafts=st.get("chained_drafts", 0), plain_drafts=st.get("plain_drafts", 0),
                   plain_draft_ms=1000 * st["plain_draft_s"] / st["plain_drafts"] if st.get("plain_drafts") else None,
                   drafted_nodes=st["drafted_nodes"], accepted=st["accepted"],
                   branch_by_depth=st.get("branch_by_depth"), slow_steps=st.get("slow_steps"),
                   accept_len_by_request=request_spread(st, res["tokens"], EOS.get("id")))
        if cell["budget"] == "auto":  # the speculation switch: steps decoded plainly, its rates per batch bucket
            row.update(plain_decode_steps=st.get("plain_decode_steps"), switch_rates=st.get("switch_rates"),
                       switch_samples=st.get("switch_samples"), switch_cost_ms=st.get("switch_cost_ms"))
        if cell["budget"] == "auto" and st.get("budget_steps"):
            row.update(chosen_nodes_per_step=st["budget_nodes"] / st["budget_steps"],
                       chosen_buckets=st.get("budget_buckets"), controller_model=st.get("controller_model"),
                       predicted_step_ms=1000 * st["predicted_step_s"] / max(st["observed_steps"], 1),
                       measured_step_ms=1000 * st["measured_step_s"] / max(st["observed_steps"], 1))
    elif mode == "vllm_chain":
        drafts = cn.get("vllm:spec_decode_num_drafts", 0)
        row.update(accept_len=1 + cn.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts if drafts else None,
                   counters=cn)
    else:
        row["accept_len"] = 1.0
    if cn.get("engine_steps"):  # vLLM's own count of engine steps (any mode): AR's mean step beside ours
        row["engine_steps"] = cn["engine_steps"]
        row.setdefault("step_ms", 1000 * res["generate_s"] / cn["engine_steps"])
    return row


def _ms(phase: str) -> str:
    """A timed part's key in the rows: ``draft_s`` -> ``draft_ms``."""
    return phase.removesuffix("_s") + "_ms"


def phase_ms_by_kind(stats: dict) -> dict:
    """{step kind: {phase: mean milliseconds per step of that kind}, with its ``steps``}: where a kind's steps
    spend their time (e.g. ``mixed`` against ``trees``: the prompt rows' forward, the draft's prefill)."""
    out = {}
    for k in STEP_KINDS:
        n = stats.get(f"by_kind_{k}_steps", 0)
        if n:
            out[k] = dict(steps=n, **{_ms(p): round(1000 * stats[f"by_kind_{k}_{p}"] / n, 4) for p in PHASES})
    return out


def step_spread(log: list) -> dict:
    """The runner's step log (timed engine steps: [kind, requests, tree tokens, wall ms, ms of each timed part])
    as, per step kind, its steps and [p50, p90, max] of the wall and of each part's milliseconds; ``slowest``:
    the five longest steps whole (are a kind's mean steps uniformly slow or a few outliers, and which part)."""
    cols = ("wall_ms",) + tuple(_ms(p) for p in PHASES)
    out = {}
    for k in STEP_KINDS:
        rows = np.array([r[3:] for r in log if r[0] == k], dtype=float).reshape(-1, len(cols))
        if len(rows):
            out[k] = dict(steps=len(rows), **{c: np.percentile(rows[:, i], [50, 90, 100]).round(3).tolist()
                                              for i, c in enumerate(cols)})
    out["slowest"] = [dict(zip(("kind", "requests", "tree_tokens") + cols, r)) for r in sorted(log, key=lambda r: -r[3])[:5]]
    return out


def request_spread(stats: dict, streams: list | None = None, eos: int | None = None) -> dict | None:
    """Tokens per tree step of each request (its accepted nodes + 1, averaged over its tree steps), as
    p10 / p50 / p90 and min over the cell's requests: an offline cell lasts as long as its slowest
    request, so its throughput follows the low end, not the mean. With ``streams`` (the cell's outputs in
    submission order) and ``eos``: the same mean over the requests whose stream holds ``eos`` (decoding
    went on past the answer's end, ``ignore_eos``: text neither model was trained to continue) and over
    the rest, with their counts."""
    per = per_request(stats)
    if not per:
        return None
    q = np.quantile(list(per.values()), [0.0, 0.1, 0.5, 0.9])
    out = dict(zip(("min", "p10", "p50", "p90"), (round(float(x), 3) for x in q)))
    if streams is not None and eos is not None and len(per) == len(streams):
        for name, pick in (("past_eos", True), ("within_answer", False)):
            means = [m for m, t in zip(per.values(), streams) if (eos in t) == pick]
            out[name] = dict(requests=len(means), mean=round(float(np.mean(means)), 3) if means else None)
    return out


def per_request(stats: dict) -> dict[str, float]:
    """{request id: its tokens per tree step (accepted nodes + 1, averaged over its tree steps)} from the
    tree runner's ``accept_log``, in submission order (vLLM's request ids count up: ``N-suffix``)."""
    per: dict = {}
    for rid, _, acc in stats.get("accept_log") or ():
        per.setdefault(rid, []).append(1 + acc)
    return {rid: float(np.mean(per[rid])) for rid in sorted(per, key=lambda rid: int(rid.split("-")[0]))}


def warmup_jobs(prompts: dict, deadline: float) -> list[dict]:
    """Untimed: one request alone, then a full batch, so that Triton's JIT compilation and autotuning
    of the first shapes fall outside the cells (seen on the H200: the first cell ran 2x slower)."""
    return [dict(engine_run.generate_job(prompts_for(prompts, "mt_bench", n), 16, concurrency=n), deadline=deadline,
                 cell=None) for n in (1, max(CONCURRENCY))]


def stage_of(dataset: str, temperature: float, batch: int) -> int:
    """The cell's stage: greedy MT-Bench at each concurrency, then HumanEval, ShareGPT, then the same at
    temperature 1 (``--parallel`` times every engine's stage k before any engine's stage k + 1).

    Decision: one stage per concurrency, so that AR's two runs bracket every engine's cell of that concurrency
    within seconds. With a stage per dataset (until f428370) they were minutes apart, and AR's own two runs of
    a cell differed by 5-52% on the H100 (host noise drifting on that scale): more than the effects measured."""
    return (TEMPERATURES.index(temperature) * len(DATASETS) + DATASETS.index(dataset)) << 20 | int(batch)


def passes(eng: dict) -> list[tuple[int, int]]:
    """The engine's (stage, pass) gates under ``--parallel``, in order: pass 0 of each of its stages and, for
    AR (the baseline), pass 1 after the other engines' pass 0 of that stage: AR's cells are timed before and
    after every other engine's (the H200's AR cells varied by up to ~30% minutes apart in one engine, at
    af4cf8f: the two passes measure that, and their mean is the row)."""
    stages = sorted({stage_of(d, t, c) for d, t, c, *_ in eng["cells"]})
    return [(k, p) for k in stages for p in ((0, 1) if eng["mode"] == "ar" else (0,))]


def run_engine(eng: dict, args, prompts: dict, deadline: float, gate=None) -> list[dict]:
    """The engine's rows (one with its error if it failed); ``gate((stage, pass))``: the job before the
    engine's cells of each of its :func:`passes` (``--parallel``)."""
    cell_jobs = []
    for k, p in passes(eng) if gate else [(None, 0)]:
        if gate:
            cell_jobs.append(gate((k, p)))
        for d, t, c, b, h in eng["cells"]:
            if k is None or stage_of(d, t, c) == k:
                cell_jobs += job(prompts, d, t, c, deadline, b, h)
    first = 1 if gate else 0  # the warm-up after the first gate: it runs on the GPU
    jobs = cell_jobs[:first] + warmup_jobs(prompts, deadline) + cell_jobs[first:]
    spec = spec_for(eng["mode"], eng["drafter"], args.pair, eng["k"], eng.get("draft_beam", 0),
                    eng.get("async_scheduling", False))
    base = dict(mode=eng["mode"], drafter=eng["drafter"], draft_beam=eng.get("draft_beam", 0),
                async_scheduling=eng.get("async_scheduling", False), budget=eng["k"])
    graphs = args.tree_graphs and eng["mode"].startswith("bole")
    try:
        out = engine_run.run_engine(args.target, jobs, spec=spec, llm_kwargs=engine_kwargs(args),
                                    timeout=min(ENGINE_TIMEOUT_S, max(deadline - time.time() + 60, 30)),
                                    env={"VLLM_BOLE_TREE_GRAPHS": "1"} if graphs else None)
    except Exception as e:  # noqa: BLE001 - the mode's result is its error
        row = dict(base, error=f"{type(e).__name__}: {e}"[-3000:])
        print(_line(row), flush=True)
        return [row]
    rows = []
    for j, res in zip(jobs, out["jobs"]):
        if j.get("cell") is not None and "skipped" not in res:
            # Triton kernels compiled while serving (vLLM's jit monitor): the engine's, and this cell's own
            rows.append(dict(row_of(eng, j["cell"], res), engine_start_s=out["start_s"], tree_graphs=graphs,
                             jit_warnings=out.get("jit_warnings"), jit_kernels=out.get("jit_kernels"),
                             jit_compiled=res.get("jit_compiled")))
            print(_line(rows[-1]), flush=True)
    return merge_runs(rows)


def merge_runs(rows: list[dict]) -> list[dict]:
    """One row per cell: a cell timed twice (AR's two passes) becomes the first run's row with the mean
    ``tokens_per_s`` and ``tpot_ms``, each run's in ``tokens_per_s_runs`` / ``tpot_ms_runs``, and
    ``run_spread`` (max - min over the mean of ``tokens_per_s``); a cell run in parts (:func:`swept`) becomes
    one row over them (:func:`merge_parts`)."""
    by: dict = {}
    for r in rows:
        by.setdefault(_cell_id(r) if "dataset" in r else id(r), []).append(r)
    out = []
    for group in by.values():
        row = dict(group[0])
        if "part" in row:
            row = merge_parts(group)
        elif len(group) > 1:
            tps = [g["tokens_per_s"] for g in group]
            tpot = [g["tpot_ms"] for g in group if g.get("tpot_ms") is not None]
            row.update(tokens_per_s=float(np.mean(tps)), tokens_per_s_runs=tps,
                       run_spread=(max(tps) - min(tps)) / float(np.mean(tps)),
                       seconds=sum(g["seconds"] for g in group))
            if tpot:
                row.update(tpot_ms=float(np.mean(tpot)), tpot_ms_runs=tpot)
        out.append(row)
    return out


def run_parallel(todo: list[dict], args, prompts: dict, deadline: float) -> list[list[dict]]:
    """Every engine of ``todo`` started at once, each waiting at a gate before each of its :func:`passes`.
    Once all have started (or failed), pass by pass, engine by engine, one engine at a time runs its cells of
    that pass: stage k's pass 0 of every engine, then AR's pass 1 of it, then stage k + 1; a deadline then
    cuts the same stages from every engine, and the modes compared share the GPU's state. Each engine's
    rows, in ``todo``'s order."""
    from concurrent.futures import ThreadPoolExecutor

    gates_of = [passes(eng) for eng in todo]
    with tempfile.TemporaryDirectory(prefix="bole_gates") as gates, ThreadPoolExecutor(len(todo)) as pool:
        mark = lambda what, i, k: Path(gates) / f"{what}.{i}.{k[0]}-{k[1]}"  # noqa: E731
        futures = [pool.submit(run_engine, eng, args, prompts, deadline,
                               lambda k, i=i: engine_run.gate_job(mark("ready", i, k), mark("go", i, k)))
                   for i, eng in enumerate(todo)]
        while not all(f.done() or mark("ready", i, gates_of[i][0]).exists() for i, f in enumerate(futures)):
            time.sleep(1.0)
        print(f"engines started: {sum(not f.done() for f in futures)} of {len(todo)}", flush=True)
        for k in sorted(set().union(*gates_of)):
            for i, f in enumerate(futures):
                if k not in gates_of[i] or f.done():
                    continue
                mark("go", i, k).touch()
                after = [s for s in gates_of[i] if s > k]
                while not (f.done() or after and mark("ready", i, after[0]).exists()):
                    time.sleep(0.01)  # a switch of engines every stage: 16 stages a temperature, 3-4 engines
        return [f.result() for f in futures]


def label(r: dict) -> str:
    """A row's (or an engine's) drafter, and how it drafts (node by node: its beam; under async scheduling)."""
    return r["drafter"] + (f"/beam{r['draft_beam']}" if r.get("draft_beam") else "") + \
        ("/async" if r.get("async_scheduling") else "")


def _cell_id(e: dict, dataset=None, temperature=None, batch=None, budget=None) -> tuple:
    """A row's cell, or an engine's cell ``(dataset, temperature, batch, budget)``: its engine and the
    cell's settings (a row's ``budget`` as ``row_of`` writes it)."""
    if "dataset" in e:
        return _name(e), e["budget"], e["dataset"], e["temperature"], e["batch"]
    return _name(e), budget if e["mode"].startswith("bole") else e["k"], dataset, temperature, batch


def _name(e: dict) -> str:
    """An engine's (or its row's) name for ``--only``: ``mode/drafter``, ``/beam4`` when it drafts node by node,
    ``/async`` under async scheduling."""
    return f"{e['mode']}/{label(e)}"


def controller_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per drafter, batch and swept dataset (greedy): the controller against the best fixed budget of
    that cell and against the single fixed budget that is best over all cells (highest mean of
    tokens/s relative to each cell's best)."""
    out, chosen = [], []
    for drafter in sorted({label(r) for r in rows if r["mode"] == "bole_tree" and "error" not in r}):
        mine = [r for r in rows if "error" not in r and r["mode"] == "bole_tree" and label(r) == drafter
                and r["temperature"] == 0.0]
        fixed = {(r["batch"], r["dataset"], r["budget"]): r["tokens_per_s"] for r in mine if r["budget"] != "auto"}
        auto = {(r["batch"], r["dataset"]): r for r in mine if r["budget"] == "auto"}
        keys = sorted({(b, d) for b, d, _ in fixed} & set(auto))
        if not keys:
            continue
        best = {k: max((v, b) for (bb, d, b), v in fixed.items() if (bb, d) == k) for k in keys}
        budgets = sorted({b for _, _, b in fixed})
        score = {b: sum(fixed.get(k + (b,), 0) / best[k][0] for k in keys) for b in budgets}
        glob = max(budgets, key=lambda b: score[b])
        for k in keys:
            a = auto[k]
            out.append(dict(drafter=drafter, batch=k[0], dataset=k[1], controller_tps=a["tokens_per_s"],
                            best_fixed_tps=best[k][0], best_fixed_budget=best[k][1],
                            global_fixed_tps=fixed.get(k + (glob,)), global_fixed_budget=glob,
                            ratio_best=a["tokens_per_s"] / best[k][0],
                            ratio_global=a["tokens_per_s"] / fixed[k + (glob,)] if k + (glob,) in fixed else None,
                            chosen_nodes_per_step=a.get("chosen_nodes_per_step")))
        chosen += [dict(drafter=drafter, batch=r["batch"], dataset=r["dataset"],
                        chosen_nodes_per_step=r.get("chosen_nodes_per_step"),
                        chosen_per_request=(r.get("chosen_nodes_per_step") or 0) / r["batch"],
                        predicted_step_ms=r.get("predicted_step_ms"), measured_step_ms=r.get("measured_step_ms"))
                   for r in auto.values()]
    return out, chosen


def _line(r: dict) -> str:
    """A row in one line, then per step kind its host timeline (ms a step, ``tree_step.HOST_PHASES``) on lines
    of its own: a run's log tail answers where a kind's steps spend their time before its JSON is read."""
    head = (f"{r['mode']:10s} {r['drafter']:11s} b={r.get('budget')!s:5s} c={r.get('batch')!s:4s} "
            f"{r.get('dataset', ''):9s} T={r.get('temperature', '')!s:4s} {r.get('tokens_per_s', 0):9.1f} tok/s "
            f"acc={r.get('accept_len') or 0:.2f} tpot={r.get('tpot_ms', 0):.2f}ms "
            + "".join(f"{k}={ms:.1f}ms/{r['steps_by_kind'][k]} " for k, ms in (r.get("step_ms_by_kind") or {}).items())
            + r.get("error", "")[-300:])
    return "\n".join([head] + host_lines(r.get("phase_ms_by_kind")))


def host_lines(by_kind: dict | None) -> list[str]:
    """Per step kind of :func:`phase_ms_by_kind` its host timeline in one line (ms a step, ``HOST_PHASES``)."""
    return [f"    {k:8s} n={parts['steps']} " + " ".join(f"{p.removesuffix('_s')}={parts[_ms(p)]:.2f}" for p in HOST_PHASES)
            for k, parts in (by_kind or {}).items()]


def _header(args) -> dict:
    import torch
    import triton

    try:
        from importlib.metadata import version

        vllm = version("vllm")
    except Exception:  # noqa: BLE001
        vllm = None
    pair = {}
    f = Path(args.pair) / "train_pair.json"
    if f.exists():
        pair = {k: {kk: vv for kk, vv in v.items() if kk != "loss"} for k, v in json.loads(f.read_text())["models"].items()}
    return dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", vllm=vllm,
                torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("BOLE_COMMIT"),
                target=str(args.target), draft=str(args.draft), pair=pair,
                settings=dict(max_tokens=MAX_TOKENS, requests_min=REQUESTS_MIN, waves=WAVES,
                              concurrency=CONCURRENCY,
                              chain_k=CHAIN_K, budgets=BUDGETS, max_depth=MAX_DEPTH, capture_sizes=CAPTURE,
                              dtype=args.dtype, cuda_graphs=not args.eager, attention_backend="TRITON_ATTN",
                              prefix_caching=False, ignore_eos=True, parallel_start=args.parallel))


# a part-run row's counts (summed over the parts); its other numbers are means per step, request or node
PART_SUMS = ("requests", "tokens", "seconds", "tree_steps", "graph_tree_steps", "split_tree_steps", "mixed_tree_steps",
             "split_piecewise_steps", "plain_full_steps", "plain_piecewise_steps", "plain_eager_steps", "chained_drafts",
             "plain_drafts", "drafted_nodes", "accepted", "plain_decode_steps")


def merge_parts(group: list[dict]) -> dict:
    """One row from a cell's parts (:func:`swept`): ``tokens_per_s`` over them (tokens over seconds), each part's
    in ``tokens_per_s_runs``, requests' ``digests`` in order, :data:`PART_SUMS` summed, every other number that
    differs their mean (the parts have the same request count), lists and dicts (step kinds, spreads, the controller's
    model) the first part's; ``parts``: how many ran (a deadline can cut the last)."""
    group = sorted(group, key=lambda r: r["part"])
    row = {k: v for k, v in group[0].items() if k != "part"}
    for k in row:
        vals = [g.get(k) for g in group]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            row[k] = sum(vals) if k in PART_SUMS else sum(vals) / len(vals) if len(set(vals)) > 1 else vals[0]
    row.update(tokens_per_s=row["tokens"] / row["seconds"], tokens_per_s_runs=[g["tokens_per_s"] for g in group],
               parts=len(group))
    if all("digests" in g for g in group):
        row["digests"] = [d for g in group for d in g["digests"]]
    return row


def same_as_ar(rows: list[dict]) -> None:
    """Per greedy speculative row: the fraction of its requests whose output equals AR's for the same
    prompts (same dataset and concurrency). bf16 on the GPU: batch-dependent rounding may flip a near
    tie in either engine, so this is a monitor, not the lossless criterion (fp32 identity is tested)."""
    ar = {(r["dataset"], r["batch"]): r["digests"] for r in rows if r["mode"] == "ar" and r.get("digests")}
    for r in rows:
        want = ar.get((r.get("dataset"), r.get("batch")))
        if r.get("mode") != "ar" and r.get("digests") and want and len(want) == len(r["digests"]):
            r["same_as_ar"] = sum(a == b for a, b in zip(r["digests"], want)) / len(want)


def save(args, rows_by_part: dict) -> None:
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for part in rows_by_part.values() for r in part["rows"]]
    same_as_ar(rows)
    head = _header(args)
    head["parts"] = {p: {k: v for k, v in d.items() if k != "rows"} for p, d in rows_by_part.items()}
    (out / "e2e_throughput.json").write_text(json.dumps(dict(head, rows=rows), indent=1))
    ctl, chosen = controller_rows(rows)
    (out / "controller.json").write_text(json.dumps(dict(head, rows=ctl, chosen=chosen), indent=1))


def plot(results: Path) -> None:
    """``e2e_throughput.png`` (speedup over ``ar`` against concurrency, MT-Bench greedy, each mode and
    drafter at its best setting per concurrency) and ``controller.png`` (chosen budget against
    concurrency), from the JSON files in ``results``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((results / "e2e_throughput.json").read_text())
    rows = [r for r in data["rows"] if "error" not in r]
    sel = [r for r in rows if r["dataset"] == "mt_bench" and r["temperature"] == 0.0]
    ar = {r["batch"]: r["tokens_per_s"] for r in sel if r["mode"] == "ar"}
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["mode"], label(r)) for r in sel if r["mode"] != "ar"}):
        best = {}
        for r in sel:
            if (r["mode"], label(r)) == key and r["batch"] in ar:
                best[r["batch"]] = max(best.get(r["batch"], 0), r["tokens_per_s"] / ar[r["batch"]])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], marker="o", label=f"{key[0]} ({key[1]})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup over AR (output tokens/s)")
    ax.set_title(f"MT-Bench, greedy, {data.get('device', 'GPU')}, CUDA graphs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results / "e2e_throughput.png", dpi=120)
    chosen = json.loads((results / "controller.json").read_text()).get("chosen", [])
    if not chosen:  # the controller's cells were not measured
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(c["drafter"], c["dataset"]) for c in chosen}):
        pts = sorted((c["batch"], c["chosen_per_request"]) for c in chosen if (c["drafter"], c["dataset"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]}, {key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("draft nodes per request per step (controller)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results / "controller.png", dpi=120)


def int_list(lo: int, hi: int):
    """argparse type: comma-separated integers in ``[lo, hi]`` -> their sorted tuple."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(sorted(int(v) for v in text.split(",")))
        except ValueError:
            values = ()
        if not values or values[0] < lo or values[-1] > hi:
            raise argparse.ArgumentTypeError(f"comma-separated integers in [{lo}, {hi}], got {text!r}")
        return values
    return parse


def main() -> int:
    global MAX_TOKENS, BUDGETS, CHAIN_K
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("trees", "chains", "all"))
    ap.add_argument("--pair", type=Path, default=Path("/tmp/pair"))
    ap.add_argument("--target", default="nemotron_h", help="the pair's target: nemotron_h or qwen3_next")
    ap.add_argument("--data", type=Path, default=Path(".pair/data"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (CPU dry runs)")
    ap.add_argument("--quick", action="store_true", help="MT-Bench greedy only, two budgets (dry runs)")
    ap.add_argument("--seconds", type=float, default=540, help="deadline for the whole part")
    ap.add_argument("--plot", type=Path, help="only draw the plots from the JSON in this folder")
    ap.add_argument("--tree-graphs", action="store_true",
                    help="our engines with VLLM_BOLE_TREE_GRAPHS=1 (tree steps from whole CUDA graphs; rows say so)")
    ap.add_argument("--targets-only", action="store_true",
                    help="only the cells the targets are judged on: MT-Bench greedy at every concurrency")
    ap.add_argument("--only", action="append", metavar="MODE/DRAFTER",
                    help="run only these engines of the part (e.g. bole_tree/ngram, bole_tree/draft_model/beam4), in the"
                         " order given, keeping the part's other rows")
    ap.add_argument("--parallel", action="store_true",
                    help="start every engine at once, then time one at a time, stage by stage (8 GiB of KV cache each)")
    ap.add_argument("--budgets", type=int_list(1, 255),
                    help=f"the fixed budgets swept, comma-separated (default {','.join(map(str, BUDGETS))}; the"
                         " largest is the engines' num_speculative_tokens, the controller's cap)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the cells this machine's earlier runs of the part measured (/tmp/bole_bench) and run"
                         " only the others")
    ap.add_argument("--chain-k", type=int_list(1, 255),
                    help=f"vLLM's chain lengths swept, comma-separated (default {','.join(map(str, CHAIN_K))}):"
                         " one engine each")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
        return 0
    if not args.part:
        ap.error("--part: required (trees, chains or all) unless --plot")
    if args.quick:
        MAX_TOKENS = 32
    BUDGETS, CHAIN_K = args.budgets or BUDGETS, args.chain_k or CHAIN_K
    deadline = time.time() + args.seconds
    args.target, args.draft = args.pair / args.target, args.pair / "draft"
    prompts = json.loads((args.data / "prompts.json").read_text())
    if (args.pair / "train_pair.json").exists():
        EOS["id"] = json.loads((args.pair / "train_pair.json").read_text()).get("data", {}).get("eos")
    STORE.mkdir(parents=True, exist_ok=True)
    parts = {f.stem: json.loads(f.read_text()) for f in STORE.glob("*.json")}
    todo = engines(args.part, args.quick, args.targets_only)
    if args.only:
        todo = sorted((e for e in todo if _name(e) in args.only), key=lambda e: args.only.index(_name(e)))
    heads = [d for d in ("block", "mtp") if not (args.pair / d / "block_drafter.json").exists()]
    todo = [e for e in todo if e["drafter"] not in heads]  # a pair trained without those heads
    prior = parts.get(args.part, {}).get("rows", [])
    done = {_cell_id(r) for r in prior if args.resume and "error" not in r}
    keep = [r for r in prior if (args.only and _name(r) not in args.only) or _cell_id(r) in done]
    for e in todo:  # --resume: the cells this machine's earlier runs measured are kept, not run again
        e["cells"] = [c for c in e["cells"] if _cell_id(e, *c[:4]) not in done]
    todo = [e for e in todo if e["cells"]]
    parts[args.part] = dict(rows=keep, started=time.strftime("%H:%M:%S"))
    if args.parallel:
        measured = run_parallel(todo, args, prompts, deadline)
    else:
        measured = (run_engine(e, args, prompts, deadline) if time.time() < deadline - 30 else [] for e in todo)
    for eng, rows in zip(todo, measured):
        if not rows:
            parts[args.part].setdefault("not_run", []).append(f"{eng['mode']}/{eng['drafter']}/{eng['k']}")
            continue
        parts[args.part]["rows"] += rows
        (STORE / f"{args.part}.json").write_text(json.dumps(parts[args.part]))
        save(args, parts)
    save(args, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
