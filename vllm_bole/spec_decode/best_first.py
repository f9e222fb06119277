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

import heapq
import math
from dataclasses import dataclass

import numpy as np
from typing import Callable, Sequence

import torch

from vllm_bole.dispatch import use_triton
from vllm_bole.spec_decode.candidates import Candidates
from vllm_bole.spec_decode.tree import MAX_DEPTH, MAX_NODES, TreeBatch, path_words
from vllm_bole.transfer import host_array

__all__ = ["Slots", "best_first_slots", "best_first_tree", "budgets", "grow", "level_search", "level_search_packed",
           "free_slots", "packed_children", "packed_level", "packed_trees", "root_only_packed", "search_state", "unpack_slots"]
# per-depth candidates: the priority-queue search up to this many slots in the batch (B * (largest
# budget + 1)), the level-wise numpy search above. best_first_tree, depth 6, 16 candidates, budget 16,
# on a 2-core Xeon: 0.59 against 0.82 ms at 1 request, 0.99 against 1.14 ms at 8; equal near 270
# slots; 2.4 against 1.8 ms at 32 requests
HEAP_SLOTS = 256


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

    def tree(self, budget=None, *, keep=None) -> TreeBatch:
        """The kept nodes as a :class:`TreeBatch` on the slots' device, built directly from the
        search state (valid slots form breadth-first prefixes; depths and parents known). ``budget``
        (int or ``[B]``): each request's ``budget`` best draft nodes by (``logrho`` desc, slot asc)
        only, the root kept: prefix-closed (``rho`` never increases along a path and a parent precedes
        its children), so the best-first tree of that budget over the same expansions (what the budget
        controller cuts the trees to; one pass, without an intermediate :class:`Slots`). ``keep``
        (``[B, S]`` bool on the host) instead: those slots, already ranked so
        (:attr:`~vllm_bole.spec_decode.controller.Choice.keep`)."""
        valid = _np(self.valid)
        if budget is not None:
            v = _select(_np(self.logrho), valid, _np(budgets(budget, valid.shape[0], "cpu")) + 1, None)
        else:
            v = valid if keep is None else _np(keep)
        cut = not np.array_equal(v, valid)  # slots left out: the parents to renumber
        counts = v.sum(1)
        cu = np.zeros(counts.size + 1, np.int64)
        cu[1:] = np.cumsum(counts)
        flat = v.reshape(-1)
        field = lambda name: _np(getattr(self, name)).reshape(-1)[flat]  # noqa: E731
        parent, depth = field("parent"), field("depth")
        T = parent.size
        req = np.repeat(np.arange(counts.size), counts)
        if cut:  # the parents' slots -> their places among the kept slots
            newpos = v.cumsum(1) - 1
            parent = np.where(parent >= 0, newpos[req, np.maximum(parent, 0)], -1)
        local = np.arange(T, dtype=np.int32) - cu[:-1][req].astype(np.int32)
        width = int(depth.max()) + 1
        path = np.full((T, width), -1, np.int32)
        path[np.arange(T), depth] = local
        pflat = np.where(parent >= 0, parent + cu[:-1][req], 0)
        order = np.argsort(depth, kind="stable")
        ends = np.searchsorted(depth[order], np.arange(1, width + 1))
        for d in range(1, width):  # breadth-first: a parent's rows are complete before its children's
            at = order[ends[d - 1]: ends[d]]
            path[at, :d] = path[pflat[at], :d]
        t = torch.from_numpy
        tree = TreeBatch(token_ids=t(field("token")), parent=t(parent.astype(np.int32)), depth=t(depth.astype(np.int32)),
                         cu_nodes=t(cu.astype(np.int32)), path=t(path), anc_mask=t(path_words(path)),
                         max_nodes=int(counts.max()),
                         draft_prob=t(field("qprob")), node_kind=t(field("kind")))
        return tree if self.valid.device.type == "cpu" else tree.to(self.valid.device)

    def flat(self, name: str) -> torch.Tensor:
        """A per-slot field of the kept nodes, flat in the tree's node order."""
        return getattr(self, name).reshape(-1)[self.valid.reshape(-1)]


