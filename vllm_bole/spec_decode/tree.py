"""A batch of ragged draft trees as flat tensors.

Conventions (used by every kernel, oracle and builder of the project):

* Request ``r`` owns the flat node range ``cu_nodes[r] : cu_nodes[r + 1]`` (like vLLM's
  ``cu_seqlens``). ``T = cu_nodes[-1]`` nodes in all.
* Local node 0 of every request is its **root**: the last committed (bonus) token, which the
  target has not processed yet. Its parent is ``-1``, meaning "attached to the committed
  state" (recurrent state S0, conv state, KV prefix). A request with no draft nodes is a tree
  of one node. The root is always accepted.
* Nodes are stored in topological order: ``parent[i] < i`` (local indices). Depth of the root
  is 0; a node at depth ``d`` is the ``d``-th draft token of its path and sits at sequence
  position ``prefix_len + d`` (``prefix_len`` = tokens committed before the root).
* Ancestor relation, two equivalent forms for kernels:
    - ``path[i, d]`` (int32, ``[T, max_depth + 1]``): local index of the ancestor of ``i`` at
      depth ``d`` for ``d <= depth[i]`` (``path[i, depth[i]] == i``), ``-1`` beyond.
      ``j`` is an ancestor-or-self of ``i``  <=>  ``path[i, depth[j]] == j``.
    - ``anc_mask[i, w]`` (int32 words, ``[T, ceil(max_nodes / 32)]``): bit ``j % 32`` of word
      ``j // 32`` is set iff local node ``j`` is an ancestor-or-self of ``i``.

Limits: depth <= ``MAX_DEPTH`` (64), nodes per request <= ``MAX_NODES`` (256).
Construction is vectorised (a loop over depth levels, never over nodes). From drafting to
verification one object: the best-first builder returns a ``TreeBatch``; :meth:`TreeBatch.select`
keeps the requests the scheduler sends back, truncated to the drafts it kept, without a rebuild;
:meth:`TreeBatch.draft_token_ids` gives the scheduler's per-request draft tokens.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch

from vllm_bole.transfer import host_array, upload_many

MAX_DEPTH = 64
MAX_NODES = 256


def int32_words(bits: torch.Tensor) -> torch.Tensor:
    """Ancestor bits held as int64 words (values ``0 .. 2**32 - 1``, 32 nodes a word) -> the int32 words
    ``anc_mask`` holds (the same 32 bits, two's complement)."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def path_words(path: np.ndarray) -> np.ndarray:
    """``anc_mask`` of host trees from their ``path`` ``[T, W]`` (local node indices root first, -1 padded;
    numpy): ``[T, ceil(MAX_NODES / 32)]`` int32, node j as bit j % 32 of word j // 32 (one packbits)."""
    bits = np.zeros((path.shape[0], MAX_NODES), bool)
    rows, cols = np.nonzero(path >= 0)
    bits[rows, path[rows, cols]] = True
    return np.packbits(bits, axis=1, bitorder="little").view("<u4").view(np.int32)


class TreeError(ValueError):
    """A tree batch that violates the conventions above; the message names the field."""


@dataclass(frozen=True)
class TreeBatch:
    token_ids: torch.Tensor  # [T] int64
    parent: torch.Tensor  # [T] int32, local index, -1 for the root
    depth: torch.Tensor  # [T] int32
    cu_nodes: torch.Tensor  # [B + 1] int32
    path: torch.Tensor  # [T, max_depth + 1] int32
    anc_mask: torch.Tensor  # [T, ceil(MAX_NODES / 32)] int32
    max_nodes: int  # largest tree of the batch (host-side, so launchers never sync)
    draft_prob: torch.Tensor | None = None  # [T] float32 the drafter's probability of each node (roots 1), if known
    node_kind: torch.Tensor | None = None  # [T] int64 ``calibration.KINDS`` index of each node, if the builder knew it

    # ------------------------------------------------------------------ derived views
    # (tensor views computed once per object: a step reads them many times; never modify them in place)
    @property
    def num_requests(self) -> int:
        return self.cu_nodes.numel() - 1

    @property
    def num_nodes(self) -> int:
        return self.token_ids.numel()

    @property
    def max_depth(self) -> int:
        return self.path.shape[1] - 1

    @functools.cached_property
    def nodes_per_request(self) -> torch.Tensor:
        """[B] int32: tree size of each request (root included)."""
        return self.cu_nodes[1:] - self.cu_nodes[:-1]

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """[B] int64: flat index of each request's root."""
        return self.cu_nodes[:-1].long()

    @functools.cached_property
    def request_index(self) -> torch.Tensor:
        """[T] int64: the request each flat node belongs to."""
        return torch.repeat_interleave(  # output_size: no device sync
            torch.arange(self.num_requests, device=self.cu_nodes.device), self.nodes_per_request.long(),
            output_size=self.num_nodes)

    @functools.cached_property
    def parent_flat(self) -> torch.Tensor:
        """[T] int64: flat index of each node's parent, -1 for roots."""
        start = self.starts[self.request_index]
        p = self.parent.long()
        return torch.where(p >= 0, p + start, p)

    @functools.cached_property
    def path_flat(self) -> torch.Tensor:
        """[T, max_depth + 1] int64: ``path`` in flat indices (-1 stays -1)."""
        start = self.starts[self.request_index][:, None]
        p = self.path.long()
        return torch.where(p >= 0, p + start, p)

    def is_ancestor(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Whether local node ``j`` is an ancestor-or-self of flat node ``i`` (via ``anc_mask``)."""
        word = self.anc_mask[i, j // 32]
        return ((word >> (j % 32)) & 1).bool()

    def to(self, device) -> "TreeBatch":
        """On ``device`` (from the host: every tensor in one copy, ``transfer.upload_many``)."""
        return self.upload_with(device, [])[0]

    def upload_with(self, device, extra: list) -> tuple["TreeBatch", list]:
        """This batch and the host tensors ``extra`` on ``device``, every host tensor in one copy."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        tensors = {n: x for n, x in moved.items() if isinstance(x, torch.Tensor)}
        host = [n for n, x in tensors.items() if x.device.type == "cpu"]
        moved.update({n: x.to(device) for n, x in tensors.items() if n not in host})
        up = upload_many([tensors[n] for n in host] + list(extra), device)
        moved.update(zip(host, up[: len(host)]))
        return TreeBatch(**moved), up[len(host):]

    def _with_roots(self, root_tokens) -> "TreeBatch":
        """This batch with its roots' tokens replaced by ``root_tokens`` ``[B]`` (None: itself)."""
        if root_tokens is None:
            return self
        if self.token_ids.device.type == "cpu":  # the runner's host trees: numpy (torch's ops were ~70 us a step)
            token = host_array(self.token_ids).copy()
            token[host_array(self.cu_nodes)[:-1]] = root_tokens
            return dataclasses.replace(self, token_ids=torch.from_numpy(token))
        token = self.token_ids.clone()
        token[self.starts] = torch.as_tensor(root_tokens, dtype=torch.long).flatten().to(token.device)
        return dataclasses.replace(self, token_ids=token)

    def root_path(self, r: int, node: int) -> list[int]:
        """Local indices of the path root .. ``node`` of request ``r`` (tests, debugging)."""
        i = int(self.cu_nodes[r]) + node
        return self.path[i, : int(self.depth[i]) + 1].tolist()

    def request(self, r: int) -> tuple[list[int], list[int]]:
        """(parents, token_ids) of request ``r`` as Python lists (tests, debugging)."""
        s, e = int(self.cu_nodes[r]), int(self.cu_nodes[r + 1])
        return self.parent[s:e].tolist(), self.token_ids[s:e].tolist()

    def draft_token_ids(self) -> list[list[int]]:
        """Per request its draft tokens (local nodes ``1 ..``, topological order, the root excluded):
        what vLLM's scheduler takes as the request's speculative tokens."""
        tok, cu = self.token_ids.tolist(), self.cu_nodes.tolist()
        return [tok[cu[r] + 1 : cu[r + 1]] for r in range(self.num_requests)]

    def first_child_depth(self) -> torch.Tensor:
        """[B] int64: length of the first-child chain from each root (the drafter's greedy chain in
        a best-first tree), skipping placeholder children (token ``-1``)."""
        T = self.num_nodes
        if self.node_kind is not None and self.token_ids.device.type == "cpu":  # the runner's host trees: numpy
            # (~10 us; the torch ops below ~180 us a step on a CPU, half of it ``request_index``)
            key = np.where((host_array(self.node_kind) == 0) & (host_array(self.token_ids) >= 0),
                           host_array(self.depth).astype(np.int64), 0)
            return torch.from_numpy(np.maximum.reduceat(key, host_array(self.cu_nodes)[:-1].astype(np.int64)))
        if self.node_kind is not None:  # the main-path nodes are known
            key = torch.where((self.node_kind == 0) & (self.token_ids >= 0), self.depth.long(), 0)
            return torch.zeros(self.num_requests, dtype=torch.long, device=key.device).scatter_reduce_(
                0, self.request_index, key, reduce="amax")
        idx = torch.arange(T, device=self.token_ids.device)
        pf = self.parent_flat
        ok = (pf >= 0) & (self.token_ids >= 0)
        first = torch.full((T,), T, dtype=torch.long, device=idx.device)
        first.scatter_reduce_(0, pf[ok], idx[ok], reduce="amin")
        good = (pf < 0) | (ok & (first[pf.clamp(min=0)] == idx))
        path = self.path_flat
        chain = torch.where(path >= 0, good[path.clamp(min=0)], torch.ones_like(path, dtype=torch.bool)).all(1)
        key = torch.where(chain, self.depth.long(), torch.zeros_like(idx))
        return torch.zeros(self.num_requests, dtype=torch.long, device=idx.device).scatter_reduce_(
            0, self.request_index, key, reduce="amax")

    def select(self, rows, num_nodes=None, *, root_tokens=None) -> "TreeBatch":
        """A new batch of the requests ``rows`` (indices into this batch, in the new order; repeats
        allowed), each truncated to its first ``num_nodes`` nodes (int or per row; default: all).
        A prefix in topological order is still a tree, so nothing is rebuilt: every field is
        gathered (``path`` trimmed to the new deepest node, as :meth:`from_parents` would).
        A row of ``-1`` is a *placeholder*: a root and ``num_nodes - 1`` children of it with token
        ``-1`` (never accepted; default 1 node), for scheduled drafts no tree stands for.
        ``root_tokens`` (``[len(rows)]``) replaces the roots' tokens."""
        if isinstance(rows, list) and isinstance(num_nodes, list) and rows == list(range(self.num_requests)) \
                and num_nodes == self.nodes_per_request.tolist():  # the usual step, checked on the host
            return self._with_roots(root_tokens)
        dev = self.cu_nodes.device
        rows = torch.as_tensor(rows, dtype=torch.long).flatten().to(dev)
        Bn = rows.numel()
        if Bn == 0:
            raise TreeError("rows: empty selection (need at least one request)")
        if bool(((rows < -1) | (rows >= self.num_requests)).any()):
            raise TreeError(f"rows: indices must lie in [-1, {self.num_requests}), got {rows.tolist()}")
        real = rows >= 0
        r0 = rows.clamp(min=0)
        size = torch.where(real, self.nodes_per_request.long()[r0], torch.ones_like(rows))
        if num_nodes is None:
            n = size
        else:
            n = torch.as_tensor(num_nodes, dtype=torch.long).to(dev)
            n = n.expand(Bn).clone() if n.dim() == 0 else n.flatten()
            limit = torch.where(real, size, torch.full_like(size, MAX_NODES))
            if n.shape != (Bn,) or bool(((n < 1) | (n > limit)).any()):
                raise TreeError(f"num_nodes: need 1 <= n <= the request's nodes per row, got {n.tolist()} "
                                f"for sizes {limit.tolist()}")
        if Bn == self.num_requests and bool(real.all()) and torch.equal(rows, torch.arange(Bn, device=dev)) \
                and torch.equal(n, size):  # the whole batch as drafted (the usual step): only the roots change
            return self._with_roots(root_tokens)
        cu = torch.zeros(Bn + 1, dtype=torch.long, device=dev)
        cu[1:] = n.cumsum(0)
        T = int(cu[-1])
        req = torch.repeat_interleave(torch.arange(Bn, device=dev), n, output_size=T)
        local = torch.arange(T, device=dev) - cu[:-1][req]
        isreal = real[req]
        src = torch.where(isreal, self.cu_nodes.long()[r0][req] + local, torch.zeros_like(local))
        kid = (local > 0).long()
        token = torch.where(isreal, self.token_ids[src], torch.full_like(local, -1))
        if root_tokens is not None:
            token[cu[:-1]] = torch.as_tensor(root_tokens, dtype=torch.long).flatten().to(dev)
        parent = torch.where(isreal, self.parent[src].long(), kid - 1)
        depth = torch.where(isreal, self.depth[src].long(), kid)
        width = int(depth.max()) + 1
        path = torch.full((T, width), -1, dtype=torch.long, device=dev)
        w = min(width, self.path.shape[1])
        path[:, :w] = self.path[src, :w].long()
        fake = torch.stack([torch.zeros_like(local), torch.where(local > 0, local, -1)], 1)[:, :width]
        path[:, : fake.shape[1]] = torch.where(isreal[:, None], path[:, : fake.shape[1]], fake)
        words = self.anc_mask.shape[1]
        bits = torch.zeros(T, words, dtype=torch.int64, device=dev)
        bits[:, 0] = 1
        bits[torch.arange(T, device=dev), local // 32] |= torch.where(local > 0, 1 << (local % 32), 0)
        anc = torch.where(isreal[:, None], self.anc_mask[src], int32_words(bits))
        q = None if self.draft_prob is None else torch.where(isreal, self.draft_prob[src], (local == 0).float())
        # placeholders: the root and its first child on the main path, later children branches
        kind = None if self.node_kind is None else torch.where(isreal, self.node_kind[src], (local > 1).long())
        return TreeBatch(token_ids=token, parent=parent.to(torch.int32), depth=depth.to(torch.int32),
                         cu_nodes=cu.to(torch.int32), path=path.to(torch.int32), anc_mask=anc,
                         max_nodes=int(n.max()), draft_prob=q, node_kind=kind)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_parents(
        cls,
        parents: Sequence[Sequence[int]],
        token_ids: Sequence[Sequence[int]] | None = None,
        *,
        max_depth: int | None = None,
        reorder: bool = False,
    ) -> "TreeBatch":
        """Build from per-request local parent arrays (``-1`` for the root).

        ``reorder=False`` requires topological order (``parent[i] < i``, root at 0) and fails
        otherwise. ``reorder=True`` accepts any order, detects cycles, and renumbers nodes in
        breadth-first order (token ids move with their nodes); the root must still be unique.
        ``max_depth`` pads ``path`` to a fixed width (default: the batch's deepest node).
        """
        if len(parents) == 0:
            raise TreeError("parents: empty batch (need at least one request)")
        if token_ids is None:
            token_ids = [[0] * len(p) for p in parents]
        if len(token_ids) != len(parents):
            raise TreeError(f"token_ids: {len(token_ids)} requests but parents has {len(parents)}")
        par, tok = [], []
        for r, (p, t) in enumerate(zip(parents, token_ids)):
            p = torch.as_tensor(list(p), dtype=torch.int64)
            t = torch.as_tensor(list(t), dtype=torch.int64)
            if p.numel() != t.numel():
                raise TreeError(f"token_ids[{r}]: {t.numel()} tokens for {p.numel()} nodes")
            if reorder:
                p, t = _bfs_renumber(p, t, r)
            par.append(p)
            tok.append(t)
        sizes = torch.tensor([p.numel() for p in par], dtype=torch.int64)
        cu = torch.zeros(len(par) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(sizes, 0)
        return cls._build(torch.cat(par), torch.cat(tok), cu, max_depth)

    @classmethod
    def from_flat(
        cls, parent: torch.Tensor, token_ids: torch.Tensor, cu_nodes: torch.Tensor, *, max_depth: int | None = None
    ) -> "TreeBatch":
        """Build from flat tensors (local parents, topological order); validates everything."""
        return cls._build(parent.long().cpu(), token_ids.long().cpu(), cu_nodes.long().cpu(), max_depth)

    @classmethod
    def from_token_paths(
        cls,
        root_tokens: Sequence[int],
        branches: Sequence[Sequence[Sequence[int]]],
        *,
        max_depth: int | None = None,
    ) -> "TreeBatch":
        """Build from per-request lists of draft token sequences, merged into a prefix tree.

        Request ``r`` has root token ``root_tokens[r]`` and draft branches ``branches[r]``
        (each a token sequence continuing the root; shared prefixes become shared nodes; an
        empty list of branches gives a root-only tree). Nodes are numbered in the order
        branches first reach them, which is topological.
        """
        if len(root_tokens) != len(branches):
            raise TreeError(f"branches: {len(branches)} requests but root_tokens has {len(root_tokens)}")
        parents, tokens = [], []
        for root, brs in zip(root_tokens, branches):
            par, tok, child = [-1], [int(root)], {}
            for br in brs:
                node = 0
                for x in br:
                    key = (node, int(x))
                    if key not in child:
                        child[key] = len(par)
                        par.append(node)
                        tok.append(int(x))
                    node = child[key]
            parents.append(par)
            tokens.append(tok)
        return cls.from_parents(parents, tokens, max_depth=max_depth)

    @classmethod
    def _build(cls, parent: torch.Tensor, token_ids: torch.Tensor, cu: torch.Tensor, max_depth: int | None):
        B = cu.numel() - 1
        if B <= 0:
            raise TreeError("cu_nodes: empty batch (need at least one request)")
        sizes = cu[1:] - cu[:-1]
        if cu[0] != 0 or (sizes < 0).any() or cu[-1] != parent.numel():
            raise TreeError(f"cu_nodes: must start at 0, be non-decreasing and end at {parent.numel()}")
        if token_ids.numel() != parent.numel():
            raise TreeError(f"token_ids: {token_ids.numel()} tokens for {parent.numel()} nodes")
        if (sizes == 0).any():
            r = int(torch.nonzero(sizes == 0)[0])
            raise TreeError(f"parents[{r}]: empty tree (every request needs its root node)")
        if (sizes > MAX_NODES).any():
            r = int(torch.nonzero(sizes > MAX_NODES)[0])
            raise TreeError(f"parents[{r}]: {int(sizes[r])} nodes, over the limit of {MAX_NODES}")
        req = torch.repeat_interleave(torch.arange(B), sizes)
        local = torch.arange(parent.numel()) - cu[:-1][req]
        is_root = local == 0
        bad = torch.nonzero(is_root & (parent != -1))
        if bad.numel():
            i = int(bad[0])
            raise TreeError(f"parents[{int(req[i])}][0]: the root must have parent -1, got {int(parent[i])}")
        bad = torch.nonzero(~is_root & ((parent < 0) | (parent >= local)))
        if bad.numel():
            i = int(bad[0])
            raise TreeError(
                f"parents[{int(req[i])}][{int(local[i])}] = {int(parent[i])}: a parent must come before its child "
                f"(0 <= parent < {int(local[i])}); nodes are in topological order with one root at index 0 "
                "(from_parents(..., reorder=True) sorts an unordered tree)"
            )
        # Depth and ancestors by pointer jumping over flat indices: one step per level.
        start = cu[:-1][req]
        pflat = torch.where(parent >= 0, parent + start, torch.full_like(parent, -1))
        depth = torch.zeros_like(parent)
        anc = torch.arange(parent.numel())
        ancestors = [anc]  # ancestors[k][i] = k-th ancestor of i (flat), -1 past the root
        while True:
            nxt = torch.where(anc >= 0, pflat[anc.clamp(min=0)], anc)
            if (nxt < 0).all():
                break
            depth += (nxt >= 0).long()
            ancestors.append(nxt)
            anc = nxt
            if len(ancestors) > MAX_DEPTH + 1:
                break
        dmax = int(depth.max())
        if dmax > MAX_DEPTH:
            i = int(torch.argmax(depth))
            raise TreeError(f"parents[{int(req[i])}]: depth over the limit of {MAX_DEPTH}")
        width = dmax if max_depth is None else int(max_depth)
        if width < dmax or width > MAX_DEPTH:
            raise TreeError(f"max_depth: {width} given, must be in [{dmax}, {MAX_DEPTH}] for this batch")
        # path[i, depth[i] - k] = k-th ancestor of i.
        T = parent.numel()
        path = torch.full((T, width + 1), -1, dtype=torch.int64)
        rows = torch.arange(T)
        for k, a in enumerate(ancestors):
            ok = a >= 0
            path[rows[ok], (depth - k)[ok]] = a[ok] - start[ok]
        # ancestors of a node are distinct, so adding their bits into the words is an OR
        words = (MAX_NODES + 31) // 32
        ok = path >= 0
        packed = torch.zeros(T, words, dtype=torch.int64)
        packed.view(-1).scatter_add_(
            0, (rows[:, None] * words + path // 32)[ok], torch.ones_like(path)[ok] << (path % 32)[ok]
        )
        anc_mask = int32_words(packed)
        return cls(
            token_ids=token_ids.long(),
            parent=parent.to(torch.int32),
            depth=depth.to(torch.int32),
            cu_nodes=cu.to(torch.int32),
            path=path.to(torch.int32),
            anc_mask=anc_mask,
            max_nodes=int(sizes.max()),
        )


def _bfs_renumber(p: torch.Tensor, t: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Renumber one request's nodes in breadth-first order from its unique root."""
    n = p.numel()
    if n == 0:
        raise TreeError(f"parents[{r}]: empty tree (every request needs its root node)")
    roots = torch.nonzero(p == -1).flatten()
    if roots.numel() != 1:
        raise TreeError(f"parents[{r}]: exactly one root (parent -1) is required, found {roots.numel()}")
    if ((p < -1) | (p >= n)).any():
        i = int(torch.nonzero((p < -1) | (p >= n))[0])
        raise TreeError(f"parents[{r}][{i}] = {int(p[i])}: out of range [-1, {n})")
    order = [int(roots[0])]
    frontier = roots
    seen = torch.zeros(n, dtype=torch.bool)
    seen[roots] = True
    while frontier.numel():
        children = torch.nonzero(torch.isin(p, frontier) & ~seen).flatten()
        seen[children] = True
        order += children.tolist()
        frontier = children
    if len(order) != n:
        cyc = torch.nonzero(~seen).flatten().tolist()
        raise TreeError(f"parents[{r}]: nodes {cyc[:8]} are not reachable from the root (cycle)")
    order_t = torch.tensor(order)
    new_index = torch.empty(n, dtype=torch.int64)
    new_index[order_t] = torch.arange(n)
    old_par = p[order_t]
    new_par = torch.where(old_par >= 0, new_index[old_par.clamp(min=0)], old_par)
    return new_par, t[order_t]
