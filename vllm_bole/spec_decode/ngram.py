"""Model-free drafter: n-gram / prompt lookup with per-depth candidate distributions.

The n-gram drafter looks the end of the context (prompt + generated tokens, the root included)
up in the context itself and proposes what followed earlier occurrences. Unlike vLLM's prompt
lookup (one match, one chain) it returns, for every depth ``k = 1..D``, a *distribution* over
candidate tokens: :class:`~vllm_bole.spec_decode.candidates.Candidates` ``[B, D, K]``, what the
best-first builder consumes.

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

Everything is vectorised over the whole batch at once (the contexts concatenated, each position
knowing its request): ``O(sum T * max_n + M * D)`` for ``M`` matches, no loop over requests.
"""
from __future__ import annotations

from typing import Sequence

import torch

from vllm_bole.spec_decode.candidates import Candidates

__all__ = ["NgramDrafter", "suffix_match_lengths"]


def _suffix_match_flat(c: torch.Tensor, start: torch.Tensor, end: torch.Tensor, max_n: int) -> torch.Tensor:
    """:func:`suffix_match_lengths` of many contexts concatenated in ``c`` (context of flat position
    ``j`` = ``c[start[j]:end[j]]``): ``[N]`` int64, local entry 0 of every context is 0."""
    N = c.numel()
    if N == 0 or max_n <= 0:
        return torch.zeros(N, dtype=torch.long)
    m = torch.arange(int(max_n))[None, :]  # offset from the end
    idx = torch.arange(N)[:, None] - 1 - m
    eq = (idx >= start[:, None]) & (c[idx.clamp(min=0)] == c[(end[:, None] - 1 - m).clamp(min=0)])
    return eq.long().cumprod(1).sum(1)


def suffix_match_lengths(context: torch.Tensor, max_n: int) -> torch.Tensor:
    """``[T]`` int64: entry ``j`` is the length of the longest common suffix of ``context[:j]``
    and ``context``, capped at ``max_n`` (entry 0 is 0; ``j = T``, the trivial self-match, is not
    included)."""
    c = torch.as_tensor(context).long().flatten()
    T = c.numel()
    return _suffix_match_flat(c, torch.zeros(T, dtype=torch.long), torch.full((T,), T, dtype=torch.long), max_n)


class NgramDrafter:
    """N-gram / prompt-lookup drafter with per-depth candidate distributions (module docstring);
    a :class:`~vllm_bole.spec_decode.candidates.Drafter`.

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

    def _context(self, history) -> torch.Tensor:
        c = torch.as_tensor(history, dtype=torch.long).flatten()
        if self.window is not None and c.numel() > self.window:
            c = c[-self.window:]
        return c

    def matches(self, context: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts [M], lengths [M])``: the continuation starts of one context (window applied)
        whose match length is at least ``min_n``, and those lengths."""
        ell = suffix_match_lengths(self._context(context), self.max_n)
        js = torch.nonzero(ell >= self.min_n).flatten()
        return js, ell[js]

    def propose(self, histories: Sequence[Sequence[int] | torch.Tensor], depths: Sequence[int],
                keys=None) -> Candidates:
        """Candidates ``[B, max(depths), top_k]`` for depths ``1 .. depths[b]`` after each history
        (its last token is the root), for the whole batch in one vectorised pass."""
        B = len(histories)
        dep = torch.as_tensor(list(depths), dtype=torch.long).clamp(min=0).reshape(B)
        D, K = (int(dep.max()) if B else 0), self.top_k
        out = Candidates.empty(B, D, K)
        if D == 0:
            return out
        ctx = [self._context(h) for h in histories]
        lens = torch.tensor([x.numel() for x in ctx], dtype=torch.long)
        c = torch.cat(ctx) if ctx else torch.zeros(0, dtype=torch.long)
        end = lens.cumsum(0)
        start = end - lens
        req = torch.repeat_interleave(torch.arange(B), lens)
        ell = _suffix_match_flat(c, start[req], end[req], self.max_n)
        js = torch.nonzero((ell >= self.min_n) & (dep[req] > 0)).flatten()  # match starts (flat)
        if js.numel() == 0:
            return out
        mb = req[js]
        w = torch.pow(torch.tensor(self.base, dtype=torch.float64), ell[js].double())  # [M]
        kd = torch.arange(D)[None, :]
        pos = js[:, None] + kd  # [M, D]
        inr = (pos < end[mb][:, None]) & (kd < dep[mb][:, None])
        tok = c[pos.clamp(max=c.numel() - 1)]
        denom = torch.zeros(B, D, dtype=torch.float64).index_add_(0, mb, w[:, None] * inr) + self.prior
        mm, kk = torch.nonzero(inr, as_tuple=True)  # match index, depth index
        # group (request, depth, token): summed weight and most recent start
        V1 = int(c.max()) + 1
        key = (mb[mm] * D + kk) * V1 + tok[mm, kk]
        uniq, inv = torch.unique(key, return_inverse=True)
        gw = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, w[mm])
        grec = torch.full((uniq.numel(),), -1, dtype=torch.long).scatter_reduce_(0, inv, js[mm], "amax")
        grp, gtok = uniq // V1, uniq % V1  # grp = request * D + depth
        # order: (request, depth) asc, weight desc, recency desc (stable sorts, last key first)
        o = torch.sort(-grec, stable=True).indices
        o = o[torch.sort(-gw[o], stable=True).indices]
        o = o[torch.sort(grp[o], stable=True).indices]
        grp, gtok, gp = grp[o], gtok[o], gw[o] / denom.view(-1)[grp[o]]
        rank = torch.arange(grp.numel()) - torch.searchsorted(grp, grp, right=False)
        keep = rank < K
        out.tokens.view(B * D, K)[grp[keep], rank[keep]] = gtok[keep]
        out.probs.view(B * D, K)[grp[keep], rank[keep]] = gp[keep].float()
        return out
