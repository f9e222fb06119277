"""vllm-bole's tree speculation inside vLLM 0.33 on the H200, end to end, against vLLM without speculation.

Run on the device after the vLLM bundle install (``../shared/tools/vllm-gpu/README.md``), with
``PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0`` and the project installed into /tmp/site:

    python3 benchmarks/device/vllm_gpu_e2e.py --part eager --serve                 # rows, mixed, serve
    python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --no-mixed --soak-seconds 300 --prior A.json
    python3 benchmarks/device/vllm_gpu_e2e.py --part graphs --no-mixed --sequential --arch llama --prior B.json
    python3 benchmarks/device/vllm_gpu_e2e.py --part treegraphs --no-mixed --prior C.json      # tree-step graphs

Each part stores its result under /tmp/bole_e2e (it survives between runs while the machine stays
warm) and writes ``$OUT/vllm_gpu_e2e.json`` from every part present, so the last run returns the
whole file. Every engine runs in its own subprocess (``vllm_bole.testing.engine_run``); the
architectures run in parallel, each engine with a fixed KV-cache size (``kv_cache_memory_bytes``,
which skips vLLM's memory profiling, so concurrent engines cannot disturb each other's sizing).

matrix, per tiny architecture (``vllm_bole.testing.tiny_models``; 8 prompts of mixed lengths plus a
200-token one, 128 greedy tokens each, one batch):

* rows per (arch, dtype, drafter, cuda_graphs[, tree_graphs]): fp32 (vLLM's CUDA kernels take fp32 for all but the GDN ones;
  FlashAttention 3 does not, so vLLM runs TRITON_ATTN there) with ``TRITON_F32_DEFAULT=ieee``, i.e.
  Triton's fp32 dots in IEEE fp32, vLLM's and ours (with Triton's tf32 default, vLLM's own
  kernels differ at the 1e-3 level); both drafters (``ngram``; ``draft_model`` = the target as its
  own drafter, which must accept every node of the greedy chain; Zamba2's the tiny Llama, ``SEPARATE_DRAFT``); eager and CUDA graphs
  (vLLM's default FULL_AND_PIECEWISE: tree steps run PIECEWISE; part ``treegraphs``: the same with every tree
  step replayed from a whole tree-step graph, ``VLLM_BOLE_TREE_GRAPHS=1``, rows marked ``tree_graphs``, with
  ``graph_tree_steps``). Greedy streams must be identical
  (``vllm_bole.testing.lossless``: fp32 top logprobs within 1e-3, or within 1.5x the baseline's own
  decode/prefill spread, measured by rescoring its streams, as on CPU); bf16 rows (Qwen3-Next,
  NemotronH, CUDA graphs) use the engine's own noise criterion. ``step_ms`` is the mean engine step of the speculative run, ``ar_step_ms``
  the non-speculative one's (generate time / decode steps).
* sampling (Llama, NemotronH, fp32, CUDA graphs): 800 sampled 5-token continuations with trees
  against 800 without, chi-square homogeneity on the whole continuation and every position
  (p > 1e-4), and a 0.6x colder control that the same tests must flag (p < 1e-6).
* mixed: staggered arrivals, chunked prefill beside tree steps, a sampled request, a penalty, an
  abort, and a KV cache small enough to preempt (NemotronH, Qwen3-Next, fp32, CUDA graphs): every
  greedy request unchanged.

soak: one engine with tree speculation (NemotronH fp32, CUDA graphs, a small KV cache, n-gram drafts,
``budget: "auto"``: the budget controller under a changing batch) for at least
5 minutes: requests arrive at random, some are aborted at random, greedy and sampled, with and
without penalties and stop strings; each greedy request is then run alone without speculation and
must be equal; GPU memory is sampled after warm-up. Then ``vllm serve`` with and without
``--speculative-config``: ``/v1/completions`` identical, and one ``/v1/chat/completions``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm_bole.testing import engine_run, serve_run  # noqa: E402
from vllm_bole.testing.lossless import compare_greedy  # noqa: E402
from vllm_bole.testing.stats import sample_homogeneity  # noqa: E402
from vllm_bole.testing.tiny_models import ARCHS, PROMPTS  # noqa: E402

STORE = Path("/tmp/bole_e2e")
MAX_TOKENS, BUDGET, DEPTH = 128, 8, 4
CAPTURE = [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 256]
NUM_SAMPLES, SAMPLE_TOKENS = 800, 5
SAMPLED = {"llama": dict(temperature=1.0, top_k=4, min_p=0.1), "nemotron_h": dict(temperature=0.8, top_p=0.7)}
DRAFTERS = ("ngram", "draft_model")
# the draft-model row of these drafts with another tiny checkpoint (same tokenizer and vocabulary) instead of the
# target itself: Zamba2's self-draft runs through transformers (not an attention-only model, so not the paged
# draft), whose Zamba2 re-reads every history each step on the slow torch scan: its row did not finish in 380 s
# nor in 454 s on the H200 (3adce69, ac1f958). The tiny Llama drafts it paged, under graphs: the row then checks a
# separate draft's branching trees (mostly rejected) instead of a self-draft's accepted chains.
SEPARATE_DRAFT = {"zamba2": "llama"}
MIXED_ARCHS = ("nemotron_h", "granitemoehybrid", "falcon_h1", "mamba2", "llama", "qwen3_next")  # CUDA graphs
# (dtype, CUDA graphs) per part and architecture. Qwen3-Next and Qwen3.5 run bf16 only: vLLM's FLA
# chunked GDN prefill (the Triton backend; FlashInfer is not bundled) does not take fp32 inputs.
PARTS = {"graphs": {"qwen3_next": [("bfloat16", True)], "qwen3_5": [("bfloat16", True)], "*": [("float32", True)]},
         "treegraphs": {"qwen3_next": [("bfloat16", True)], "qwen3_5": [("bfloat16", True)], "*": [("float32", True)]},
         "eager": {"qwen3_next": [("bfloat16", False)], "qwen3_5": [("bfloat16", False)],
                   "nemotron_h": [("float32", False), ("bfloat16", True)], "*": [("float32", False)]}}
TREE_GRAPH_PARTS = {"treegraphs"}  # the tree engines replay whole tree-step graphs (VLLM_BOLE_TREE_GRAPHS=1)
ENGINE_TIMEOUT_S = 400
DEADLINE: float | None = None  # time.monotonic() by which every engine stops (--deadline)


def engine_kwargs(dtype: str, graphs: bool, **kw) -> dict:
    out = dict(dtype=dtype, enforce_eager=not graphs, max_model_len=1024, max_num_seqs=64,
               gpu_memory_utilization=0.05, kv_cache_memory_bytes=2 << 30, attention_backend="TRITON_ATTN",
               additional_config={"gdn_prefill_backend": "triton"})
    if graphs:
        out["compilation_config"] = {"cudagraph_capture_sizes": CAPTURE}
    out.update(kw)
    return out


def engine_env(dtype: str) -> dict:
    return {"TRITON_F32_DEFAULT": "ieee"} if dtype == "float32" else {}


def spec(drafter: str, model) -> dict:
    """``model``: the draft model's checkpoint (drafter ``draft_model``)."""
    cfg = dict(method="bole_tree", drafter=drafter, num_speculative_tokens=BUDGET, budget=BUDGET, max_depth=DEPTH)
    if drafter == "draft_model":
        cfg["model"] = str(model)
    return cfg


