"""Simulation of the acceptance benchmark (no model, no data): greedy acceptance of a draft tree
against a known target continuation, the decoding walk, calibration statistics, sparse-to-dense
candidate compaction, and the simulated decoding of a corpus per drafter and builder
(:class:`Corpus`, :class:`NgramTable`, :func:`simulate`). Tested in ``tests/test_acceptance_sim.py``.

Greedy verification descends into the child whose token is the target's argmax at the current
node and stops where no child matches; the target's argmax along the accepted path is exactly its
own greedy continuation. So, for a target continuation ``ref`` known in advance (one greedy run),
the number of draft tokens a tree accepts is the depth of the deepest node whose root-to-node path
spells ``ref[0..depth-1]`` -- the same number ``verify(..., mode="greedy")`` returns minus the
bonus token (checked in the tests).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from vllm_bole.spec_decode.best_first import best_first_slots
from vllm_bole.spec_decode.calibration import Calibration, kind_counts
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.ngram import NgramDrafter
from vllm_bole.spec_decode.offline import (
    acceptance_stats,
    build_best_first,
    build_best_first_autoregressive,
    build_static,
)
from vllm_bole.spec_decode.tree import TreeBatch

__all__ = [
    "Corpus",
    "NgramTable",
    "accepted_lengths",
    "build_trees",
    "chain_candidates",
    "compact_candidates",
    "conditioned_observations",
    "rank_of",
    "sequoia_table",
    "simulate",
    "walk",
]


def accepted_lengths(tree: TreeBatch, node_tokens: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest root-to-node path matching the reference, per request.

    ``node_tokens [T]``: the token of every flat node in the reference's id space (``-1``: never
    matches, e.g. a padding node of zero draft probability; the roots' entries are ignored).
    ``reference [B, H]``: ``reference[b, d - 1]`` is the target's token at depth ``d`` after
    request ``b``'s root (``-1`` beyond the known continuation). Returns ``(accepted [B] int64,
    flat index of the deepest accepted node [B])``; ties between equal-token siblings go to the
    first, as greedy verification does.
    """
    B, H = reference.shape
    depth = tree.depth.long()
    req = tree.request_index
    ref = reference[req, (depth - 1).clamp(min=0, max=max(H - 1, 0))] if H > 0 else torch.full_like(depth, -1)
    ok = (depth == 0) | ((depth <= H) & (ref >= 0) & (node_tokens.long() == ref))
    path = tree.path_flat  # [T, L + 1], -1 beyond the node's depth
    path_ok = torch.where(path >= 0, ok[path.clamp(min=0)], torch.ones_like(path, dtype=torch.bool)).all(1)
    T = depth.numel()
    # deepest fully matching node; first in flat order among equals (key: depth * T - index)
    key = torch.where(path_ok, depth * (T + 1) + (T - torch.arange(T)), torch.full_like(depth, -1))
    best = torch.full((B,), -1, dtype=torch.long).scatter_reduce_(0, req, key, "amax")
    node = T - (best % (T + 1))
    return best // (T + 1), node


