"""The offline builders' result (:class:`DraftTree`: a :class:`TreeBatch` plus what verification of
sampled children needs), the autoregressive drafter interface (:class:`Frontier`, ``StepFn``),
and :func:`verify`, which picks the lossless scheme for the way a tree's children were chosen.

* **Children kinds** (``DraftTree.children``): ``"deterministic"`` (top-k / static / best-first)
  must be verified by sampling from the target and matching children; rejection sampling is
  lossless only for ``"with_replacement"`` / ``"without_replacement"`` trees, whose per-node draft
  distribution is kept as ``child_dist_table[child_dist_index[i]]`` (``[R, V]`` rows, shared rows
  for a one-pass drafter: ``row = b * D + depth``).
* Trees are built through ``TreeBatch.from_flat`` (validated, CPU) and moved to the input device;
  a static template whose nodes all survive is tiled from one validated tree (no per-batch
  validation), which keeps 1e5-request batches cheap.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.spec_decode.verification import Generators, VerificationResult, verify_deterministic, verify_greedy, \
    verify_rejection

__all__ = [
    "CHILDREN_DETERMINISTIC",
    "CHILDREN_WITH_REPLACEMENT",
    "CHILDREN_WITHOUT_REPLACEMENT",
    "DraftTree",
    "Frontier",
    "StepFn",
    "verify",
]

CHILDREN_DETERMINISTIC = "deterministic"
CHILDREN_WITH_REPLACEMENT = "with_replacement"
CHILDREN_WITHOUT_REPLACEMENT = "without_replacement"
_CHILDREN_KINDS = (CHILDREN_DETERMINISTIC, CHILDREN_WITH_REPLACEMENT, CHILDREN_WITHOUT_REPLACEMENT)


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees plus what verification needs.

    ``draft_probs[i]``: probability of node ``i``'s token under the distribution its parent's
    children were drawn from (1 for roots). ``scores[i]``: ``rho(i)``, product of ``draft_probs``
    along the path (float64; 1 for roots). ``children``: how siblings were chosen (see module
    docstring). ``child_dist_table[child_dist_index[i]]`` is the draft distribution of node
    ``i``'s children (``-1``: not recorded / leaf). ``source_ids[i]``: the node's id in the
    builder (template index for static trees, the ``Frontier.node_id`` for best-first trees),
    for drafters that keep per-node state.
    """

    tree: TreeBatch
    draft_probs: torch.Tensor  # [T] float32
    scores: torch.Tensor  # [T] float64
    children: str = CHILDREN_DETERMINISTIC
    child_dist_table: torch.Tensor | None = None  # [R, V]
    child_dist_index: torch.Tensor | None = None  # [T] int64
    source_ids: torch.Tensor | None = None  # [T] int64

    def __post_init__(self):
        if self.children not in _CHILDREN_KINDS:
            raise ValueError(f"children: {self.children!r}, expected one of {_CHILDREN_KINDS}")

    @property
    def num_requests(self) -> int:
        return self.tree.num_requests

    def child_dists(self) -> torch.Tensor:
        """``[T, V]`` draft distribution of each node's children (zero rows where unknown)."""
        if self.child_dist_table is None or self.child_dist_index is None:
            raise ValueError("this draft tree carries no child distributions")
        idx = self.child_dist_index
        rows = self.child_dist_table[idx.clamp(min=0)]
        return torch.where((idx >= 0)[:, None], rows, torch.zeros_like(rows))

    def expected_accepted(self) -> torch.Tensor:
        """``[B]`` float64: sum of ``rho`` over draft nodes (the root excluded)."""
        B = self.tree.num_requests
        req = self.tree.request_index.to(self.scores.device)
        tot = torch.zeros(B, dtype=torch.float64, device=self.scores.device).index_add_(0, req, self.scores)
        return tot - 1.0


@dataclass(frozen=True)
class Frontier:
    """Nodes handed to an autoregressive drafter (all of depth ``depth``).

    ``node_id`` / ``parent_id`` are ids unique within a request and stable for the whole build
    (the root is 0; ``parent_id`` is -1 for roots); ``path_tokens`` is ``[F, depth + 1]``, root
    token first, the node's own token last.
    """

    request: torch.Tensor  # [F] int64
    node_id: torch.Tensor  # [F] int64
    parent_id: torch.Tensor  # [F] int64
    token: torch.Tensor  # [F] int64
    depth: int
    path_tokens: torch.Tensor  # [F, depth + 1] int64

    @property
    def size(self) -> int:
        return self.request.numel()


StepFn = Callable[[Frontier], torch.Tensor]  # -> [F, V] next-token probabilities


# ------------------------------------------------------------------------------ shared helpers
def as_tokens(root_tokens) -> torch.Tensor:
    t = torch.as_tensor(root_tokens)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError("root_tokens: expected a non-empty 1-D tensor [B]")
    return t.long()


