"""One tree-speculative decode step, written once, engine-agnostic (the vLLM runner calls these; so
does ``tests/test_decode_step.py`` with a small torch model and the float64 oracles)::

    tree, _ = draft_trees(drafter, roots, histories, depths, budget, max_depth=D)  # 1. drafting
    drafts = tree.draft_token_ids()           # -> the engine schedules 1 + len(drafts[r]) tokens
    tree = tree.select(rows, num_nodes)       # next step: the scheduled requests, as scheduled
    logits = <ONE target forward over tree's flat nodes>                     # 2. the target
        # positions prefix + depth; every TreeLayer runs its tree form from the committed state
    res = verify_tree(tree, logits, sampling)                                # 3. verification
    commit(layers, tree, res)                                                # 4. commit
        # K/V of the accepted path compacted, conv states rolled, recurrent inputs of the
        # accepted path stashed (folded into the request's next tree step)

``res.output_token_ids`` are the accepted draft tokens and the bonus token, ``-1`` padded: what a
chain rejection sampler returns, so an engine's bookkeeping of accepted tokens stays unchanged.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from vllm_bole.spec_decode.best_first import best_first_slots, best_first_tree
from vllm_bole.spec_decode.candidates import Drafter, TreeDrafter
from vllm_bole.spec_decode.controller import BudgetController, Choice
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.spec_decode.verification import VerificationResult, verify_deterministic, verify_greedy

__all__ = ["Sampling", "TreeLayer", "commit", "draft_trees", "draft_trees_async", "verify_tree"]


def draft_trees(drafter: Drafter, roots: Sequence[int], histories: Sequence[Sequence[int]], depths: Sequence[int],
                budget: int, **options) -> tuple[TreeBatch, Choice | None]:
    """:func:`draft_trees_async`, waited for."""
    return draft_trees_async(drafter, roots, histories, depths, budget, **options)()


def draft_trees_async(drafter: Drafter, roots: Sequence[int], histories: Sequence[Sequence[int]],
                      depths: Sequence[int], budget: int, *, max_depth: int, top_k: int | None = None,
                      controller: BudgetController | None = None, kv_lens: Sequence[int] | None = None,
                      keys: Sequence | None = None, calibration: torch.Tensor | None = None,
                      timings: dict | None = None, pending=None) -> Callable[[], tuple[TreeBatch, Choice | None]]:
    """Best-first trees of at most ``budget`` draft nodes per request from the drafter's per-depth
    candidates (or drafted node by node by a :class:`~vllm_bole.spec_decode.candidates.TreeDrafter`);
    a request with depth 0 (or no candidates) gets its root alone. ``roots`` [B] are the last
    committed tokens. With a ``controller`` the trees grown at ``budget`` are cut to the
    budgets it chooses for the batch (``kv_lens`` [B]: the requests' context lengths). Returns a
    callable that returns the trees and that choice (None without a controller): a drafter with
    ``grow_trees_async`` (the paged draft) launches its step now and is read then, so the caller
    can do other host work while the step runs on the device. ``keys`` [B] identify the requests to a
    drafter that keeps per-request state across steps (the paged draft model). ``calibration``:
    the builder's per (depth, kind) factors (:class:`~vllm_bole.spec_decode.calibration.Calibration`).
    The trees carry the drafter's probability of every node (``draft_prob``). ``timings``: a dict to
    which ``propose_s`` (the drafter's own seconds, launch and wait; the rest is building the trees)
    and ``choose_s`` (the controller's choice and the cut to it) are added. ``pending`` (tokens ``[B, W]``,
    counts ``[B]``, on the device; a drafter with ``grow_trees_async`` only): tokens after the histories that
    the host has not read yet."""
    opts = dict(max_depth=max_depth, top_k=top_k, calibration=calibration)
    t0 = time.perf_counter()
    # with a controller: one search at ``budget``, cut to the chosen budgets (``Slots.tree(keep=...)``: the
    # best-first trees of those budgets over the same expansions)
    if hasattr(drafter, "grow_trees_async"):
        launched = drafter.grow_trees_async(roots, histories, depths, budget, keys=keys, pending=pending, **opts)
    elif pending is not None:
        raise ValueError(f"pending: tokens on the device need a drafter with grow_trees_async, not "
                         f"{type(drafter).__name__}")
    elif isinstance(drafter, TreeDrafter):  # drafted node by node
        full = drafter.grow_trees(roots, histories, depths, budget, keys=keys, **opts)
        launched = lambda: full  # noqa: E731
    else:
        cands = drafter.propose(histories, depths, keys=keys)
        _add(timings, t0)
        if controller is None:
            tree = best_first_tree(roots, cands, budget, **opts)
            return lambda: (tree, None)
        full = best_first_slots(roots, cands, budget, **opts)
        return _finish(lambda: full, controller, kv_lens, timings)
    _add(timings, t0)
    return _finish(launched, controller, kv_lens, timings)


def _finish(pending: Callable, controller: BudgetController | None, kv_lens, timings: dict | None) -> Callable:
    """The rest of :func:`draft_trees_async` once the search state is read (``pending()``, timed as the
    drafter's): the trees, cut to the controller's choice."""
    def finish() -> tuple[TreeBatch, Choice | None]:
        t0 = time.perf_counter()
        full = pending()
        _add(timings, t0)
        if controller is None:
            return full.tree(), None
        t0 = time.perf_counter()
        choice = controller.choose(full.logrho, full.valid, kv_lens)
        tree = full.tree(keep=choice.keep)
        _add(timings, t0, "choose_s")
        return tree, choice

    return finish


def _add(timings: dict | None, t0: float, key: str = "propose_s") -> None:
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0


@dataclass
class Sampling:
    """Per-request sampling of the trees' requests, ``[B]`` each (greedy where temperature ~ 0)."""

    temperature: torch.Tensor
    top_k: torch.Tensor | None  # 0 = off; None = off for all
    top_p: torch.Tensor | None  # 1 = off; None = off for all
    min_p: torch.Tensor | None  # None = off for all
    generators: list  # torch.Generator or None per request


def verify_tree(tree: TreeBatch, logits: torch.Tensor, sampling: Sampling | None, *,
                kernels: str = "auto") -> VerificationResult:
    """``logits`` [T, V] float32 at every node (constraints applied); ``sampling`` None: all greedy.
    Lossless: greedy equals plain greedy decoding; sampled requests draw exactly from the target.
    ``kernels``: the walk's (``vllm_bole.dispatch``)."""
    if sampling is None:
        return verify_greedy(tree, logits, kernels=kernels)
    return verify_deterministic(tree, logits, temperature=sampling.temperature, top_k=sampling.top_k,
                                top_p=sampling.top_p, min_p=sampling.min_p, generator=sampling.generators,
                                kernels=kernels)


class TreeLayer(Protocol):
    """A layer that ran the tree form in the forward and keeps what its commit needs."""

    def commit(self, tree: TreeBatch, result: VerificationResult) -> None:
        """Make the accepted path the layer's state (in place, for every request of ``tree``)."""


def commit(layers: Iterable[TreeLayer], tree: TreeBatch, result: VerificationResult) -> None:
    for layer in layers:
        layer.commit(tree, result)
