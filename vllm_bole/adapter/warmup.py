"""The tree step's kernels run once per tree-size class at engine start, before the first request.

On CUDA every Triton kernel of the tree step (tree conv, GDN / SSD / Mamba1 tree steps and their
pending-path commits, tree attention and its split-K reduction, greedy verification, KV
compaction, the stashes) compiles at its first launch with a new specialisation (tile sizes follow
the tree's node count; 1-25 s each on a cold cache on the H200), which without a warm-up lands
inside the first requests (vLLM's jit monitor warns: "Triton kernel JIT compilation during
inference"). :func:`warm_up_tree_kernels` drives whole tree steps through the model instead: for
each shape of :func:`warmup_shapes`, vLLM's ``_dummy_run`` forward with a synthetic
:class:`~vllm_bole.adapter.tree_step.TreeStep` active (so every layer override runs its tree path),
then greedy verification of a tree whose whole first-child chain is accepted and the commit; each
shape twice, so the second step folds the first one's stashed path; then a flush. Nothing is
autotuned while serving (tree attention picks its tile by a fixed rule, ``csrc_triton.tree_attention.
gpu_tile``), so these variants are all there is to compile.

Everything lands on KV block 0 / state slot 0, vLLM's null block, which no request owns; the null
block's states and K/V are zeroed afterwards and nothing stays pending. Decision: always on under
CUDA (the GPU worker calls it after vLLM's own warm-up and CUDA-graph capture; a few seconds on a
warm cache), not on CPU, where the torch twins need no compilation (the tests call it through
``collective_rpc("bole_warm_up")`` to show it leaves outputs unchanged). The paged draft's step
graphs are captured here too, every batch bucket up to ``max_num_seqs`` (else a bucket's first use
inside a step paid its capture), and its eager prefill runs once per kernel variant
(``PagedDraftModel.warm_up``: prompts of a few lengths; the H200 e2e engine at 59e0ecd logged 11
compilations while serving, which kernels not recorded then).
"""
from __future__ import annotations

import logging
import math
import time

import torch

from vllm_bole.adapter.tree_step import TreeStep
from vllm_bole.spec_decode.step import commit, verify_tree
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.transfer import upload

logger = logging.getLogger("vllm_bole")
# the kernels' node tiles: powers of two of the largest tree (greedy verification and Mamba1 from 2 on,
# the stash by the accepted path's length, GDN / SSD from 16 on)
NODE_CLASSES = (2, 4, 8, 16, 32, 64, 128, 256)
SPLIT_PREFIX = 4096  # a prefix long enough for tree attention's split-K path (small batches)


def warmup_shapes(budget: int, max_tokens: int, max_model_len: int) -> list[tuple[int, int, int]]:
    """(requests, nodes per request, prefix length) of the steps that compile the kernels' variants:
    every node class up to ``budget + 1`` nodes, one and three requests (token counts of both
    parities of 16), and tree attention's long-key tile without and with split-K (prefixes of
    ``LONG_KEYS`` and ``SPLIT_PREFIX``); none over ``max_tokens`` tokens or ``max_model_len``."""
    from csrc_triton.tree_attention import LONG_KEYS  # lazily, as the kernels (TRITON_INTERPRET is read at import)

    top = budget + 1
    sizes = sorted({min(top, s) for s in NODE_CLASSES} | {top})
    shapes = [(b, n, 1) for n in sizes for b in (1, 3) if b * n <= max_tokens and n + 1 <= max_model_len]
    for prefix in sorted({min(p, max_model_len - top) for p in (LONG_KEYS, SPLIT_PREFIX)}):
        if prefix > 1 and top <= max_tokens:
            shapes.append((1, top, prefix))
    return shapes


def warmup_tree(requests: int, nodes: int, depth: int) -> TreeBatch:
    """``requests`` copies of one tree: a first-child chain of ``min(depth, nodes - 1)`` nodes from the
    root, the remaining nodes siblings hanging off the chain in turn (the shape best-first trees
    take). Node ``i``'s token is ``i``."""
    chain = min(depth, nodes - 1)
    parents = [-1] + [i - 1 if i <= chain else (i - chain - 1) % max(chain, 1) for i in range(1, nodes)]
    return TreeBatch.from_parents([parents] * requests, [list(range(nodes))] * requests)


