"""Best-first draft trees (BASTION / DDTree): the runtime builder of the tree runner, and the
level-wise search every best-first variant shares (the offline ones live in
:mod:`vllm_bole.spec_decode.offline`).

Runtime: :func:`best_first_tree` takes the drafters' :class:`Candidates` ``[B, D, K]`` directly
(a node at depth ``d`` takes its children from the top of row ``d``, the candidates for depth
``d + 1``) and returns the :class:`TreeBatch` the next step verifies: root = local node 0 (the
request's last committed token), draft nodes after it in breadth-first order, every node's
children in decreasing probability (so the first-child chain from the root is the drafter's
greedy chain).

Algorithm (:func:`grow`)
------------------------
* **Budget** = number of *draft* nodes per request, the root excluded (a tree has ``budget + 1``
  nodes, at most ``MAX_NODES``). ``total_budget`` optionally caps the draft nodes of the whole
  batch (batch-wide best-first).
* **Scores**: ``rho(i) = prod of draft probabilities along the root-to-i path`` (root 1). The sum
  of ``rho`` over a tree is BASTION's estimate of the expected number of accepted tokens (+1).
  Selection works in float64 log space.
* After each depth level ``d``, keep the top-``budget`` nodes (by ``rho``) of the tree truncated
  at depth ``d``; the next level only expands the depth-``d`` nodes of that set. This equals the
  classic priority-queue best-first expansion (always add the frontier node of largest ``rho``)
  because (i) ``rho`` never increases along a path, so the top-N set of any prefix-closed
  candidate family is prefix-closed, and (ii) a node outside the top-N of the depth-``d``
  truncation can never re-enter (adding deeper candidates only pushes it down). Ties are broken
  by (rho desc, breadth-first position asc), a strict total order in which a parent always
  precedes its children, so the result is prefix-closed even with ties (q = 1 tokens,
  underflow). Result: the tree maximises ``sum rho`` among all prefix-closed trees of ``<=
  budget`` draft nodes, depth ``<= max_depth``, children among each node's ``top_k`` candidates
  (exact when ``top_k >= budget``, the default). Cost per level: one sort of ``[B, (N + 1) + F *
  top_k]`` (``F``: most frontier nodes of a request at that level); a loop over depth levels only.
* Batch-wide: one global selection over all requests with a total budget and per-request caps
  (greedy over a laminar matroid, hence optimal for ``sum rho``); order (rho desc, request asc,
  position asc). The per-level pruning argument still holds because the greedy acceptance count
  before any node can only drop when candidates are removed.
* ``beam`` (offline, EAGLE-2 style autoregressive drafters) expands only the ``beam`` best
  depth-``d`` nodes per request; the final tree is still the global rerank of everything generated.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES, TreeBatch

__all__ = ["Slots", "best_first_slots", "best_first_tree", "budgets", "grow"]


@dataclass
class Slots:
    """The search state, ``[B, S]`` per slot (``S`` = largest budget + 1). Valid slots form a prefix
    of every row in breadth-first order, so a slot's index is its local node index."""

    valid: torch.Tensor  # [B, S] bool
    token: torch.Tensor  # [B, S] int64 (root token at slot 0)
    parent: torch.Tensor  # [B, S] int64 local parent, -1 for the root and invalid slots
    depth: torch.Tensor  # [B, S] int64
    logrho: torch.Tensor  # [B, S] float64 log score, -inf for invalid slots
    qprob: torch.Tensor  # [B, S] float32 the node's draft probability (1 for the root)
    row: torch.Tensor  # [B, S] int64 child-distribution row from ``expand`` (-1: none)
    nid: torch.Tensor  # [B, S] int64 node id, unique within a request for the whole search (root 0)
    kind: torch.Tensor  # [B, S] int64 calibration kind (``calibration.KINDS``: main, branch, off)

    def tree(self) -> TreeBatch:
        """The kept nodes as a :class:`TreeBatch` (validated) on the slots' device."""
        counts = self.valid.sum(1)
        cu = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
        cu[1:] = counts.cumsum(0)
        flat = self.valid.reshape(-1)
        tree = TreeBatch.from_flat(self.parent.reshape(-1)[flat], self.token.reshape(-1)[flat], cu)
        return dataclasses.replace(tree, draft_prob=self.qprob.reshape(-1)[flat].cpu(),
                                   node_kind=self.kind.reshape(-1)[flat].cpu()).to(counts.device)

    def flat(self, name: str) -> torch.Tensor:
        """A per-slot field of the kept nodes, flat in the tree's node order."""
        return getattr(self, name).reshape(-1)[self.valid.reshape(-1)]

    def prune(self, budget) -> "Slots":
        """Each request's ``budget`` (int or ``[B]``) best draft nodes by (``logrho`` desc, slot asc),
        the root kept: prefix-closed (``rho`` never increases along a path and a parent precedes its
        children), so the best-first tree of that budget over the same expansions; slots compacted
        in their breadth-first order."""
        B, S = self.valid.shape
        keep = _select(self.logrho, self.valid, budgets(budget, B, self.valid.device) + 1, None)
        newpos = keep.long().cumsum(1) - 1
        src = torch.zeros_like(newpos)
        kb, km = keep.nonzero(as_tuple=True)
        src[kb, newpos[kb, km]] = km
        nvalid = torch.arange(S, device=keep.device)[None, :] < keep.sum(1, keepdim=True)
        par = self.parent.gather(1, src)
        parent = torch.where(nvalid & (par >= 0), newpos.gather(1, par.clamp(min=0)), torch.full_like(par, -1))
        fields = {f.name: getattr(self, f.name).gather(1, src) for f in dataclasses.fields(self)
                  if f.name not in ("valid", "parent", "logrho")}
        logrho = torch.where(nvalid, self.logrho.gather(1, src), -math.inf)
        return Slots(valid=nvalid, parent=parent, logrho=logrho, **fields)