# expand(request [F], slot [F], depth, slots) -> (probs [F, c], tokens [F, c], child-distribution rows [F] or None),
# torch tensors or numpy arrays
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


def _select(cand_log: np.ndarray, cand_valid: np.ndarray, slots: np.ndarray, total_budget: int | None) -> np.ndarray:
    """Keep mask ``[B, M]``: per request the ``slots[b]`` best candidates by (logrho desc,
    position asc); with ``total_budget``, then the globally best ``total_budget`` non-root
    candidates by (logrho desc, request asc, position asc). Position 0 is the root."""
    B, M = cand_log.shape
    key = np.where(cand_valid, -cand_log, np.inf)
    rank = np.empty((B, M), dtype=np.int64)
    np.put_along_axis(rank, np.argsort(key, axis=1, kind="stable"), np.arange(M)[None, :].repeat(B, 0), axis=1)
    keep = cand_valid & (rank < slots[:, None])
    if total_budget is not None:
        nonroot = keep.copy()
        nonroot[:, 0] = False
        g = np.argsort(np.where(nonroot, key, np.inf).reshape(-1), kind="stable")
        ok = np.empty(B * M, dtype=bool)
        ok[g] = np.cumsum(nonroot.reshape(-1)[g]) <= int(total_budget)
        keep = nonroot & ok.reshape(B, M)
        keep[:, 0] = cand_valid[:, 0]
    return keep


_FIELDS = ("valid", "token", "parent", "depth", "logrho", "qprob", "row", "nid", "kind")


def _as_slots(a: dict, device) -> Slots:
    """numpy search state -> :class:`Slots` (torch; zero-copy on the CPU)."""
    view = _SlotsView(a, device)
    return Slots(**{k: getattr(view, k) for k in _FIELDS})


class _SlotsView:
    """The search state as :class:`Slots`' torch fields, each converted on its first read (most
    ``expand`` functions read none: per-depth candidates)."""

    def __init__(self, a: dict, device):
        self._a, self._device = a, device

    def __getattr__(self, name):
        if name not in _FIELDS:
            raise AttributeError(name)
        value = _to(torch.from_numpy(self._a[name]), self._device)
        setattr(self, name, value)
        return value


def _np(x) -> np.ndarray:
    """numpy view (host tensors: no torch operation dispatched; the search is host work per step)."""
    if not isinstance(x, torch.Tensor):
        return np.asarray(x)
    return host_array(x.detach() if x.requires_grad else x)


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``, without a dispatched no-op ``to`` for the host."""
    return t if torch.device(device).type == "cpu" else t.to(device)


def _roots_state(root: np.ndarray, S: int) -> dict:
    """:func:`grow`'s numpy search state of ``S`` slots per request holding the roots (``root`` [B]) alone."""
    B = root.shape[0]
    a = dict(valid=np.zeros((B, S), bool), token=np.zeros((B, S), np.int64), parent=np.full((B, S), -1, np.int64),
             depth=np.zeros((B, S), np.int64), logrho=np.full((B, S), -np.inf), qprob=np.ones((B, S), np.float32),
             row=np.full((B, S), -1, np.int64), nid=np.zeros((B, S), np.int64), kind=np.zeros((B, S), np.int64))
    a["valid"][:, 0], a["token"][:, 0], a["logrho"][:, 0] = True, root, 0.0
    return a