def walk(lengths: Sequence[int], accept_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Simulated speculative decoding over ``P`` prompts, batched across prompts.

    Prompt ``p``'s target continuation has ``lengths[p]`` tokens ``c_1..c_L``; ``c_1`` comes from
    the prefill, so decoding starts with ``t = 1`` emitted tokens. A step at ``t`` (root ``c_t``)
    accepts ``a = accept_fn(prompts, t)`` draft tokens and emits ``a + 1`` (the bonus), so
    ``t <- t + a + 1``; steps run while ``t < L``. ``accept_fn(prompt_ids [n], t [n]) -> [n]`` is
    called once per round for all prompts still decoding. Returns ``(steps [P], accepted [P])``.
    """
    L = torch.as_tensor(list(lengths), dtype=torch.long)
    P = L.numel()
    t = torch.ones(P, dtype=torch.long)
    steps = torch.zeros(P, dtype=torch.long)
    acc = torch.zeros(P, dtype=torch.long)
    while True:
        live = torch.nonzero(t < L).flatten()
        if live.numel() == 0:
            break
        a = torch.as_tensor(accept_fn(live, t[live])).long()
        if a.shape != live.shape or (a < 0).any():
            raise ValueError("accept_fn must return one non-negative count per live prompt")
        steps[live] += 1
        acc[live] += a
        t[live] += a + 1
    return steps, acc


def rank_of(cand_tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank of ``target [...]`` among ``cand_tokens [..., K]`` (sorted best first, ``-1``
    padding): its index, or ``-1`` if absent."""
    hit = (cand_tokens == target[..., None]) & (cand_tokens >= 0)
    idx = hit.long().argmax(-1)
    return torch.where(hit.any(-1), idx, torch.full_like(idx, -1))


def conditioned_observations(ranks: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Observations for :func:`~vllm_bole.spec_decode.offline.acceptance_stats` from
    teacher-forced ranks ``[S, D]`` (``ranks[s, d - 1]``: rank of the target's token at depth
    ``d`` of sample ``s`` in the drafter's distribution after the true path; ``-1``: absent or
    unknown). The observation at depth ``d`` is kept only when every shallower true token has a
    rank in ``[0, num_ranks)``, i.e. when its parent can be accepted in a tree whose children use
    those ranks (the table's conditioning: P(rank-r child accepted | parent accepted)). Samples
    whose continuation is unknown at a depth must be cut there by the caller (pass ``-2``):
    ``-2`` entries are dropped and stop the sample."""
    S, D = ranks.shape
    known = ranks != -2
    good = (ranks >= 0) & (ranks < num_ranks)
    prefix_good = torch.cat([torch.ones(S, 1, dtype=torch.bool), good.long().cumprod(1).bool()[:, :-1]], 1)
    prefix_known = known.long().cumprod(1).bool()
    keep = prefix_good & prefix_known
    s, d = torch.nonzero(keep, as_tuple=True)
    return d + 1, ranks[s, d]


def compact_candidates(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense marginals over a compact vocabulary from sparse candidates ``[B, D, K]`` (``-1``
    padding): returns ``(marginals [B, D, U + 1], table [U + 1])`` with ``table[u]`` the real
    token of compact id ``u`` and id 0 reserved for "no token" (``table[0] = -1``, zero mass).
    Builders only rank tokens, so a tree built on the compact ids maps back through ``table``."""
    real = tokens[tokens >= 0]
    uniq = torch.unique(real)
    table = torch.cat([torch.full((1,), -1, dtype=torch.long), uniq])
    ids = torch.searchsorted(uniq, tokens.clamp(min=0)) + 1
    ids = torch.where(tokens >= 0, ids, torch.zeros_like(ids))
    marg = torch.zeros(*tokens.shape[:-1], table.numel(), dtype=torch.float32)
    marg.scatter_add_(-1, ids, torch.where(tokens >= 0, probs.float(), torch.zeros_like(probs.float())))
    marg[..., 0] = 0.0
    return marg, table


# ------------------------------------------------------------------------- corpus simulation
class Corpus:
    """Prompts with their reference continuations, flattened for batched lookups."""

    def __init__(self, prompts, conts, hids, pad_depth: int):
        self.prompts, self.conts, self.hids = prompts, conts, hids
        self.L = torch.tensor([c.numel() for c in conts], dtype=torch.long)
        Lm = int(self.L.max()) if len(conts) else 0
        self.ref = torch.full((len(conts), Lm + pad_depth + 1), -1, dtype=torch.long)
        for i, c in enumerate(conts):
            self.ref[i, : c.numel()] = c
        self.off = torch.cat([torch.zeros(1, dtype=torch.long), self.L.cumsum(0)[:-1]]) if len(conts) else self.L
        self.H = torch.cat(hids) if hids else None

    def __len__(self):
        return len(self.conts)

    def roots(self, p, t):  # root c_t (1-based t)
        return self.ref[p, t - 1]

    def reference(self, p, t, D):  # target tokens at depths 1..D after root c_t
        return self.ref[p[:, None], t[:, None] + torch.arange(D)[None, :]]

    def hidden(self, p, t):  # hidden state that produced c_t
        return self.H[self.off[p] + t - 1]

    def positions(self, stride: int = 1):
        """All roots (p, t), 1 <= t < L."""
        ps, ts = [], []
        for p in range(len(self)):
            t = torch.arange(1, int(self.L[p]), stride)
            ps.append(torch.full_like(t, p))
            ts.append(t)
        return torch.cat(ps), torch.cat(ts)


class NgramTable:
    """Per-depth n-gram candidates for every root position of a corpus, computed once (one
    batched proposal per prompt: every prefix of its reference at once)."""

    def __init__(self, corpus: Corpus, drafter: NgramDrafter, depth: int):
        self.depth = depth
        self.rows: dict[tuple[int, int], int] = {}
        toks, probs = [], []
        for p in range(len(corpus)):
            ctx = torch.cat([torch.tensor(corpus.prompts[p], dtype=torch.long), corpus.conts[p]])
            P, ts = len(corpus.prompts[p]), range(1, int(corpus.L[p]))
            if not ts:
                continue
            cands = drafter.propose([ctx[: P + t] for t in ts], [depth] * len(ts))
            for t in ts:
                self.rows[(p, t)] = sum(x.shape[0] for x in toks) + t - 1
            toks.append(cands.tokens)
            probs.append(cands.probs)
        K = drafter.top_k
        self.tokens = torch.cat(toks) if toks else torch.zeros(0, depth, K, dtype=torch.long)
        probs = torch.cat(probs) if probs else torch.zeros(0, depth, K)
        # strict order of candidates inside a depth (ties broken as the drafter sorted them), so
        # that builders' top-k on dense marginals sees the drafter's ranks
        self.probs = probs * (1.0 - 1e-6 * torch.arange(K, dtype=torch.float32))

    def get(self, p, t, D):
        idx = torch.tensor([self.rows[(int(a), int(b))] for a, b in zip(p, t)], dtype=torch.long)
        return self.tokens[idx, :D], self.probs[idx, :D]


def chain_candidates(head, hidden: torch.Tensor, roots: torch.Tensor, D: int, K: int):
    """The draft head's greedy chain and its top-``K`` per depth: ``(tokens [B, D, K]`` shortlist ids,
    ``probs [B, D, K], nodes evaluated)``, what a chain drafter (the runtime's draft model) hands the
    builder: one candidate row per depth, conditioned on the chain's own context."""
    from draft_head import HeadStepFn

    from vllm_bole.spec_decode.offline.trees import Frontier

    B = roots.numel()
    step = HeadStepFn(head, hidden, roots)
    req, tok, path = torch.arange(B), roots.long(), roots.long()[:, None]
    toks, probs = [], []
    for d in range(D):
        fr = Frontier(request=req, node_id=torch.full((B,), d), parent_id=torch.full((B,), d - 1), token=tok,
                      depth=d, path_tokens=path)
        p, t = step(fr).topk(K, dim=-1)
        toks.append(t)
        probs.append(p)
        tok = t[:, 0]
        path = torch.cat([path, tok[:, None]], 1)
    return torch.stack(toks, 1), torch.stack(probs, 1), step.nodes


def runtime_trees(roots, tok, prob, N: int, calibration: Calibration | None):
    """The runtime builder (``best_first_slots``, optionally calibrated) on per-depth candidates;
    ``(tree, node token in the candidates' ids, -1 for roots and empty nodes)``."""
    cands = Candidates(tok.long(), torch.where(tok >= 0, prob.float(), 0.0))
    tree = best_first_slots(roots, cands, N, max_depth=N,
                            calibration=calibration.factors() if calibration is not None else None).tree()
    ok = (tree.depth > 0) & (tree.draft_prob > 0)
    return tree, torch.where(ok, tree.token_ids, torch.full_like(tree.token_ids, -1))


def build_trees(drafter: str, builder: str, N: int, template, roots, ngram=None, step=None):
    """One batch of trees. Returns (tree, node_tokens in real ids)."""
    if drafter == "ngram":
        tok, prob = ngram
        marg, table = compact_candidates(tok, prob)
        if builder == "best-first":
            # every depth has at most tok.shape[-1] tokens of positive mass, so considering that
            # many children per node is still exact (zero-mass children are never added)
            dt = build_best_first(roots, marg, N, max_depth=N, top_k=min(N, tok.shape[-1]))
        else:
            dt = build_static(template, roots, marginals=marg, keep_dists=False)
        mapped = table[dt.tree.token_ids.clamp(min=0, max=table.numel() - 1)]
    else:
        if builder == "best-first":
            dt = build_best_first_autoregressive(roots, step, N, max_depth=N, keep_dists=False)
        else:
            dt = build_static(template, roots, step_fn=step, keep_dists=False)
        mapped = step.head.shortlist[dt.tree.token_ids.clamp(min=0, max=step.head.shortlist.numel() - 1)]
    nonroot = dt.tree.depth > 0
    node_tokens = torch.where(nonroot & (dt.draft_probs > 0), mapped, torch.full_like(mapped, -1))
    return dt.tree, node_tokens


def sequoia_table(drafter: str, corpus: Corpus, D: int, K: int, stride: int, ngram_table=None, head=None):
    """Positional acceptance table [D, K] from a calibration corpus (teacher-forced ranks)."""
    p, t = corpus.positions(stride)
    if p.numel() == 0:
        return torch.zeros(D, K)
    ref = corpus.reference(p, t, D)  # [S, D]
    if drafter == "ngram":
        tok, _ = ngram_table.get(p, t, D)
        ranks = rank_of(tok, ref)
    else:
        from draft_head import HeadStepFn

        ranks = torch.empty(p.numel(), D, dtype=torch.long)
        for i in range(0, p.numel(), 256):
            sl = slice(i, i + 256)
            inputs = torch.cat([corpus.roots(p[sl], t[sl])[:, None], ref[sl, :-1].clamp(min=0)], 1)
            probs = HeadStepFn(head, corpus.hidden(p[sl], t[sl]), inputs[:, 0]).teacher_forced_probs(inputs)
            sid = head.inv_shortlist[ref[sl].clamp(min=0)]
            pt = probs.gather(-1, sid.clamp(min=0)[..., None])
            r = (probs > pt).sum(-1)
            ranks[sl] = torch.where(sid >= 0, r, torch.full_like(r, -1))
    ranks = torch.where(ref >= 0, ranks, torch.full_like(ranks, -2))
    depths, rks = conditioned_observations(ranks, K)
    return acceptance_stats(depths, rks, K, D)


def simulate(drafter: str, builder: str, N: int, template, corpus: Corpus, ngram_table=None, head=None,
             chunk: int = 256, calibration: Calibration | None = None, chain_k: int = 16):
    """Simulated decoding of ``corpus`` (:func:`walk`); returns (steps [P], accepted [P], drafter
    nodes evaluated). Drafters ``ngram``, ``draft-head`` (expanded node by node) and ``draft-chain``
    (the head's greedy chain with its top-``chain_k`` per depth). Builders of the runtime's
    candidates (``best-first`` for ``draft-chain``, ``best-first-cal``): ``calibration`` is updated
    after every step with what the step accepted, as the engine does."""
    from draft_head import HeadStepFn

    stats = {"nodes": 0}

    def accept_fn(p, t):
        out = []
        for i in range(0, p.numel(), chunk):
            pp, tt = p[i:i + chunk], t[i:i + chunk]
            roots = corpus.roots(pp, tt)
            if drafter == "draft-chain" or builder == "best-first-cal":
                if drafter == "ngram":
                    tok, prob = ngram_table.get(pp, tt, N)
                    table = None
                else:
                    tok, prob, n = chain_candidates(head, corpus.hidden(pp, tt), roots, N, min(chain_k, N))
                    stats["nodes"] += n
                    table = head.shortlist
                tree, nt = runtime_trees(roots, tok, prob, N, calibration if builder == "best-first-cal" else None)
                if table is not None:
                    nt = torch.where(nt >= 0, table[nt.clamp(min=0)], nt)
                acc, last = accepted_lengths(tree, nt, corpus.reference(pp, tt, N))
                if calibration is not None and builder == "best-first-cal":
                    calibration.update(kind_counts(tree, tree.path[last]))
                out.append(acc)
                continue
            if drafter == "ngram":
                tree, nt = build_trees(drafter, builder, N, template, roots, ngram=ngram_table.get(pp, tt, N))
            else:
                step = HeadStepFn(head, corpus.hidden(pp, tt), roots)
                tree, nt = build_trees(drafter, builder, N, template, roots, step=step)
                stats["nodes"] += step.nodes
            acc, _ = accepted_lengths(tree, nt, corpus.reference(pp, tt, N))
            out.append(acc)
        return torch.cat(out)

    steps, acc = walk(corpus.L.tolist(), accept_fn)
    return steps, acc, stats["nodes"]
