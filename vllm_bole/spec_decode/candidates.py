"""What every drafter hands to the tree builder: per-depth candidate tokens with probabilities for
a whole batch (laid out like vLLM's draft buffers), and the drafter interface.

A drafter sees each request's token history (prompt + accepted output; its last token is the
tree's root, the bonus token the target has not processed yet) and proposes, for every depth
``d + 1 = 1 .. D``, up to ``K`` candidate tokens with their *marginal* probabilities (one-pass
drafter view: the candidates at depth ``d + 1`` continue any node of depth ``d``). The best-first
builder (:func:`vllm_bole.spec_decode.best_first.best_first_tree`) gives a node at depth ``d``
its children from the top of row ``d``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

__all__ = ["Candidates", "Drafter", "TreeDrafter"]


@dataclass(frozen=True)
class Candidates:
    """Per-depth candidates of a batch of requests.

    ``tokens[b, d, k]`` is the ``k``-th candidate of request ``b`` for the draft token at depth
    ``d + 1``, most probable first, ``-1`` padding after the last one; ``probs`` its probability
    (``0`` for padding; per-depth marginals, so a row sums to at most 1). Tokens of one row are
    distinct. A request with no draft (depth 0, no match) has an all-padding ``[D, K]`` block; a
    depth without candidates ends the request's drafts there (nothing deeper can be reached).
    """

    tokens: torch.Tensor  # [B, D, K] int64, -1 padded
    probs: torch.Tensor  # [B, D, K] float32, 0 where tokens == -1

    @property
    def num_requests(self) -> int:
        return self.tokens.shape[0]

    @property
    def depth(self) -> int:
        """D: depths proposed (the batch's largest)."""
        return self.tokens.shape[1]

    @property
    def width(self) -> int:
        """K: candidates per depth."""
        return self.tokens.shape[2]

    @property
    def depths(self) -> torch.Tensor:
        """[B] int64: per request the number of leading depths with at least one candidate."""
        has = (self.tokens >= 0).any(-1)  # [B, D]
        return has.long().cumprod(1).sum(1)

    @classmethod
    def empty(cls, num_requests: int, depth: int, width: int) -> "Candidates":
        """All padding: no request has a draft."""
        return cls(torch.full((num_requests, depth, width), -1, dtype=torch.long),
                   torch.zeros(num_requests, depth, width, dtype=torch.float32))

    def validate(self) -> "Candidates":
        """Check shapes, dtypes, padding and distinct tokens per row (tests, new drafters)."""
        t, p = self.tokens, self.probs
        if t.dim() != 3 or p.shape != t.shape:
            raise ValueError(f"Candidates: tokens {tuple(t.shape)} and probs {tuple(p.shape)} must both be [B, D, K]")
        if t.dtype != torch.int64 or p.dtype != torch.float32:
            raise ValueError(f"Candidates: need int64 tokens and float32 probs, got {t.dtype} and {p.dtype}")
        if bool(((t < 0) & (p != 0)).any()) or bool((p < 0).any()) or bool((t < -1).any()):
            raise ValueError("Candidates: padding must be token -1 with probability 0, probabilities >= 0")
        s = t.sort(-1).values
        if bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()):
            raise ValueError("Candidates: a depth repeats a token")
        return self

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """Dense per-depth marginals ``[B, D, vocab_size]`` (offline builders that take
        ``marginals``; padding dropped)."""
        ok = self.tokens >= 0
        out = torch.zeros(*self.tokens.shape[:-1], int(vocab_size), dtype=torch.float32)
        return out.scatter_add_(-1, self.tokens.clamp(min=0), torch.where(ok, self.probs.float(), 0.0))


@runtime_checkable
class Drafter(Protocol):
    """A drafter of the tree runner (:class:`~vllm_bole.spec_decode.ngram.NgramDrafter`,
    :class:`~vllm_bole.spec_decode.draft_model.HFDraftModel`)."""

    top_k: int  # K: candidates per depth

    def propose(self, histories: Sequence[Sequence[int]], depths: Sequence[int],
                keys: Sequence | None = None) -> Candidates:
        """Candidates ``[B, max(depths), K]`` on the CPU for ``B = len(histories)`` requests:
        request ``b`` gets depths ``1 .. depths[b]`` (0: no draft, all padding) after
        ``histories[b]`` (its last token is the root; a sequence of ints or a 1-D array the
        drafter must not keep). ``keys`` [B] identify requests across calls: a drafter with
        per-request state (:class:`~vllm_bole.spec_decode.paged_draft.PagedDraftModel`) keeps it
        under them and frees it in ``release(keys)``; stateless drafters ignore them."""
        ...


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that drafts whole trees node by node
    (:class:`~vllm_bole.spec_decode.paged_tree_draft.PagedTreeDraftModel`): every node's children from
    its own context, in the best-first search itself."""

    def grow_trees(self, roots, histories, depths, budget, *, keys=None, max_depth: int, top_k=None,
                   calibration=None):
        """The best-first search state (:class:`~vllm_bole.spec_decode.best_first.Slots`) of trees of
        ``budget`` draft nodes per request after each history (arguments as ``Drafter.propose`` and
        :func:`~vllm_bole.spec_decode.best_first.best_first_slots`)."""
        ...