def grow(root: torch.Tensor, expand: Expand, caps: torch.Tensor, max_depth: int, *,
         total_budget: int | None = None, beam: int | None = None, calibration: torch.Tensor | None = None) -> Slots:
    """Level-wise exact best-first search (module docstring). ``root [B]`` root tokens, ``caps
    [B]`` draft-node budgets; ``expand`` gives the candidate children of the frontier nodes
    (``(request, slot)`` pairs of depth ``d``; probability ``<= 0`` = no child), most probable
    first. ``calibration`` ``[MAX_DEPTH + 1, 3]``: factors per (child depth, child kind)
    (:class:`~vllm_bole.spec_decode.calibration.Calibration`); a child is then scored by
    ``min(f q, 1)``, made non-increasing along its siblings (so the first child stays the most
    probable one and kinds keep their meaning); ``qprob`` keeps the drafter's ``q``.

    The search runs on the host in numpy (small arrays, dozens of operations per level: numpy's
    per-operation cost is a fraction of torch's); ``expand`` sees ``(fb, fs)`` and the state as
    torch tensors, and the result is a :class:`Slots` on ``root``'s device."""
    device = root.device
    B = root.numel()
    caps_np = _np(caps).astype(np.int64)
    S = int(caps_np.max()) + 1
    cal = _np(calibration).astype(np.float32) if calibration is not None else None
    a = _roots_state(_np(root), S)
    next_id = 1
    slots = caps_np + 1
    ar = np.arange(S)[None, :]
    rows_b = np.arange(B)[:, None]
    for d in range(min(int(max_depth), MAX_DEPTH)):
        if S == 1:
            break
        front = a["valid"] & (a["depth"] == d) & (caps_np > 0)[:, None]
        if beam is not None:
            rnk = np.empty((B, S), dtype=np.int64)
            order = np.argsort(np.where(front, -a["logrho"], np.inf), axis=1, kind="stable")
            np.put_along_axis(rnk, order, ar.repeat(B, 0), axis=1)
            front = front & (rnk < int(beam))
        fb, fs = np.nonzero(front)
        if fb.size == 0:
            break
        vals, toks, rows = expand(torch.from_numpy(fb), torch.from_numpy(fs), d, _SlotsView(a, device))
        vals, toks = _np(vals), _np(toks).astype(np.int64)
        c = vals.shape[1]
        # kind of each child: the first child of a main node is main, its later children branch, the
        # children of branch and off nodes off
        pk = a["kind"][fb, fs][:, None]
        col = np.arange(c)[None, :]
        ckind = np.where(pk == 0, np.where(col == 0, 0, 1), 2)
        score = vals.astype(np.float64)
        if cal is not None:
            scaled = np.minimum.accumulate(np.minimum(vals.astype(np.float32) * cal[d + 1][ckind], 1.0), axis=1)
            score = np.where(vals > 0, scaled, vals.astype(np.float32)).astype(np.float64)
        if rows is not None:
            a["row"][fb, fs] = _np(rows)
        # candidates: the kept nodes, then the children of the frontier (F_b nodes per request, in slot order)
        fpos = np.cumsum(front, axis=1)[fb, fs] - 1
        Fm = int(fpos.max()) + 1
        fslot = np.zeros((B, Fm), np.int64)
        fslot[fb, fpos] = fs
        ctok, cq = np.zeros((B, Fm, c), np.int64), np.zeros((B, Fm, c), np.float32)
        cvalid, ck = np.zeros((B, Fm, c), bool), np.zeros((B, Fm, c), np.int64)
        ctok[fb, fpos], cq[fb, fpos], cvalid[fb, fpos], ck[fb, fpos] = toks, vals, vals > 0, ckind
        clog = np.full((B, Fm, c), -np.inf)
        with np.errstate(divide="ignore"):
            clog[fb, fpos] = a["logrho"][fb, fs][:, None] + np.log(score)
        clog = np.where(cvalid, clog, -np.inf).reshape(B, Fm * c)
        keep = _select(np.concatenate([a["logrho"], clog], 1), np.concatenate([a["valid"], cvalid.reshape(B, -1)], 1),
                       slots, total_budget)
        # compaction: kept candidates keep their breadth-first order (old nodes, then children by parent slot)
        newpos = np.cumsum(keep, axis=1) - 1
        kb, km = np.nonzero(keep)
        src = np.zeros((B, S), np.int64)  # candidate position of each new slot
        src[kb, newpos[kb, km]] = km
        nvalid = ar < keep.sum(1, keepdims=True)
        is_old = src < S
        oslot = np.minimum(src, S - 1)
        cpos = np.maximum(src - S, 0)
        take = lambda x, i: x[rows_b, i]  # noqa: E731  (np.take_along_axis, without its overhead)
        pslot = take(fslot, cpos // c)  # a new node's parent slot
        p_old = np.where(is_old, take(a["parent"], oslot), pslot)
        n_parent = np.where(p_old >= 0, take(newpos, np.maximum(p_old, 0)), -1)

        def pick(name, new, empty):
            return np.where(nvalid, np.where(is_old, take(a[name], oslot), new), empty)

        a = dict(
            valid=nvalid,
            token=pick("token", take(ctok.reshape(B, -1), cpos), 0),
            parent=np.where(nvalid, n_parent, -1),
            depth=pick("depth", d + 1, 0),
            logrho=pick("logrho", take(clog, cpos), -np.inf),
            qprob=pick("qprob", take(cq.reshape(B, -1), cpos), 0.0).astype(np.float32),
            row=np.where(is_old, take(a["row"], oslot), -1),
            nid=np.where(is_old, take(a["nid"], oslot), next_id + pslot * c + cpos % c),
            kind=pick("kind", take(ck.reshape(B, -1), cpos), 0),
        )
        next_id += S * c
    return _as_slots(a, device)


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
        prob, tok = _np(prob[..., :c]), _np(candidates.tokens[:, :L].gather(-1, order)[..., :c])

    if prob is not None and caps.numel() * (int(caps.max()) + 1) <= HEAP_SLOTS:
        return _as_slots(_heap_search(_np(root), prob, tok, _np(caps), total_budget, calibration), root.device)

    def expand(fb, fs, d, _slots):
        f = fb.numpy()
        return prob[f, d], tok[f, d], None

    return grow(root, expand, caps, L, total_budget=total_budget, calibration=calibration)


# the device search's (:func:`level_search_packed`) candidates per request and level at most, slots x (1 + top_k):
# its [B, width, 6] float64 intermediates are ~0.2 GB at B = 1024 (the draft's largest bucket) and 4096; beyond it
# the drafters search on the host
SEARCH_WIDTH = 4096
# the packed search state of :func:`level_search_packed`, one float64 per field and slot (exact: tokens and
# slots are small integers, qprob a float32), and its empty slot and root slot (the root's token: the request's)
PACKED_FIELDS = ("valid", "token", "parent", "depth", "kind", "logrho", "qprob")
EMPTY_SLOT = dict(valid=0.0, token=0.0, parent=-1.0, depth=0.0, kind=0.0, logrho=-math.inf, qprob=0.0)
ROOT_SLOT = dict(EMPTY_SLOT, valid=1.0, logrho=0.0, qprob=1.0)
# a free slot inside the level search: depth -1 (never a frontier), score -inf (sorted after every node)
FREE_SLOT = dict(EMPTY_SLOT, depth=-1.0)
# the packed search state's fields (PACKED_FIELDS without "valid"), by index
S_TOK, S_PAR, S_DEP, S_KIND, S_LOG, S_Q = range(6)


def root_only_packed(root: torch.Tensor, slots: int, empty: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, slots, PACKED_FIELDS]`` float64 on ``root``'s device: every request's tree its root alone
    (``root`` [B] its token), the other slots ``empty`` ([PACKED_FIELDS], default EMPTY_SLOT). No
    host-to-device copy, so it runs inside a CUDA graph capture."""
    empty = _slot(EMPTY_SLOT, root.device) if empty is None else empty
    first = (torch.arange(int(slots), device=root.device) == 0)[:, None]
    out = torch.where(first, _slot(ROOT_SLOT, root.device), empty).repeat(root.shape[0], 1, 1)
    out[:, 0, PACKED_FIELDS.index("token")] = root.double()
    return out


def _slot(values: dict, device) -> torch.Tensor:
    """``[PACKED_FIELDS]`` float64 of ``values``, by scalar fills (a tensor built from host data would be
    a host-to-device copy, which a CUDA graph capture refuses)."""
    out = torch.empty(len(PACKED_FIELDS), dtype=torch.float64, device=device)
    for i, name in enumerate(PACKED_FIELDS):
        out[i].fill_(values[name])
    return out


def level_search(root: torch.Tensor, prob: torch.Tensor, tok: torch.Tensor, caps: torch.Tensor, slots: int,
                 calibration: torch.Tensor) -> Slots:
    """:func:`level_search_packed` as :class:`Slots`."""
    return unpack_slots(level_search_packed(root, prob, tok, caps, slots, calibration))


def unpack_slots(packed: torch.Tensor) -> Slots:
    """``[B, S, PACKED_FIELDS]`` float64 -> :class:`Slots` (on the same device)."""
    B, S, _ = packed.shape
    f = dict(zip(PACKED_FIELDS, packed.unbind(-1)))
    return Slots(valid=f["valid"] > 0, token=f["token"].long(), parent=f["parent"].long(), depth=f["depth"].long(),
                 kind=f["kind"].long(), logrho=f["logrho"].clone(), qprob=f["qprob"].float(),
                 row=torch.full((B, S), -1, dtype=torch.long, device=packed.device),
                 nid=torch.arange(S, device=packed.device).expand(B, S).clone())


def level_search_packed(root: torch.Tensor, prob: torch.Tensor, tok: torch.Tensor, caps: torch.Tensor, slots: int,
                        calibration: torch.Tensor, *, kernels: str = "auto") -> torch.Tensor:
    """:func:`grow` over per-depth candidates in torch with fixed shapes and no host synchronisation, so
    that it runs inside a CUDA graph on the device that drafted them (the paged draft's step): the
    tree's shape then costs device microseconds instead of host milliseconds. ``root`` [B],
    ``prob``/``tok`` ``[B, L, c]`` (most probable first, probability ``<= 0``: no candidate), ``caps``
    [B] draft-node budgets (each ``< slots``), ``calibration`` ``[MAX_DEPTH + 1, 3]`` factors (ones:
    none). Same order and scores as :func:`grow` (the same expressions; its floats where the device's
    ``log`` rounds as numpy's does); no batch-wide budget. Returns the state ``[B, slots,
    PACKED_FIELDS]`` float64: the fields travel packed (one sort, one scatter and one copy to the host
    per level and step instead of one per field). ``kernels``: after the scores, every level in one
    launch (``csrc_triton.level_search``, equal trees) or this function's own loop (its torch twin)."""
    B, L, c = prob.shape
    dev, S = prob.device, int(slots)
    vals = prob.float()
    if use_triton(kernels, prob):
        from csrc_triton.level_search import level_search_triton

        col = torch.arange(c, device=dev)
        f = calibration.float()[1: L + 1]  # [L, 3]: the children's factors of a main parent, then of any other
        main, other = (_log_scores(vals, f[:, k][None]) for k in (torch.where(col == 0, 0, 1), torch.full_like(col, 2)))
        return level_search_triton(root, main, other, tok.double(), vals.double(), caps, S)
    st = search_state(root, S)
    keep_n, free = (caps.long() + 1)[:, None], free_slots(st)
    every = torch.arange(S, device=dev).expand(B, S)
    for d in range(L):  # every slot a parent: the depth-d ones get the row's depth-d candidates
        val = torch.where((st[..., S_DEP] == d)[..., None], vals[:, d, None], 0.0)
        st = packed_level(st, packed_children(st, every, tok[:, d, None].expand(B, S, c), val, d + 1, calibration),
                          keep_n, free)
    return packed_trees(st)


def _log_scores(prob: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """float64 logs of :func:`grow`'s child scores, ``min(f q, 1)`` made non-increasing along the siblings
    (the last axis), of probabilities ``prob`` (float32; ``<= 0``: no child, its log not a number) and
    factors ``factor`` (broadcast to ``prob``)."""
    scaled = torch.minimum(prob * factor, torch.ones((), device=prob.device)).cummin(-1).values
    return torch.where(prob > 0, scaled, prob).double().log()


def search_state(root: torch.Tensor, slots: int, extra: int = 0) -> torch.Tensor:
    """The packed search's state ``[B, slots, 6 + extra]`` float64 holding the roots (``root`` [B]) alone: the
    fields of :data:`PACKED_FIELDS` after "valid" (:data:`S_TOK` ..), then ``extra`` of the caller's (-1);
    the other slots free (:data:`FREE_SLOT`: depth -1, never a frontier; logrho -inf, sorted after every
    node, instead of per-level masks and counts: few kernels per level, the draft's step graph is bound
    by its kernel count on the H200). Graph-safe."""
    st = root_only_packed(root, slots, _slot(FREE_SLOT, root.device))[..., 1:]
    return torch.cat([st, st.new_full((*st.shape[:2], extra), -1.0)], -1)


def free_slots(st: torch.Tensor) -> torch.Tensor:
    """:func:`packed_level`'s template for the search state ``st`` [B, S, F]: ``[B, S + 1, F]`` free slots
    (:data:`FREE_SLOT`, the caller's fields -1; the last slot a dump), made once per search (a level that made
    its own would add its fills to every level's kernels)."""
    B, S, F = st.shape
    return torch.cat([_slot(FREE_SLOT, st.device)[1:], st.new_full((F - 6,), -1.0)]).expand(B, S + 1, F)


def packed_children(st: torch.Tensor, pslot: torch.Tensor, tok: torch.Tensor, prob: torch.Tensor, depth: int,
                    calibration: torch.Tensor) -> torch.Tensor:
    """The candidate children of the nodes at slots ``pslot`` [B, F] of the search state ``st`` [B, S, n]:
    tokens / probabilities ``[B, F, c]`` (most probable first; ``<= 0``: no child) -> ``[B, F * c, n]``
    in :func:`grow`'s candidate order with its kinds and scores (a main parent's first child main, its
    later ones branch, any other parent's off; ``min(f q, 1)`` non-increasing along siblings, ``f`` the
    ``calibration`` [MAX_DEPTH + 1, 3] factor of the children's ``depth`` and kind), the caller's fields -1."""
    B, F, c = prob.shape
    par = st.gather(1, pslot[..., None].expand(B, F, st.shape[-1]))
    col = torch.arange(c, device=st.device)
    kind = torch.where((par[..., S_KIND] == 0)[..., None], (col > 0).long(), 2)  # [B, F, c]
    val = prob.float()
    log = torch.where(val > 0, par[..., S_LOG, None] + _log_scores(val, calibration.float()[depth][kind]), -math.inf)
    fields = torch.broadcast_tensors(tok.double(), pslot.double()[..., None], torch.full((), float(depth), dtype=torch.float64,
                                     device=st.device), kind.double(), log, val.double(),
                                     *[torch.full((), -1.0, dtype=torch.float64, device=st.device)] * (st.shape[-1] - 6))
    return torch.stack(fields, -1).view(B, F * c, st.shape[-1])


def packed_level(st: torch.Tensor, child: torch.Tensor, keep_n: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """One level of the packed search (:func:`grow`'s selection and compaction with fixed shapes): the
    kept nodes ``st`` [B, S, F] (fields ``token, parent, depth, kind, logrho, qprob``, then any of the
    caller's; free slots: depth -1, logrho -inf) and the level's candidate children ``child`` [B, M, F]
    in :func:`grow`'s candidate order (by parent slot, then rank; ``parent`` = the parent's slot before
    this level; logrho -inf: no child) -> the next level's kept nodes [B, S, F]: per row the ``keep_n``
    [B, 1] best by (logrho desc, position asc) in candidate order, parents renumbered, free slots after
    (``free``: :func:`free_slots` of ``st``)."""
    B, S, F = st.shape
    M = S + child.shape[1]
    dev = st.device
    cand = torch.cat([st, child], 1)  # the kept nodes, then the children
    order = cand[..., S_LOG].neg().sort(dim=1, stable=True).indices  # free slots and no-children last (+inf)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(M, device=dev)[None].expand(B, M))
    keep = (rank < keep_n) & (cand[..., S_LOG] > -math.inf)
    newpos = keep.cumsum(1, dtype=torch.long) - 1
    # the parent's slot before this level -> after it (-1 stays -1)
    minus1 = torch.full((B, 1), -1, dtype=torch.long, device=dev)
    cand[..., S_PAR] = torch.cat([minus1, newpos[:, :S]], 1).gather(1, cand[..., S_PAR].long() + 1).double()
    return free.clone().scatter_(1, torch.where(keep, newpos, S)[..., None].expand(B, M, F), cand)[:, :S]


def packed_trees(st: torch.Tensor) -> torch.Tensor:
    """The search state ``st`` [B, S, >= 6] (:func:`packed_level`'s) -> ``[B, S, PACKED_FIELDS]``: valid
    first, the caller's extra fields dropped, empty slots :data:`EMPTY_SLOT`."""
    st = st[..., :6]
    valid = st[..., S_DEP] >= 0
    return torch.cat([valid.double()[..., None], torch.where(valid[..., None], st, _slot(EMPTY_SLOT, st.device)[1:])],
                     -1)


def _child_logs(prob: np.ndarray, calibration) -> tuple[np.ndarray, np.ndarray]:
    """``(main, other)`` ``[B, L, c]`` float64 log scores of the children at each depth: of a main-path
    parent (first child main, later ones branch) and of any other parent (off); :func:`grow`'s
    scores, computed by the same numpy expressions (so the same floats)."""
    vals = prob
    if calibration is None:
        with np.errstate(divide="ignore"):
            logs = np.log(vals.astype(np.float64))
        return logs, logs
    cal = _np(calibration).astype(np.float32)
    L, c = vals.shape[1:]
    f = cal[1: L + 1]  # [L, 3]: child depth d + 1
    out = []
    for kinds in (np.where(np.arange(c) == 0, 0, 1), np.full(c, 2)):
        scaled = np.minimum.accumulate(np.minimum(vals.astype(np.float32) * f[:, kinds][None], 1.0), axis=-1)
        score = np.where(vals > 0, scaled, vals.astype(np.float32)).astype(np.float64)
        with np.errstate(divide="ignore"):
            out.append(np.log(score))
    return out[0], out[1]


def _heap_search(root: np.ndarray, prob: np.ndarray, tok: np.ndarray, caps: np.ndarray, total_budget,
                 calibration) -> dict:
    """:func:`grow` over per-depth candidates (``prob``/``tok`` ``[B, L, c]``, most probable first)
    as a priority queue: a node enters with its first child and its next sibling as candidates (a
    node's score never exceeds its parent's nor its previous sibling's, so every node comes out in
    the order (``logrho`` desc, request asc, depth asc, ranks lexicographic asc), which is (logrho
    desc, request, breadth-first position): :func:`grow`'s order, hence its trees. A few Python
    operations per kept node instead of dozens of numpy operations per depth level: faster while
    the batch holds at most :data:`HEAP_SLOTS` slots. Returns :func:`grow`'s numpy state."""
    B, L, c = prob.shape
    S = int(caps.max()) + 1
    main, other = _child_logs(prob, calibration)
    ok = (prob > 0).tolist()
    logs = (main.tolist(), other.tolist())
    heap = [(-logs[0][b][0][0], b, 1, (0,), 0.0, 0) for b in range(B) if caps[b] > 0 and L > 0 and ok[b][0][0]]
    heapq.heapify(heap)
    kept: list[list] = [[] for _ in range(B)]
    room = caps.tolist()
    left = math.inf if total_budget is None else int(total_budget)
    while heap and left > 0:
        neg, b, d, ranks, plog, pkind = heapq.heappop(heap)
        if not room[b]:
            continue
        room[b] -= 1
        left -= 1
        j = ranks[-1]
        kind = 2 if pkind else int(j > 0)
        kept[b].append((d, ranks, -neg, kind))
        if j + 1 < c and ok[b][d - 1][j + 1]:  # the next sibling
            sib = plog + logs[pkind != 0][b][d - 1][j + 1]
            heapq.heappush(heap, (-sib, b, d, ranks[:-1] + (j + 1,), plog, pkind))
        if d < L and ok[b][d][0]:  # the first child
            heapq.heappush(heap, (-(-neg + logs[kind != 0][b][d][0]), b, d + 1, ranks + (0,), -neg, kind))
    a = _roots_state(root, S)
    for b in range(B):
        nodes = sorted(kept[b])  # breadth-first: depth, then ranks
        slot = {(): 0}
        for i, (d, ranks, lr, kind) in enumerate(nodes, 1):
            slot[ranks] = i
            a["parent"][b, i], a["depth"][b, i], a["logrho"][b, i], a["kind"][b, i] = slot[ranks[:-1]], d, lr, kind
            a["token"][b, i], a["qprob"][b, i], a["nid"][b, i] = tok[b, d - 1, ranks[-1]], prob[b, d - 1, ranks[-1]], i
        a["valid"][b, : len(nodes) + 1] = True
    a["qprob"][~a["valid"]] = 0.0
    return a