def check_drafter(marginals, step_fn, B: int):
    if (marginals is None) == (step_fn is None):
        raise ValueError("give exactly one of marginals (one-pass drafter) or step_fn (autoregressive drafter)")
    if marginals is not None:
        if marginals.dim() != 3 or marginals.shape[0] != B:
            raise ValueError(f"marginals: expected [B={B}, D, V], got {tuple(marginals.shape)}")


def call_step(step_fn: StepFn, fr: Frontier) -> torch.Tensor:
    probs = step_fn(fr)
    if probs.dim() != 2 or probs.shape[0] != fr.size:
        raise ValueError(f"step_fn: expected [{fr.size}, V] probabilities, got {tuple(probs.shape)}")
    return probs


def _tile(t: TreeBatch, token: torch.Tensor) -> TreeBatch | None:
    """``B`` copies of the one-request tree ``t`` with per-request tokens ``[B, M]``: per-node
    tensors are repeated, host-side fields copied; None if a field cannot be tiled that way."""
    B, M = token.shape
    kw = {}
    for f in fields(TreeBatch):
        v = getattr(t, f.name)
        if f.name == "token_ids":
            kw[f.name] = token.reshape(-1).to(v.device, v.dtype)
        elif f.name == "cu_nodes":
            kw[f.name] = torch.arange(B + 1, dtype=v.dtype) * M
        elif isinstance(v, torch.Tensor):
            if v.dim() == 0 or v.shape[0] != M:
                return None
            kw[f.name] = v.repeat(B, *([1] * (v.dim() - 1)))
        else:
            kw[f.name] = v  # host-side per-tree scalars (e.g. the largest tree size) are unchanged
    return TreeBatch(**kw)


def finalize(
    token: torch.Tensor,
    parent: torch.Tensor,
    valid: torch.Tensor,
    extras: dict[str, torch.Tensor],
    template_tree: TreeBatch | None = None,
) -> tuple[TreeBatch, dict[str, torch.Tensor]]:
    """Compact ``[B, M]`` slot arrays (topological order per row, ``valid`` prefix-closed) into
    a TreeBatch on ``token``'s device, plus the flat extras."""
    B, M = token.shape
    device = token.device
    if template_tree is not None and bool(valid.all()):
        tree = _tile(template_tree, token)
        if tree is not None:
            return tree.to(device), {k: v.reshape(-1) for k, v in extras.items()}
    newidx = valid.long().cumsum(1) - 1
    newpar = torch.where(parent >= 0, newidx.gather(1, parent.clamp(min=0)), torch.full_like(parent, -1))
    flat = valid.reshape(-1)
    counts = valid.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.long, device=device)
    cu[1:] = counts.cumsum(0)
    tree = TreeBatch.from_flat(newpar.reshape(-1)[flat], token.reshape(-1)[flat], cu).to(device)
    return tree, {k: v.reshape(-1)[flat] for k, v in extras.items()}


# -------------------------------------------------------------------------------- verification
def verify(
    draft: DraftTree | TreeBatch,
    target_logits: torch.Tensor,
    *,
    method: str = "auto",
    temperature=None,
    top_k=None,
    top_p=None,
    min_p=None,
    generator: Generators = None,
) -> VerificationResult:
    """Dispatch. ``method``: ``"greedy"``, ``"deterministic"``, ``"specinfer"``, ``"sequoia"`` or
    ``"auto"``: greedy when ``temperature`` is None, otherwise the lossless scheme for the way the
    draft's children were chosen (rejection sampling only for sampled children)."""
    tree = draft.tree if isinstance(draft, DraftTree) else draft
    if method == "auto":
        if temperature is None:
            method = "greedy"
        elif not isinstance(draft, DraftTree) or draft.children == CHILDREN_DETERMINISTIC:
            method = "deterministic"
        elif draft.children == CHILDREN_WITH_REPLACEMENT:
            method = "specinfer"
        elif draft.children == CHILDREN_WITHOUT_REPLACEMENT:
            method = "sequoia"
    if method == "greedy":
        return verify_greedy(tree, target_logits)
    if temperature is None:
        raise ValueError(f"method {method!r} needs a temperature (0 means greedy)")
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator)
    if method == "deterministic":
        return verify_deterministic(tree, target_logits, **kw)
    if method in ("specinfer", "sequoia"):
        if not isinstance(draft, DraftTree) or draft.child_dist_table is None or draft.child_dist_index is None:
            raise ValueError(f"method {method!r} needs a DraftTree with child distributions")
        return verify_rejection(
            tree, target_logits, draft.child_dist_table, draft.child_dist_index,
            replacement=(method == "specinfer"), **kw,
        )
    raise ValueError(f"method: unknown {method!r}")