# expand(request [F], slot [F], depth, slots) -> (probs [F, c], tokens [F, c], child-distribution rows [F] or None)
Expand = Callable[[torch.Tensor, torch.Tensor, int, Slots], tuple]


def budgets(budget, B: int, device) -> torch.Tensor:
    """``[B]`` int64 draft-node budgets from an int, a sequence or a ``[B]`` tensor (checked)."""
    caps = torch.as_tensor(budget, dtype=torch.long).to(device)
    if caps.dim() == 0:
        caps = caps.expand(B).clone()
    if caps.shape != (B,):
        raise ValueError(f"budget: expected an int or a [B={B}] tensor, got shape {tuple(caps.shape)}")
    if (caps < 0).any() or (caps > MAX_NODES - 1).any():
        raise ValueError(f"budget: per-request draft nodes must lie in [0, {MAX_NODES - 1}]")
    return caps


def _select(cand_log: torch.Tensor, cand_valid: torch.Tensor, slots: torch.Tensor, total_budget: int | None):
    """Keep mask ``[B, M]``: per request the ``slots[b]`` best candidates by (logrho desc,
    position asc); with ``total_budget``, then the globally best ``total_budget`` non-root
    candidates by (logrho desc, request asc, position asc). Position 0 is the root."""
    B, M = cand_log.shape
    key = torch.where(cand_valid, -cand_log, torch.full_like(cand_log, math.inf))
    order = torch.sort(key, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(M, device=key.device)[None, :].expand(B, M))
    keep = cand_valid & (rank < slots[:, None])
    if total_budget is not None:
        nonroot = keep.clone()
        nonroot[:, 0] = False
        flat = torch.where(nonroot, key, torch.full_like(key, math.inf)).reshape(-1)
        g = torch.sort(flat, stable=True).indices
        cnt = nonroot.reshape(-1)[g].long().cumsum(0)
        ok = torch.empty_like(nonroot.reshape(-1))
        ok[g] = cnt <= int(total_budget)
        keep = nonroot & ok.view(B, M)
        keep[:, 0] = cand_valid[:, 0]
    return keep