def chain_logits(tree: TreeBatch, device) -> torch.Tensor:
    """[T, max_nodes + 1] float32 logits whose greedy verification accepts each tree's first-child
    chain (node ``p``'s argmax is its first child's token, ``p + 1`` on :func:`warmup_tree`'s chain).
    Verification reads only their argmax, so the width covers the trees' tokens, not the vocabulary
    (which would be [T, 150k] at the largest warm-up step)."""
    T = tree.num_nodes
    logits = torch.zeros(T, tree.max_nodes + 1, dtype=torch.float32)
    local = torch.arange(T) - tree.starts[tree.request_index]
    on_chain = tree.depth.long() == local  # the chain's nodes are 0..chain, each at its own depth
    logits[torch.arange(T)[on_chain], local[on_chain] + 1] = 1.0
    return upload(logits, device)


def _step(runner, requests: int, nodes: int, prefix: int) -> None:
    from vllm.config import CUDAGraphMode

    cfg, dev = runner.bole_config, runner.device
    host = warmup_tree(requests, nodes, cfg.depth)
    tree = host.to(dev)
    width = {g.group: math.ceil((prefix + nodes) / runner.input_batch.block_table[g.group].block_size)
             for g in runner._bole_attention}
    step = TreeStep(num_plain=0, tok_start=0, tree=tree, host_tree=host,
                    prefix_len=torch.full((requests,), prefix, dtype=torch.int64, device=dev),
                    req_ids=[f"bole-warmup-{r}" for r in range(requests)], rows=list(range(requests)),
                    block_tables={g: torch.zeros(requests, w, dtype=torch.int32, device=dev) for g, w in width.items()},
                    state_slots={g: torch.zeros(requests, dtype=torch.int64, device=dev) for g in runner._bole_recurrent},
                    fresh=torch.zeros(requests, dtype=torch.bool), chain_len=host.first_child_depth().tolist(),
                    max_kv_len=prefix + nodes, kernels=cfg.kernels)
    for g in runner._bole_attention:
        g.begin(step)
    runner._bole_active.step = step
    try:
        runner._dummy_run(host.num_nodes, cudagraph_runtime_mode=CUDAGraphMode.NONE)
    finally:
        runner._bole_active.step = None
    logits = chain_logits(host, dev)
    result = verify_tree(tree, logits, None, kernels=cfg.kernels)
    commit(runner._bole_attention + runner._bole_recurrent_layers(), tree, result)


def _clear_null_block(runner) -> None:
    for layer in runner._bole_recurrent_layers():
        layer.flush(torch.zeros(1, dtype=torch.int64, device=runner.device), runner.bole_config.kernels)
        layer.drop(0)
        layer.zero_slots(0)
    for g in runner._bole_attention:
        for layer in g.layers:
            layer.module.kv_cache[0].zero_()  # block 0, K and V (every backend's cache is block-major)


@torch.inference_mode()
def warm_up_tree_kernels(runner) -> dict:
    """Run the warm-up tree steps (module docstring) on ``runner`` (the tree runner, KV caches bound).
    Returns {shapes: [(requests, nodes, prefix)], seconds}."""
    runner._bole_install_layers()
    t0 = time.perf_counter()
    limits = (runner.bole_config.num_speculative_tokens, runner.max_num_tokens, runner.max_model_len)
    shapes = warmup_shapes(*limits)
    for requests, nodes, prefix in shapes:
        for _ in range(2):  # the second step folds the path the first one stashed
            _step(runner, requests, nodes, prefix)
    _clear_null_block(runner)
    capture = getattr(runner._bole_drafter, "capture_graphs", None)  # the paged draft's step graphs
    buckets = capture(runner.scheduler_config.max_num_seqs) if capture is not None else 0
    prefill = getattr(runner._bole_drafter, "warm_up", None)  # and its eager prefill's kernel variants
    proposals = prefill() if prefill is not None else 0
    if torch.device(runner.device).type == "cuda":
        torch.cuda.synchronize(runner.device)
    dt = time.perf_counter() - t0
    logger.info("vllm-bole: tree-step kernels warmed up in %.1f s (%d tree shapes, %d draft-step graphs, %d draft "
                "prefills)", dt, len(shapes), buckets, proposals)
    return dict(shapes=shapes, seconds=dt, draft_graphs=buckets, draft_prefills=proposals)