def run(model, jobs, *, spec_cfg=None, dtype="float32", graphs=True, timeout=ENGINE_TIMEOUT_S, tree_graphs=False,
        **kw) -> dict:
    """One engine; an exception becomes {"error": its first line and its tail} (the matrix never stops
    on one failure). An engine still running at ``--deadline`` is stopped there, so its row records
    where it was (its log's tail) instead of the run's outer time limit cutting everything."""
    if DEADLINE is not None:
        timeout = min(timeout, max(DEADLINE - time.monotonic(), 1.0))
    try:
        env = dict(engine_env(dtype), **({"VLLM_BOLE_TREE_GRAPHS": "1"} if tree_graphs else {}))
        return engine_run.run_engine(model, jobs, spec=spec_cfg, llm_kwargs=engine_kwargs(dtype, graphs, **kw),
                                     env=env, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - recorded as the row's result
        text = f"{type(e).__name__}: {e}"
        return dict(error=text if len(text) <= 4000 else f"{text[:400]} ... {text[-3500:]}")


def _chain_all_accepted(stats) -> bool:
    return all(acc == chain for _, chain, acc in stats["accept_log"])


def _prompts(model) -> list[list[int]]:
    """8 prompts of mixed lengths and one of 200 tokens."""
    prompts = engine_run.prompt_token_ids(model, PROMPTS + (" ".join(PROMPTS) * 3,))
    prompts[-1] = prompts[-1][:200]
    return prompts


def arch_matrix(arch: str, model: Path, cases: list, drafters=DRAFTERS, draft: Path | None = None,
                tree_graphs: bool = False) -> dict:
    """The rows of one architecture for ``cases`` [(dtype, cuda_graphs)] and ``drafters`` (module
    docstring), engines one after another; each row is saved as soon as it is known. ``draft``: the
    draft model's checkpoint (default: the target itself, ``SEPARATE_DRAFT``); ``tree_graphs``: the tree
    engines replay whole tree-step graphs (their rows say ``tree_graphs`` and how many steps replayed)."""
    prompts = _prompts(model)
    draft = draft or model
    rows, extra = [], {}
    for dtype, graphs in cases:
        bf16 = dtype == "bfloat16"
        k = 10 if bf16 else 2
        sampled = arch in SAMPLED and dtype == "float32" and graphs
        sp = dict(SAMPLED.get(arch, {}), max_tokens=SAMPLE_TOKENS)
        base_jobs = [engine_run.generate_job(prompts, MAX_TOKENS, logprobs=k, rescore=k)]
        if sampled:
            colder = dict(sp, temperature=sp["temperature"] * 0.6)
            base_jobs.append(engine_run.generate_job([prompts[0]] * (2 * NUM_SAMPLES), SAMPLE_TOKENS,
                                                     sampling=[sp] * NUM_SAMPLES + [colder] * NUM_SAMPLES))
        base = run(model, base_jobs, dtype=dtype, graphs=graphs)
        for drafter in drafters:
            jobs = [engine_run.generate_job(prompts, MAX_TOKENS, logprobs=k, tree_graphs=tree_graphs)]
            if sampled and drafter == "draft_model":
                jobs.append(engine_run.generate_job([prompts[0]] * NUM_SAMPLES, SAMPLE_TOKENS, sampling=sp))
            ours = run(model, jobs, spec_cfg=spec(drafter, draft), dtype=dtype, graphs=graphs, tree_graphs=tree_graphs)
            row = dict(arch=arch, dtype=dtype, drafter=drafter, cuda_graphs=graphs)
            if tree_graphs:
                row["tree_graphs"] = True
            if drafter == "draft_model" and draft != model:
                row["draft"] = SEPARATE_DRAFT[arch]
            if "error" in base or "error" in ours:
                row.update(identical=False, tokens_compared=0, mean_accepted=None, step_ms=None,
                           error=base.get("error") or ours.get("error"))
                rows.append(SAVE.row(row))
                continue
            b, o = base["jobs"][0], ours["jobs"][0]
            v = compare_greedy(dtype, b, o)
            st = o["stats"]
            row.update(identical=v.ok and (bf16 or v.identical == v.streams), tokens_compared=sum(map(len, o["tokens"])),
                       mean_accepted=st["accepted"] / max(st["verified_requests"], 1),
                       step_ms=1000 * o["generate_s"] / max(st["steps"], 1),
                       ar_step_ms=1000 * b["generate_s"] / (MAX_TOKENS + 1), streams_identical=v.identical,
                       streams=v.streams, partings=v.partings, referee=v.referee, engine_start_s=ours["start_s"],
                       jit_warnings=ours.get("jit_warnings"),
                       warm_up=[ln[ln.find("vllm-bole"):] for ln in ours.get("plugin_lines", []) if "warmed up" in ln],
                       tree_steps=st["tree_steps"], drafted_nodes=st["drafted_nodes"], accepted=st["accepted"],
                       verify_commit_ms=1000 * st["verify_commit_s"] / max(st["tree_steps"], 1),
                       draft_ms=1000 * st["draft_s"] / max(st["steps"], 1), branch_by_depth=st.get("branch_by_depth"),
                       graph_tree_steps=st.get("graph_tree_steps"), tree_graph_buckets=(o.get("tree_graphs") or [None])[0])
            if bf16:
                row.update(noise=v.noise, worst_margin_change=v.worst)
            else:  # identical: every token; lossless: partings only at ties the engine itself leaves open
                row.update(lossless=v.ok, engine_spread=v.spread, ties=v.ties)
            if drafter == "draft_model" and not bf16 and draft == model:
                row["all_chain_accepted"] = _chain_all_accepted(st)
            if v.problems:
                row["problems"] = v.problems[:5]
            rows.append(SAVE.row(row))
            if sampled and drafter == "draft_model":
                ref, control = base["jobs"][1]["tokens"][:NUM_SAMPLES], base["jobs"][1]["tokens"][NUM_SAMPLES:]
                same, power = sample_homogeneity(ref, ours["jobs"][1]["tokens"]), sample_homogeneity(ref, control)
                extra["sampling"] = SAVE.add("sampling", dict(
                    arch=arch, params=SAMPLED[arch], samples=NUM_SAMPLES, p_same=same, p_colder=power,
                    ok=min(same.values()) > 1e-4 and min(power.values()) < 1e-6))
    return dict(rows=rows, **extra)


def _mixed_requests(prompts, abort: bool):
    return [
        dict(id="g0", prompt=prompts[0], arrive=0),
        dict(id="ab", prompt=prompts[1], arrive=0, abort_after=6 if abort else None),
        dict(id="rs", prompt=prompts[2], arrive=1, params=dict(temperature=0.8, seed=7)),
        dict(id="pen", prompt=prompts[3], arrive=2, params=dict(presence_penalty=0.5)),
        dict(id="long", prompt=prompts[-1], arrive=3),
        dict(id="g2", prompt=prompts[4], arrive=9),
        dict(id="g3", prompt=prompts[5], arrive=9),
        dict(id="g4", prompt=prompts[6], arrive=10),
        dict(id="one", prompt=prompts[7][:1], arrive=15),
    ]


def mixed_case(arch, model, prompts) -> dict:
    """fp32 (bf16 where the architecture runs only that, ``PARTS``): the greedy requests identical to the run
    without speculation; in bf16 within the engine's own noise (``compare_greedy``: the baseline's decode and
    prefill paths measured against each other), the penalised request then left out (its logprobs are the
    raw ones, whose top token the penalty may overrule)."""
    # A cache the longest request (200 + 64 tokens) fits alone and the batch does not. Llama: 22 blocks
    # of 16 tokens, of which vLLM 0.33 serves 21 (336 tokens: its estimate from 24 blocks was 368).
    # Hybrids: vLLM enlarges attention blocks to the recurrent state's page (64 tokens on the tiny
    # models) and every running sequence holds one block for its state, so 12 blocks and at most 8
    # sequences (the CPU engine preempted NemotronH with 12: tests/test_vllm_tree_spec.py).
    blocks, seqs, max_len = (22, 16, 336) if arch == "llama" else (12, 8, 384)
    dtype = PARTS["graphs"].get(arch, PARTS["graphs"]["*"])[0][0]
    bf16 = dtype == "bfloat16"
    kw = dict(max_num_batched_tokens=64, enable_chunked_prefill=True, num_gpu_blocks_override=blocks, block_size=16,
              max_model_len=max_len, max_num_seqs=seqs, dtype=dtype)
    k = 10 if bf16 else None
    # the one-token prompt alone after the mixed job (a recycled state slot) in each engine: which run parted from
    # it where the two disagree on its first token (f428370, Qwen3-Next bf16: ours and the baseline parted there,
    # one's token outside the other's top 10; the baseline runs vLLM's V2 runner with prefix caching's "align"
    # state mode, ours V1 without prefix caching, so either side may hold the fault)
    solo = engine_run.generate_job([prompts[7][:1]], 4, logprobs=10)
    # side by side: on a cold machine each engine compiles for ~200 s (2abfaae, H100), and one after the other
    # the second ran out of a 380 s deadline for all three hybrids
    with ThreadPoolExecutor(2) as pool:
        base_f = pool.submit(run, model, [engine_run.mixed_job(_mixed_requests(prompts, False), 64, logprobs=k,
                                                               rescore=k), solo], **kw)
        ours_f = pool.submit(run, model, [engine_run.mixed_job(_mixed_requests(prompts, True), 64, logprobs=k), solo],
                             spec_cfg=spec("draft_model", model), **kw)
        base, ours = base_f.result(), ours_f.result()
    if "error" in base or "error" in ours:
        return dict(arch=arch, dtype=dtype, ok=False, error=base.get("error") or ours.get("error"))
    b, o = base["jobs"][0]["outputs"], ours["jobs"][0]["outputs"]
    greedy = ("g0", "long", "g2", "g3", "g4", "one") if bf16 else ("g0", "pen", "long", "g2", "g3", "g4", "one")
    same = {rid: o[rid]["tokens"] == b[rid]["tokens"] for rid in greedy}
    ab = o["ab"]
    st = ours["jobs"][0]["stats"]
    out = dict(arch=arch, dtype=dtype, same=same, aborted_after_tokens=len(ab["tokens"]),
               resumed_requests=st["resumed_requests"], prefill_mixed_tree_steps=st["prefill_mixed_tree_steps"],
               accepted=st["accepted"], flash_prefix=os.environ.get("VLLM_BOLE_FLASH_PREFIX", "0") == "1",
               one_first_token={name: [r["jobs"][0]["outputs"]["one"]["tokens"][0], r["jobs"][1]["tokens"][0][0]]
                                for name, r in (("base", base), ("ours", ours))})  # [in the mix, alone]
    aborted_ok = ab["finish_reason"] == "aborted_by_client"
    if bf16:  # the aborted stream's tokens not compared (a near tie may part them), its finish reason is
        v = compare_greedy(dtype, engine_run.mixed_streams(b, greedy), engine_run.mixed_streams(o, greedy))
        out.update(ok=v.ok and aborted_ok, noise=v.noise, worst_margin_change=v.worst, partings=v.partings,
                   referee=v.referee,
                   problems=v.problems[:5])
    else:
        out["ok"] = all(same.values()) and aborted_ok and ab["tokens"] == b["ab"]["tokens"][: len(ab["tokens"])]
    return out


def part_matrix(part: str, models: dict, archs: list, mixed: list, serve: bool, soak_s: float | None,
                workers: int | None = None, drafters=DRAFTERS) -> None:
    """The architectures in parallel (one thread each, engines one after another within it; the
    mixed-batch cases and the server in threads of their own), and the soak beside them when
    ``soak_s`` is given. Everything is saved as it finishes (``SAVE``)."""
    cases = PARTS[part]
    jobs = [lambda a=a: arch_matrix(a, models[a], cases.get(a, cases["*"]), drafters,
                                    models.get(SEPARATE_DRAFT.get(a)), part in TREE_GRAPH_PARTS) for a in archs]
    jobs += [lambda a=a: SAVE.add("mixed", mixed_case(a, models[a], _prompts(models[a]))) for a in mixed]
    if serve:
        jobs.append(lambda: SAVE.set("serve", serve_case(models["llama"])))
    if soak_s is not None:
        jobs.append(lambda: part_soak(models, soak_s))
    with ThreadPoolExecutor(workers or len(jobs)) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()


# "GPU memory flat after warm-up": allocated bytes within 1 MiB. PyTorch's allocator rounds every
# block up to 512 bytes, so one tensor leaked per request over the soak's thousands of requests
# exceeds it; a 9 KiB wobble (the f2f2bf4 soak, against strict equality) does not.
MEMORY_SLACK = 1 << 20


def part_soak(models: dict, seconds: float, checked: int = 120, among: int = 300) -> None:
    """The soak engine and, beside it, the baseline: ``checked`` greedy requests drawn from the soak's
    first ``among`` (known in advance: ``engine_run.soak_requests``), each alone (one sequence at a
    time) without speculation; those the soak finished unaborted must be equal."""
    arch, model = "nemotron_h", models["nemotron_h"]
    prompts = _prompts(model)
    first = engine_run.soak_requests(prompts, among)
    greedy = [i for i, r in enumerate(first) if r["params"]["temperature"] == 0.0 and r["abort_after"] is None]
    pick = sorted(random.Random(1).sample(greedy, min(checked, len(greedy))))
    kw = dict(num_gpu_blocks_override=64, block_size=16, max_num_seqs=24)  # each sequence holds a Mamba block
    with ThreadPoolExecutor(2) as pool:
        soak_f = pool.submit(run, model, [engine_run.soak_job(prompts, seconds)],
                             spec_cfg=dict(spec("ngram", model), budget="auto"), timeout=seconds + 200, **kw)
        alone = pool.submit(run, model, [engine_run.generate_job([first[i]["prompt"] for i in pick],
                                                                  sampling=[first[i]["params"] for i in pick])],
                            max_num_seqs=1).result()
        ours = soak_f.result()
    if "error" in ours:
        SAVE.set("soak", dict(ok=False, error=ours["error"]))
        return
    job = ours["jobs"][0]
    reqs = job["requests"]
    greedy = [r for r in reqs.values() if r["params"]["temperature"] == 0.0 and not r["aborted"]]
    errors = [r for r in reqs.values() if not r["aborted"] and r["finish_reason"] is None]
    mem = [m for _, m in job["memory"][len(job["memory"]) // 4:]]  # after warm-up
    flat = not mem or max(mem) - min(mem) <= MEMORY_SLACK
    soak = dict(arch=arch, drafter="ngram", seconds=job.get("seconds"), steps=job["steps"], requests=len(reqs),
                aborts=sum(r["aborted"] for r in reqs.values()), preemptions=job["stats"]["resumed_requests"],
                tokens=sum(len(r["tokens"]) for r in reqs.values()), greedy=len(greedy),
                unfinished=len(errors), tree_steps=job["stats"]["tree_steps"], accepted=job["stats"]["accepted"],
                memory_bytes_min=min(mem) if mem else None, memory_bytes_max=max(mem) if mem else None,
                memory_flat=flat, memory=job["memory"], jit_warnings=ours.get("jit_warnings"))
    if "error" in alone:
        soak.update(ok=False, error=alone["error"])
    else:
        pairs = [(reqs[f"s{i}"], t) for i, t in zip(pick, alone["jobs"][0]["tokens"])
                 if f"s{i}" in reqs and not reqs[f"s{i}"]["aborted"]]
        same = [r["tokens"] == t for r, t in pairs]
        soak.update(greedy_rerun_alone=len(same), greedy_equal=sum(same),
                    ok=bool(same) and all(same) and not errors and flat)
    SAVE.set("soak", soak)


def serve_case(model) -> dict:
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    prompts = engine_run.prompt_token_ids(model, PROMPTS)
    args = ["--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(2 << 30), "--attention-backend", "TRITON_ATTN"]
    try:
        base = serve_run.serve_completions(model, prompts, 64, eager=False, extra_args=args)
        ours = serve_run.serve_completions(model, prompts, 64, spec=spec("ngram", model), chat=True, eager=False,
                                            extra_args=args)
    except Exception as e:  # noqa: BLE001
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[-4000:])
    return dict(ok=base["tokens"] == ours["tokens"], identical=base["tokens"] == ours["tokens"],
                spec_metrics=ours["spec_metrics"], metrics=ours["metrics"][:60], chat=ours["chat"])


def _versions() -> dict:
    import torch
    import triton

    out = dict(torch=torch.__version__, triton=triton.__version__,
               device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    try:
        from importlib.metadata import version

        out["vllm"] = version("vllm")
    except Exception:  # noqa: BLE001
        out["vllm"] = None
    # BOLE_COMMIT first: a snapshot run on the device sits inside a copy whose .git need not be its commit
    out["commit"] = os.environ.get("BOLE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or None
    return out


class Saver:
    """The part's results so far, rewritten (with every other part's, and the versions) to
    ``STORE/<part>.json`` and ``$OUT/vllm_gpu_e2e.json`` whenever something finishes, so a run cut
    short by its time limit still returns what it measured."""

    def __init__(self):
        self.lock, self.part, self.data = threading.Lock(), None, {}

    def start(self, part: str, settings: dict) -> None:
        self.part, self.data = part, dict(rows=[], settings=settings)
        self.header = _versions()
        self.write()

    def prior(self, earlier: dict, archs, drafters, mixed, serve: bool, soak: bool) -> None:
        """Keep an earlier run's results (each tagged with its commit) except those this run redoes:
        rows of ``archs`` x ``drafters`` with this part's cases, the mixed cases of ``mixed``, serve, soak."""
        commit, cases = earlier.get("commit"), PARTS[self.part]
        tg = self.part in TREE_GRAPH_PARTS
        redo = {(a, dt, g, d, tg) for a in archs for dt, g in cases.get(a, cases["*"]) for d in drafters}
        for r in earlier.get("rows", []):
            if (r["arch"], r["dtype"], r["cuda_graphs"], r["drafter"], r.get("tree_graphs", False)) not in redo:
                self.data["rows"].append(dict(r, commit=r.get("commit", commit)))
        for key, arch_key, redone in (("mixed", "arch", mixed), ("sampling", "arch", archs)):
            self.data.setdefault(key, []).extend(dict(x, commit=x.get("commit", commit)) for x in earlier.get(key, [])
                                                 if x.get(arch_key) not in redone)
        for key, redone in (("serve", serve), ("soak", soak)):
            if key in earlier and not redone:
                self.data[key] = dict(earlier[key], commit=earlier[key].get("commit", commit))
        self.data.setdefault("prior_runs", []).extend(earlier.get("prior_runs", []))
        self.data["prior_runs"].append(dict(commit=commit, parts=earlier.get("parts")))

    def row(self, row: dict) -> dict:
        print(_row_line(row), flush=True)
        return self.add("rows", row)

    def add(self, key: str, value: dict) -> dict:
        with self.lock:
            self.data.setdefault(key, []).append(value)
        self.write()
        return value

    def set(self, key: str, value) -> None:
        with self.lock:
            self.data[key] = value
        print(key, json.dumps(value)[:1500], flush=True)
        self.write()

    def write(self) -> None:
        with self.lock:
            (STORE / f"{self.part}.json").write_text(json.dumps(self.data))
            whole = dict(self.header, rows=[], parts={})
            for part in PARTS:
                f = STORE / f"{part}.json"
                if not f.exists():
                    continue
                data = json.loads(f.read_text())
                whole["rows"] += data.pop("rows", [])
                whole["parts"][part] = {k: data.pop(k) for k in ("settings", "seconds", "error") if k in data}
                for k, v in data.items():
                    if isinstance(v, list):
                        whole.setdefault(k, []).extend(v)
                    else:
                        whole[k] = v
            out = Path(os.environ.get("OUT", "."))
            (out / "vllm_gpu_e2e.json").write_text(json.dumps(whole, indent=1))


SAVE = Saver()


def _row_line(r: dict) -> str:
    return (f"{r['arch']:17s} {r['dtype']:9s} {r['drafter']:12s} graphs={'tree' if r.get('tree_graphs') else r['cuda_graphs']!s:5s} "
            f"identical={r['identical']!s:5s} acc={r.get('mean_accepted') or 0:.2f} "
            f"step={r.get('step_ms') or 0:.2f}ms ar={r.get('ar_step_ms') or 0:.2f}ms {r.get('error', '')[-600:]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=tuple(PARTS), required=True)
    ap.add_argument("--arch", action="append", choices=ARCHS, help="matrix rows of these (default: all)")
    ap.add_argument("--no-rows", action="store_true", help="no matrix rows (mixed cases, serve, soak only)")
    ap.add_argument("--drafter", action="append", choices=DRAFTERS, help="matrix rows with these (default: both)")
    ap.add_argument("--mixed", action="append", choices=ARCHS, help=f"mixed-batch cases (default: {MIXED_ARCHS})")
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--serve", action="store_true", help="vllm serve with and without speculation (Llama)")
    ap.add_argument("--sequential", action="store_true", help="one engine at a time: step times of a lone engine")
    ap.add_argument("--prior", action="append", default=[], type=Path,
                    help="an earlier run's vllm_gpu_e2e.json (another warm stay): kept, except what this run redoes")
    ap.add_argument("--soak-seconds", type=float, default=None, help="run the soak (and the server) beside")
    ap.add_argument("--quick", action="store_true", help="a few tokens and samples (a dry run of the script)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which running engines are stopped and recorded as errors")
    args = ap.parse_args()
    global DEADLINE
    DEADLINE = None if args.deadline is None else time.monotonic() + args.deadline
    if args.quick:
        global MAX_TOKENS, NUM_SAMPLES
        MAX_TOKENS, NUM_SAMPLES = 16, 50
    STORE.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    archs, drafters = [] if args.no_rows else args.arch or list(ARCHS), tuple(args.drafter or DRAFTERS)
    SAVE.start(args.part, dict(max_tokens=MAX_TOKENS, budget=BUDGET, depth=DEPTH, capture_sizes=CAPTURE,
                               fp32_env=engine_env("float32"), cases=PARTS[args.part], drafters=drafters,
                               concurrent_engines=not args.sequential))
    mixed = [] if args.no_mixed else args.mixed or list(MIXED_ARCHS)
    for f in args.prior:
        SAVE.prior(json.loads(f.read_text()), archs, drafters, mixed, args.serve, args.soak_seconds is not None)
    try:
        need = set(archs) | set(mixed) | ({"llama"} if args.serve else set()) | (
            {SEPARATE_DRAFT[a] for a in archs if a in SEPARATE_DRAFT and "draft_model" in drafters}) | (
            {"nemotron_h"} if args.soak_seconds is not None else set())
        models = engine_run.build_models(STORE / "tiny", [a for a in ARCHS if a in need])
        part_matrix(args.part, models, archs, mixed, args.serve, args.soak_seconds, 1 if args.sequential else None,
                    drafters)
    except Exception:  # noqa: BLE001 - keep what the part knows
        SAVE.set("error", traceback.format_exc()[-4000:])
    SAVE.set("seconds", time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