def grow(root: torch.Tensor, expand: Expand, caps: torch.Tensor, max_depth: int, *,
         total_budget: int | None = None, beam: int | None = None, calibration: torch.Tensor | None = None) -> Slots:
    """Level-wise exact best-first search (module docstring). ``root [B]`` root tokens, ``caps
    [B]`` draft-node budgets; ``expand`` gives the candidate children of the frontier nodes
    (``(request, slot)`` pairs of depth ``d``; probability ``<= 0`` = no child), most probable
    first. ``calibration`` ``[MAX_DEPTH + 1, 3]``: factors per (child depth, child kind)
    (:class:`~vllm_bole.spec_decode.calibration.Calibration`); a child is then scored by
    ``min(f q, 1)``, made non-increasing along its siblings (so the first child stays the most
    probable one and kinds keep their meaning); ``qprob`` keeps the drafter's ``q``."""
    device = root.device
    B = root.numel()
    S = int(caps.max()) + 1
    s = Slots(
        valid=torch.zeros(B, S, dtype=torch.bool, device=device),
        token=torch.zeros(B, S, dtype=torch.long, device=device),
        parent=torch.full((B, S), -1, dtype=torch.long, device=device),
        depth=torch.zeros(B, S, dtype=torch.long, device=device),
        logrho=torch.full((B, S), -math.inf, dtype=torch.float64, device=device),
        qprob=torch.ones(B, S, dtype=torch.float32, device=device),
        row=torch.full((B, S), -1, dtype=torch.long, device=device),
        nid=torch.zeros(B, S, dtype=torch.long, device=device),
        kind=torch.zeros(B, S, dtype=torch.long, device=device),
    )
    s.valid[:, 0] = True
    s.token[:, 0] = root
    s.logrho[:, 0] = 0.0
    next_id = 1
    slots = caps + 1
    ar = torch.arange(S, device=device)[None, :]
    for d in range(min(int(max_depth), MAX_DEPTH)):
        if S == 1:
            break
        front = s.valid & (s.depth == d) & (caps > 0)[:, None]
        if beam is not None:
            key = torch.where(front, -s.logrho, torch.full_like(s.logrho, math.inf))
            order = torch.sort(key, dim=1, stable=True).indices
            rnk = torch.empty_like(order)
            rnk.scatter_(1, order, ar.expand(B, S))
            front = front & (rnk < int(beam))
        fb, fs = front.nonzero(as_tuple=True)
        if fb.numel() == 0:
            break
        vals, toks, rows = expand(fb, fs, d, s)
        c = vals.shape[1]
        # kind of each child: the first child of a main node is main, its later children branch, the
        # children of branch and off nodes off
        pk = s.kind[fb, fs][:, None]
        col = torch.arange(c, device=device)[None, :]
        ckind = torch.where(pk == 0, torch.where(col == 0, 0, 1), 2)
        score = vals
        if calibration is not None:
            f = calibration.to(device)[d + 1][ckind]
            score = torch.where(vals > 0, (vals.float() * f).clamp(max=1.0).cummin(1).values, vals.float())
        if rows is not None:
            s.row[fb, fs] = rows
        # candidates: the kept nodes, then the children of the frontier (F_b nodes per request, in slot order)
        fpos = front.long().cumsum(1)[fb, fs] - 1
        Fm = int(fpos.max()) + 1
        fslot = torch.zeros(B, Fm, dtype=torch.long, device=device)
        fslot[fb, fpos] = fs
        ctok = torch.zeros(B, Fm, c, dtype=torch.long, device=device)
        ctok[fb, fpos] = toks
        cq = torch.zeros(B, Fm, c, dtype=torch.float32, device=device)
        cq[fb, fpos] = vals.float()
        cvalid = torch.zeros(B, Fm, c, dtype=torch.bool, device=device)
        cvalid[fb, fpos] = vals > 0
        ck = torch.zeros(B, Fm, c, dtype=torch.long, device=device)
        ck[fb, fpos] = ckind
        clog = torch.full((B, Fm, c), -math.inf, dtype=torch.float64, device=device)
        clog[fb, fpos] = s.logrho[fb, fs, None] + score.double().log()
        clog = torch.where(cvalid, clog, torch.full_like(clog, -math.inf)).reshape(B, Fm * c)
        keep = _select(torch.cat([s.logrho, clog], 1), torch.cat([s.valid, cvalid.reshape(B, Fm * c)], 1),
                       slots, total_budget)
        # compaction: kept candidates keep their breadth-first order (old nodes, then children by parent slot)
        newpos = keep.long().cumsum(1) - 1
        kb, km = keep.nonzero(as_tuple=True)
        src = torch.zeros(B, S, dtype=torch.long, device=device)  # candidate position of each new slot
        src[kb, newpos[kb, km]] = km
        nvalid = ar < keep.sum(1, keepdim=True)
        is_old = src < S
        oslot = src.clamp(max=S - 1)
        cpos = (src - S).clamp(min=0)
        pslot = fslot.gather(1, cpos // c)  # a new node's parent slot
        p_old = torch.where(is_old, s.parent.gather(1, oslot), pslot)
        n_parent = torch.where(p_old >= 0, newpos.gather(1, p_old.clamp(min=0)), torch.full_like(p_old, -1))

        def pick(old: torch.Tensor, new: torch.Tensor, empty) -> torch.Tensor:
            x = torch.where(is_old, old.gather(1, oslot), new)
            return torch.where(nvalid, x, torch.full_like(x, empty))

        s = Slots(
            valid=nvalid,
            token=pick(s.token, ctok.reshape(B, -1).gather(1, cpos), 0),
            parent=torch.where(nvalid, n_parent, torch.full_like(n_parent, -1)),
            depth=pick(s.depth, torch.full_like(oslot, d + 1), 0),
            logrho=pick(s.logrho, clog.gather(1, cpos), -math.inf),
            qprob=pick(s.qprob, cq.reshape(B, -1).gather(1, cpos), 0.0),
            row=torch.where(is_old, s.row.gather(1, oslot), torch.full_like(oslot, -1)),
            nid=torch.where(is_old, s.nid.gather(1, oslot), next_id + pslot * c + cpos % c),
            kind=pick(s.kind, ck.reshape(B, -1).gather(1, cpos), 0),
        )
        next_id += S * c
    return s


def best_first_tree(root_tokens: Sequence[int] | torch.Tensor, candidates: Candidates, budget, **options) -> TreeBatch:
    """The runtime draft trees: :func:`best_first_slots` (same arguments) as a :class:`TreeBatch`."""
    return best_first_slots(root_tokens, candidates, budget, **options).tree()


def best_first_slots(
    root_tokens: Sequence[int] | torch.Tensor,
    candidates: Candidates,
    budget,
    *,
    max_depth: int | None = None,
    top_k: int | None = None,
    total_budget: int | None = None,
    calibration: torch.Tensor | None = None,
) -> Slots:
    """Best-first over per-depth candidates (module docstring), as the search's :class:`Slots`.

    ``root_tokens [B]``: each request's root (its last committed token). ``candidates``:
    ``[B, D, K]`` from a drafter. ``budget``: draft nodes per request (int, sequence or ``[B]``;
    0: root only). ``max_depth``: default ``D``. ``top_k``: children considered per node (the
    first ``top_k`` candidates of the next depth; default all ``K``). ``total_budget``: optional
    cap on the draft nodes of the whole batch. ``calibration``: per (depth, kind) factors on the
    draft probabilities (:func:`grow`). Every request's tree (a request without candidates is its
    root alone) on the candidates' device."""
    root = torch.as_tensor(root_tokens, dtype=torch.long).flatten().to(candidates.tokens.device)
    B, D, K = candidates.tokens.shape
    if root.numel() != B or B == 0:
        raise ValueError(f"root_tokens: {root.numel()} roots for {B} requests of candidates (need B >= 1)")
    caps = budgets(budget, B, root.device)
    L = min(D if max_depth is None else int(max_depth), D)
    c = min(K if top_k is None else int(top_k), K)
    if L <= 0 or c <= 0:
        caps = torch.zeros_like(caps)
        tok = prob = None
    else:
        # most probable first within a depth (drafters already sort; ties keep the drafter's order)
        prob = torch.where(candidates.tokens[:, :L] >= 0, candidates.probs[:, :L].float(), 0.0)
        prob, order = prob.sort(dim=-1, descending=True, stable=True)
        prob, tok = prob[..., :c], candidates.tokens[:, :L].gather(-1, order)[..., :c]

    def expand(fb, fs, d, _slots):
        return prob[fb, d], tok[fb, d], None

    return grow(root, expand, caps, L, total_budget=total_budget, calibration=calibration)
