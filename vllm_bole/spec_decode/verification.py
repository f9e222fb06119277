"""Lossless verification of draft trees from the target's logits at every node.

Input: a :class:`TreeBatch` and ``target_logits`` ``[T, V]``, one row
per flat node, root included: row ``i`` is the target's next-token distribution after the path
root..i. Output (:class:`VerificationResult`, vLLM style, padded with -1):

* ``output_token_ids [B, L + 1]``: accepted draft tokens, then one bonus/correction token;
* ``num_emitted [B]`` (= accepted draft tokens + 1);
* ``accepted_nodes [B, L + 1]``: local indices of the accepted path, root first
  (``num_emitted`` entries valid; the last one is where the recurrent state is committed);
* ``last_node [B]``: flat index of the deepest accepted node.

``L = tree.max_depth``. The runtime (vLLM adapter) uses :func:`verify_greedy` and
:func:`verify_deterministic` on best-first trees; ``vllm_bole.spec_decode.offline.verify``
dispatches an offline ``DraftTree`` to the scheme its children need.

Modes
-----
* ``greedy``: descend into the child whose token is ``argmax`` of the target at the current node
  (the first such child if siblings repeat a token); stop when none matches and emit the argmax.
  Equal to plain greedy decoding by construction. Fully vectorised without any loop: a node is
  on the accepted path iff every node of its path matches (via ``TreeBatch.path``), and the
  accepted leaf is the deepest such node.
* ``deterministic`` (children chosen without randomness, e.g. top-k / best-first / static
  trees): sample ``x ~ p`` at the current node; descend if ``x`` is a child's token, otherwise emit
  ``x`` and stop. The emitted token at every level is exactly a target sample given the path so
  far, so the output is target-distributed whatever the tree. Every node's sample is drawn up front
  (its own uniform), then the walk is greedy's with samples for argmaxes: no loop.
* ``specinfer`` (:func:`verify_rejection` with ``replacement=True``: children drawn i.i.d. from
  the draft ``q``, e.g. by the offline ``build_sampled``): multi-draft recursive rejection
  sampling. Children are tried in local-index (= draw) order; child ``x`` is accepted with probability ``min(1, p(x) / q(x))``;
  on rejection ``p <- normalise(max(p - q, 0))`` (the residual); if every child is rejected the
  bonus token is drawn from the final residual.
* ``sequoia`` (``replacement=False``: children drawn *without replacement* from ``q``): as above, but the draft
  distribution of draw ``j`` is ``q_j`` = ``q`` with the earlier draws removed and renormalised, so
  after rejecting ``x_j``: ``p <- normalise(max(p - q_j, 0))`` then ``q_{j+1} <- normalise(q_j with
  x_j removed)``. Each step is a valid rejection step for the current target (``x_j ~ q_j``
  given the history), hence lossless by induction.

Target distribution ``p``: vLLM ``SamplingParams`` semantics per request (temperature, min-p,
top-k, top-p; :func:`vllm_bole.spec_decode.sampling.target_probs`).

Randomness: every node owns two uniforms, ``u_accept`` (used when the node is tested as a child)
and ``u_sample`` (used when a token is sampled at the node), drawn from ``generator``: ``None``
(global RNG), an ``int`` seed, a ``torch.Generator`` (one batched draw), or a per-request
sequence of those (``None`` entries use the global RNG). With per-request generators a request
consumes exactly ``2 * nodes`` uniforms from its own generator, so its result does not depend on
the rest of the batch. Tokens are drawn by inverse CDF (one uniform each).

Rejection sampling loops over depth levels (at most ``L + 1``, with an early exit once every
request has stopped: one host sync per level) and is sequential over siblings by nature (each residual
depends on the previous rejection), so it loops over sibling positions, vectorised over
requests, updating only the rows that just rejected. Only the ``<= B`` rows visited at a level
are softmaxed/sorted, never all ``T`` rows (``[T, V]`` sorts would not fit for large vocabularies).
Greedy needs one ``argmax`` over ``[T, V]``, the deterministic mode a sample per node (rows in chunks), and
neither loops over levels.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from vllm_bole.dispatch import use_triton
from vllm_bole.spec_decode.sampling import SAMPLING_EPS, per_row, sample_logits, sample_rows, target_probs
from vllm_bole.spec_decode.tree import TreeBatch
from vllm_bole.transfer import download_async

__all__ = [
    "SAMPLING_EPS",
    "Generators",
    "VerificationResult",
    "verify_deterministic",
    "verify_greedy",
    "verify_rejection",
]

GeneratorLike = Union[None, int, torch.Generator]
Generators = Union[GeneratorLike, Sequence[GeneratorLike]]


@dataclass(frozen=True)
class VerificationResult:
    output_token_ids: torch.Tensor  # [B, L + 1] int64, -1 padded
    num_emitted: torch.Tensor  # [B] int64
    accepted_nodes: torch.Tensor  # [B, L + 1] int64 local indices, root first, -1 padded
    last_node: torch.Tensor  # [B] int64 flat index of the deepest accepted node

    @property
    def num_accepted(self) -> torch.Tensor:
        """[B] accepted draft tokens (root excluded)."""
        return self.num_emitted - 1

    @functools.cached_property
    def accepted_i32(self) -> torch.Tensor:
        """``accepted_nodes`` as int32, as the commit kernels read it: converted once per step, not per layer."""
        return self.accepted_nodes.to(torch.int32)

    def to(self, device) -> "VerificationResult":
        """On ``device``, in ONE copy (packed: a device-to-host copy is a stream sync each)."""
        if self.output_token_ids.device == torch.device(device):
            return self
        return self._unpacked(self._packed().to(device))

    def to_host_async(self) -> Callable[[], "VerificationResult"]:
        """The result on the host, copied behind the work queued so far without waiting for it (CUDA: into
        pinned memory, one copy): the callable waits for that copy only, not for work queued after it."""
        if self.output_token_ids.device.type != "cuda":
            return lambda: self
        get = download_async(self._packed())
        return lambda: self._unpacked(get())

    def _packed(self) -> torch.Tensor:
        return torch.cat([self.output_token_ids, self.num_emitted[:, None], self.accepted_nodes,
                          self.last_node[:, None]], 1)

    def _unpacked(self, packed: torch.Tensor) -> "VerificationResult":
        W = self.output_token_ids.shape[1]
        return VerificationResult(packed[:, :W], packed[:, W], packed[:, W + 1: 2 * W + 1], packed[:, 2 * W + 1])

    def tokens(self, r: int) -> list[int]:
        return self.output_token_ids[r, : int(self.num_emitted[r])].tolist()


# --------------------------------------------------------------------------------- utilities
def _make_gen(g: GeneratorLike) -> torch.Generator | None:
    if g is None or isinstance(g, torch.Generator):
        return g
    if isinstance(g, int):
        return torch.Generator().manual_seed(int(g))
    raise TypeError(f"generator: expected None, an int seed or a torch.Generator, got {type(g).__name__}")


def _node_uniforms(tree: TreeBatch, generator: Generators, n: int, device) -> torch.Tensor:
    """``[T, n]`` float32 uniforms in [0, 1), per-request streams when ``generator`` is a list."""
    T = tree.num_nodes
    if generator is None or isinstance(generator, (int, torch.Generator)):
        g = _make_gen(generator)
        if g is None:
            return torch.rand(T, n, device=device)
        return torch.rand(T, n, generator=g, device=g.device).to(device)
    gens = list(generator)
    B = tree.num_requests
    if len(gens) != B:
        raise ValueError(f"generator: {len(gens)} per-request generators for {B} requests")
    u = torch.rand(T, n, device=device)
    if all(g is None for g in gens):  # no seeded request: no per-request loop, no read of the tree's offsets
        return u
    cu = tree.cu_nodes.tolist()
    for r, g in enumerate(gens):  # per-request streams, like vLLM's seeded requests
        g = _make_gen(g)
        if g is not None:
            u[cu[r] : cu[r + 1]] = torch.rand(cu[r + 1] - cu[r], n, generator=g, device=g.device).to(device)
    return u


def _children_table(tree: TreeBatch, device) -> torch.Tensor:
    """``[T, C]`` flat indices of each node's children in increasing index order, -1 padded."""
    T = tree.num_nodes
    pf = tree.parent_flat.to(device)
    kids = (pf >= 0).nonzero().flatten()
    par = pf[kids]
    if par.numel() > 1 and not bool((par[1:] >= par[:-1]).all()):  # builders emit BFS order: no sort
        order = torch.sort(par, stable=True).indices
        kids, par = kids[order], par[order]
    counts = torch.bincount(par, minlength=T)
    C = max(int(counts.max()) if T else 0, 1)
    start = counts.cumsum(0) - counts
    pos = torch.arange(kids.numel(), device=device) - start[par]
    table = torch.full((T, C), -1, dtype=torch.long, device=device)
    table[par, pos] = kids
    return table


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalise(max(p - q, 0))`` per row; rows with no residual mass keep ``p`` (a rejection
    there has probability 0)."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=1e-30), p)


