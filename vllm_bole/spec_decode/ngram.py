"""Model-free drafter: n-gram / prompt lookup with per-depth candidate distributions.

The n-gram drafter looks the end of the context (prompt + generated tokens, the root included)
up in the context itself and proposes what followed earlier occurrences. Unlike vLLM's prompt
lookup (one match, one chain) it returns, for every depth ``k = 1..D``, a *distribution* over
candidate tokens, which is what the tree builders consume (``marginals[b, k - 1]`` of
:func:`vllm_bole.spec_decode.builders.build_best_first` / ``build_static``).

Definition (context ``c[0..T-1]``, ``c[T-1]`` = root):

* every earlier position ``j`` (``1 <= j <= T-1``) is a possible continuation start; its match
  length ``l(j)`` is the length of the longest common suffix of ``c[:j]`` and ``c``, capped at
  ``max_n`` (:func:`suffix_match_lengths`). Starts with ``l(j) >= min_n`` are *matches*.
* a match proposes ``c[j + k - 1]`` at depth ``k`` (when ``j + k - 1 < T``), with weight
  ``w(j) = base ** l(j)`` (longer matches count more; with a large ``base`` this approaches
  "longest match wins", the classic prompt lookup).
* ``p_k(x) = sum_{j: c[j+k-1] = x} w(j) / (sum_{j: j+k-1 < T} w(j) + prior)``: weighted match
  counts, with ``prior`` (in weight units) held back as the mass of "none of these"; so a lone
  short match is less certain than many agreeing long ones, and ``sum_x p_k(x) < 1``.
* candidates per depth are sorted by probability (ties: the most recent occurrence first) and
  cut to ``top_k``. Depths without a candidate have none (probability 0).

Everything is vectorised over the context (``O(T * max_n + M * D)`` for ``M`` matches); the batch
helper loops over requests only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_bole.spec_decode.candidates import Candidates

__all__ = ["NgramDrafter", "NgramProposal", "proposals_to_marginals", "suffix_match_lengths"]


def suffix_match_lengths(context: torch.Tensor, max_n: int) -> torch.Tensor:
    """``[T]`` int64: entry ``j`` is the length of the longest common suffix of ``context[:j]``
    and ``context``, capped at ``max_n`` (entry 0 is 0; ``j = T``, the trivial self-match, is not
    included)."""
    c = torch.as_tensor(context).long().flatten()
    T = c.numel()
    if T == 0 or max_n <= 0:
        return torch.zeros(T, dtype=torch.long)
    m = torch.arange(min(int(max_n), T))[None, :]  # offset from the end
    j = torch.arange(T)[:, None]
    idx = j - 1 - m
    eq = (idx >= 0) & (c[idx.clamp(min=0)] == c[T - 1 - m])
    return eq.long().cumprod(1).sum(1)


@dataclass(frozen=True)
class NgramProposal:
    """Per-depth candidates: ``tokens[k - 1, r]`` is the ``r``-th most probable token at depth
    ``k`` (``-1`` padding), ``probs`` its probability (0 for padding); ``[D, top_k]``.
    ``num_matches``: match positions used; ``longest``: longest match length found."""

    tokens: torch.Tensor  # [D, K] int64
    probs: torch.Tensor  # [D, K] float32
    num_matches: int
    longest: int

    @property
    def depth(self) -> int:
        return self.tokens.shape[0]


class NgramDrafter:
    """N-gram / prompt-lookup drafter with per-depth candidate distributions (module docstring).

    ``min_n``/``max_n``: shortest/longest suffix matched; ``top_k``: candidates kept per depth;
    ``base``: match weight ``base ** length``; ``prior``: mass held back for "no candidate",
    in weight units; ``window``: only the last ``window`` context tokens are searched (None: all).
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, top_k: int = 8, base: float = 4.0,
                 prior: float = 1.0, window: int | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        if top_k < 1 or base < 1.0 or prior < 0.0:
            raise ValueError("need top_k >= 1, base >= 1, prior >= 0")
        self.min_n, self.max_n, self.top_k = int(min_n), int(max_n), int(top_k)
        self.base, self.prior, self.window = float(base), float(prior), window

    def propose(self, context: Sequence[int] | torch.Tensor, depth: int) -> NgramProposal:
        """Candidates for depths ``1..depth`` after ``context`` (its last token is the root)."""
        c = torch.as_tensor(context).long().flatten()
        if self.window is not None and c.numel() > self.window:
            c = c[-self.window:]
        D, K = int(depth), self.top_k
        tokens = torch.full((D, K), -1, dtype=torch.long)
        probs = torch.zeros(D, K, dtype=torch.float32)
        T = c.numel()
        if D <= 0 or T < 2:
            return NgramProposal(tokens, probs, 0, 0)
        ell = suffix_match_lengths(c, self.max_n)
        ell[0] = 0
        js = torch.nonzero(ell >= self.min_n).flatten()
        if js.numel() == 0:
            return NgramProposal(tokens, probs, 0, 0)
        w = torch.pow(torch.tensor(self.base, dtype=torch.float64), ell[js].double())  # [M]
        pos = js[:, None] + torch.arange(D)[None, :]  # [M, D]
        inr = pos < T
        tok = c[pos.clamp(max=T - 1)]
        denom = (w[:, None] * inr).sum(0) + self.prior  # [D]
        mm, kk = torch.nonzero(inr, as_tuple=True)  # match index, depth index
        tt = tok[mm, kk]
        # group (depth, token): summed weight and most recent start
        key = kk * (int(c.max()) + 1) + tt
        uniq, inv = torch.unique(key, return_inverse=True)
        gw = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, w[mm])
        grec = torch.full((uniq.numel(),), -1, dtype=torch.long).scatter_reduce_(0, inv, js[mm], "amax")
        gdep = uniq // (int(c.max()) + 1)
        gtok = uniq % (int(c.max()) + 1)
        # order: depth asc, weight desc, recency desc (stable sorts, last key first)
        o = torch.sort(-grec, stable=True).indices
        o = o[torch.sort(-gw[o], stable=True).indices]
        o = o[torch.sort(gdep[o], stable=True).indices]
        gdep, gtok, gp = gdep[o], gtok[o], (gw[o] / denom[gdep[o]])
        first = torch.searchsorted(gdep, gdep, right=False)
        rank = torch.arange(gdep.numel()) - first
        keep = rank < K
        tokens[gdep[keep], rank[keep]] = gtok[keep]
        probs[gdep[keep], rank[keep]] = gp[keep].float()
        return NgramProposal(tokens, probs, int(js.numel()), int(ell.max()))

    def candidates(self, history: Sequence[int] | torch.Tensor, depth: int) -> Candidates:
        """:meth:`propose` as the tree runner's per-depth :class:`Candidates` (padding dropped; stops at
        the first depth without a candidate)."""
        p = self.propose(history, depth)
        toks, probs = [], []
        for d in range(p.depth):
            keep = p.tokens[d] >= 0
            if not bool(keep.any()):
                break
            toks.append(p.tokens[d][keep])
            probs.append(p.probs[d][keep])
        return Candidates(toks, probs)

    def candidates_batch(self, histories: Sequence[Sequence[int]], depths: Sequence[int]) -> list[Candidates]:
        """:meth:`candidates` per request (the drafters' common batch interface)."""
        return [self.candidates(h, d) for h, d in zip(histories, depths)]

    def propose_batch(self, contexts: Sequence[Sequence[int] | torch.Tensor], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [B, D, K], probs [B, D, K])`` for a batch of contexts."""
        props = [self.propose(c, depth) for c in contexts]
        return torch.stack([p.tokens for p in props]), torch.stack([p.probs for p in props])


def proposals_to_marginals(tokens: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Dense one-pass marginals ``[..., D, vocab_size]`` from sparse candidates ``[..., D, K]``
    (``-1`` padding dropped), for :func:`~vllm_bole.spec_decode.builders.build_best_first` and
    ``build_static``."""
    ok = tokens >= 0
    out = torch.zeros(*tokens.shape[:-1], int(vocab_size), dtype=torch.float32)
    return out.scatter_add_(-1, tokens.clamp(min=0), torch.where(ok, probs.float(), torch.zeros_like(probs.float())))