def _remove_token(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``q`` with token ``x`` (per row) removed and renormalised (zero rows stay zero)."""
    q = q.scatter(1, x[:, None], 0.0)
    s = q.sum(-1, keepdim=True)
    return torch.where(s > 0, q / s.clamp(min=1e-30), q)


def _result_from_leaf(tree: TreeBatch, leaf: torch.Tensor, bonus: torch.Tensor) -> VerificationResult:
    """Assemble the result from the accepted leaf (flat) and the token emitted there."""
    dev = leaf.device
    L = tree.max_depth
    cu = tree.cu_nodes.long().to(dev)
    path = tree.path.long().to(dev)[leaf]  # [B, L + 1] local, -1 padded
    m = tree.depth.long().to(dev)[leaf]  # accepted draft tokens
    start = cu[:-1, None]
    pflat = torch.where(path >= 0, path + start, torch.full_like(path, -1))
    tok = tree.token_ids.to(dev)[pflat.clamp(min=0)]
    out = torch.full_like(path, -1)
    out[:, :L] = torch.where(pflat[:, 1:] >= 0, tok[:, 1:], out[:, :L])
    out.scatter_(1, m[:, None], bonus[:, None])
    return VerificationResult(output_token_ids=out, num_emitted=m + 1, accepted_nodes=path, last_node=leaf)


# ------------------------------------------------------------------------------------ greedy
def _descend_by_choice(tree: TreeBatch, choice: torch.Tensor) -> VerificationResult:
    """Accepted path when the target's pick at every node is known in advance (``choice [T]``):
    follow, from the root, the first child whose token equals the parent's choice."""
    dev = choice.device
    T = tree.num_nodes
    B = tree.num_requests
    idx = torch.arange(T, device=dev)
    pf = tree.parent_flat.to(dev)
    tok = tree.token_ids.to(dev)
    nonroot = pf >= 0
    match = nonroot & (tok == choice[pf.clamp(min=0)])
    first = torch.full((T,), T, dtype=torch.long, device=dev)  # no boolean indexing: no device sync
    first.scatter_reduce_(0, pf.clamp(min=0), torch.where(match, idx, T), reduce="amin")
    good = ~nonroot | (match & (first[pf.clamp(min=0)] == idx))
    path = tree.path_flat.to(dev)
    on_path = torch.where(path >= 0, good[path.clamp(min=0)], torch.ones_like(path, dtype=torch.bool)).all(1)
    depth = tree.depth.long().to(dev)
    req = tree.request_index.to(dev)
    key = torch.where(on_path, depth, torch.full_like(depth, -1))
    best = torch.full((B,), -1, dtype=torch.long, device=dev).scatter_reduce_(0, req, key, reduce="amax")
    is_leaf = on_path & (depth == best[req])  # one node per request
    leaf = torch.zeros(B, dtype=torch.long, device=dev).scatter_reduce_(0, req, torch.where(is_leaf, idx, 0),
                                                                        reduce="amax")
    return _result_from_leaf(tree, leaf, choice[leaf])


def verify_greedy(tree: TreeBatch, target_logits: torch.Tensor, *, kernels: str = "auto") -> VerificationResult:
    """Greedy verification (equals plain greedy decoding), no host sync: one Triton launch
    (``csrc_triton.greedy_walk``) or its torch twin (:func:`_descend_by_choice`)."""
    _check_logits(tree, target_logits)
    return _descend(tree, target_logits.argmax(-1), kernels)


def _descend(tree: TreeBatch, choice: torch.Tensor, kernels: str) -> VerificationResult:
    if use_triton(kernels, choice):
        from csrc_triton.greedy_walk import greedy_walk

        return VerificationResult(*greedy_walk(tree, choice))
    return _descend_by_choice(tree, choice)


# -------------------------------------------------------------------------------- stochastic
def _check_logits(tree: TreeBatch, logits: torch.Tensor):
    if logits.dim() != 2 or logits.shape[0] != tree.num_nodes:
        raise ValueError(f"target_logits: expected [T={tree.num_nodes}, V], got {tuple(logits.shape)}")


def _walk(tree: TreeBatch, logits: torch.Tensor, temperature, top_k, top_p, min_p, decide) -> VerificationResult:
    """Level loop shared by the stochastic modes. ``decide(A, nodes, kids, p)`` returns, for the
    active requests ``A`` at flat ``nodes`` with children ``kids [A, C]`` and target
    distribution ``p [A, V]``, the accepted child (flat, -1: stop) and the emitted token."""
    _check_logits(tree, logits)
    dev = logits.device
    B, L = tree.num_requests, tree.max_depth
    temp = per_row(temperature, B, torch.float32, dev)
    tk = per_row(top_k, B, torch.long, dev)
    tp = per_row(top_p, B, torch.float32, dev)
    mp = per_row(min_p, B, torch.float32, dev)
    cu = tree.cu_nodes.long().to(dev)
    children = _children_table(tree, dev)
    cur = cu[:-1].clone()
    active = torch.ones(B, dtype=torch.bool, device=dev)
    out = torch.full((B, L + 1), -1, dtype=torch.long, device=dev)
    acc = torch.full((B, L + 1), -1, dtype=torch.long, device=dev)
    acc[:, 0] = 0
    nemit = torch.zeros(B, dtype=torch.long, device=dev)
    for d in range(L + 1):
        A = active.nonzero().flatten()
        if A.numel() == 0:
            break
        nodes = cur[A]
        p = target_probs(logits[nodes], temp[A], None if tk is None else tk[A], None if tp is None else tp[A],
                         None if mp is None else mp[A])
        child, tok = decide(A, nodes, children[nodes], p)
        out[A, d] = tok
        has = child >= 0
        if d < L:  # no node below the max depth has children
            Ah = A[has]
            cur[Ah] = child[has]
            acc[Ah, d + 1] = child[has] - cu[Ah]
        An = A[~has]
        active[An] = False
        nemit[An] = d + 1
    return VerificationResult(output_token_ids=out, num_emitted=nemit, accepted_nodes=acc, last_node=cur)


def verify_deterministic(tree: TreeBatch, target_logits: torch.Tensor, *, temperature, top_k=None, top_p=None,
                         min_p=None, generator: Generators = None, kernels: str = "auto") -> VerificationResult:
    """Stochastic verification of a tree whose children were chosen deterministically: sample
    ``x ~ p`` at the current node, descend if a child carries ``x``, else emit ``x`` and stop.

    No level loop: every node's sample is drawn up front with that node's own uniform (what a walk from the
    root draws there when it gets there; :func:`~vllm_bole.spec_decode.sampling.sample_logits`: one Triton
    launch over all rows without top-k, top-p or min-p, else the torch form in row chunks), then the walk
    follows the first child carrying its parent's sample, as greedy follows the argmax (:func:`_descend`, no
    host sync). Decision: the level loop (one host sync and ~15 launches per depth) cost 3.5 ms a tree step at
    c = 1 on the H100 (f428370 matrix, temperature 1) against 0.4 ms for greedy's one launch; the loop-free
    torch form took 0.26-0.52 ms where the loop took 1.9-5.2 ms at 8-32 requests, but 2.0-4.0 ms at 128 (~10
    passes over ``[T, V]``; ``sampled_verify.json``), hence the kernel."""
    _check_logits(tree, target_logits)
    dev = target_logits.device
    u = _node_uniforms(tree, generator, 2, dev)[:, 1]
    req = tree.request_index.long().to(dev)

    def node_rows(x, dtype):  # a per-request parameter per node
        return None if x is None else per_row(x, tree.num_requests, dtype, dev)[req]

    choice = sample_logits(target_logits, node_rows(1.0 if temperature is None else temperature, torch.float32), u,
                           node_rows(top_k, torch.long), node_rows(top_p, torch.float32),
                           node_rows(min_p, torch.float32), kernels=kernels)
    return _descend(tree, choice, kernels)


def verify_rejection(
    tree: TreeBatch,
    target_logits: torch.Tensor,
    child_dist_table: torch.Tensor,
    child_dist_index: torch.Tensor,
    *,
    replacement: bool,
    temperature,
    top_k=None, top_p=None, min_p=None, generator: Generators = None,
) -> VerificationResult:
    """Recursive rejection sampling over sampled children: SpecInfer (``replacement=True``,
    children i.i.d. from ``q``) or Sequoia (``replacement=False``, children drawn without
    replacement from ``q`` in local-index order). ``child_dist_table[child_dist_index[i]]`` is the
    draft distribution node ``i``'s children were drawn from (normalised here)."""
    dev = target_logits.device
    uu = _node_uniforms(tree, generator, 2, dev)
    u_acc, u_smp = uu[:, 0], uu[:, 1]
    tokens = tree.token_ids.to(dev)
    dist_index = child_dist_index.long().to(dev)
    table = child_dist_table.to(dev)

    def decide(A, nodes, kids, p):
        nk = (kids >= 0).sum(1)
        qi = dist_index[nodes]
        if bool(((nk > 0) & (qi < 0)).any()):
            raise ValueError("child_dist_index: a node with children has no draft distribution (-1)")
        q = table[qi.clamp(min=0)].float()
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-30)
        p = p.clone()
        child = torch.full_like(nodes, -1)
        for j in range(int(nk.max())):
            kid = kids[:, j]
            test = (kid >= 0) & (child < 0)
            if not bool(test.any()):
                break
            kc = kid.clamp(min=0)
            x = tokens[kc]
            px = p.gather(1, x[:, None])[:, 0]
            qx = q.gather(1, x[:, None])[:, 0]
            ok = test & (u_acc[kc] * qx < px)
            child = torch.where(ok, kid, child)
            rej = (test & ~ok).nonzero().flatten()
            if rej.numel():
                pr, qr = p[rej], q[rej]
                p[rej] = _residual(pr, qr)
                if not replacement:
                    q[rej] = _remove_token(qr, x[rej])
        tok = tokens[child.clamp(min=0)]
        none = (child < 0).nonzero().flatten()
        if none.numel():
            tok[none] = sample_rows(p[none], u_smp[nodes[none]])
        return child, tok

    return _walk(tree, target_logits, temperature, top_k, top_p, min_p, decide)

