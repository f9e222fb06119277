"""Float64 sequential oracles: the ground truth for every tree kernel of the project.

Each oracle walks the tree with the plain per-token recurrence: a node's state is computed from
its parent's state, or from its request's committed state for the root (local node 0, the last
committed/bonus token, which the target processes like any other node). Nodes are visited depth
level by depth level, a topological order, so every node gets exactly what a sequential run along
its own root-to-node path gives. Inputs may come in any float dtype and device; everything is
computed in float64 and returned in float64. Trees are ``TreeBatch``es (flat nodes, ``cu_nodes``).

Conventions decided here (kernels must match them):

* GDN (Qwen3-Next). State per value head is ``S [K, V]`` (FLA / vLLM layout ``[B, Hv, K, V]``).
  Per token: ``S = exp(g) S``; ``S += beta k (v - S^T k)^T``; ``o = scale S^T q``, i.e. the output
  reads the state *after* the token's own update (as FLA and transformers do).
  GQA: value head ``h`` uses key head ``h // (Hv // Hk)`` (``repeat_interleave``).
  L2 norm as FLA: ``x / sqrt(sum x^2 + 1e-6)``; ``scale`` defaults to ``K ** -0.5``.
  ``gdn_gating`` uses ``F.softplus`` (threshold 20, as transformers, FLA and vLLM do).
* SSD (Mamba2). State per head is ``h [P, N]`` (vLLM's ``ssm_state`` ``[B, H, P, N]``; also
  transformers' cache layout). ``dt_eff = clamp(softplus(dt + dt_bias), *dt_limit)``: bias,
  then softplus, then clamp, exactly as transformers' ``torch_chunk_scan`` of Mamba2 /
  NemotronH / GraniteMoeHybrid / FalconH1 (the clamp is applied even when ``dt_softplus=False``).
  The default ``dt_limit=(0, inf)`` is what vLLM always passes (it ignores the config's
  ``time_step_limit``); transformers' single-token decode path (``selective_state_update``) never
  clamps, its chunked path clamps with ``time_step_limit``. Pass the limit you want to model.
  ``y = h C + D x`` (the D skip is added, the z gate and the norm are NOT part of the oracle).
  Head ``h`` uses group ``h // (H // G)``.
* Conv. ``conv_state [C, W-1]`` holds the last ``W-1`` pre-conv inputs, oldest first (vLLM);
  ``y_t = act(sum_w weight[:, w] * window[:, w] + bias)`` with ``window = [conv_state, x_t]``, the
  same as a causal ``F.conv1d`` (cross-correlation, no kernel flip). transformers keeps ``W``
  columns in its cache, the oldest of which is never read: ours is its ``[..., 1:]``.
* Attention. Node ``i`` attends to the whole committed prefix of its request plus its
  ancestors-or-self; no causal mask inside the prefix is needed (the prefix precedes every node).

Per-node states are all returned (``[T, Hv, K, V]`` float64 for GDN: keep T * Hv * K * V small
on CPU). Tree helpers: ``chain_tree``, ``random_tree``, ``random_tree_batch`` and the standard test
families ``TREE_SHAPES`` / ``tree_shapes()`` / ``make_tree_shape()`` for kernel tests.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_bole.spec_decode.tree import TreeBatch

__all__ = [
    "gdn_gating",
    "gdn_tree_reference",
    "ssd_tree_reference",
    "conv_tree_reference",
    "attention_tree_reference",
    "chain_tree",
    "random_tree",
    "random_tree_batch",
    "TREE_KINDS",
    "TREE_SHAPES",
    "tree_shapes",
    "make_tree_shape",
]

_F64 = torch.float64
L2NORM_EPS = 1e-6


def _levels(tree: TreeBatch, device):
    """Yield (flat node indices, parent flat indices (-1 = root), request index) per depth level."""
    parent = tree.parent_flat.to(device)
    req = tree.request_index.to(device)
    depth = tree.depth.to(device)
    for d in range(int(depth.max()) + 1 if depth.numel() else 0):
        idx = torch.nonzero(depth == d).flatten()
        yield idx, parent[idx], req[idx]


def _prev(states: Tensor, state0: Tensor, par: Tensor, req: Tensor) -> Tensor:
    """State each node starts from: its parent's (already computed) or the committed one."""
    is_root = (par < 0).view(-1, *([1] * (states.dim() - 1)))
    return torch.where(is_root, state0[req], states[par.clamp(min=0)])


def _l2norm(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


# ---------------------------------------------------------------------------------------- GDN
def gdn_gating(a, b, A_log, dt_bias) -> tuple[Tensor, Tensor]:
    """Qwen3-Next gating: g = -exp(A_log) * softplus(a + dt_bias) (log decay), beta = sigmoid(b).
    a, b: [T, Hv]; A_log, dt_bias: [Hv]. float64 out."""
    a, b, A_log, dt_bias = (t.to(_F64) for t in (a, b, A_log, dt_bias))
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    return g, torch.sigmoid(b)


def gdn_tree_reference(tree, q, k, v, g, beta, state0, *, scale=None, use_qk_l2norm=True):
    """Gated DeltaNet over a tree batch.

    q, k: [T, Hk, K]; v: [T, Hv, V]; g (log decay), beta: [T, Hv]; state0: [B, Hv, K, V]
    (committed state per request, FLA layout). Value head h uses key head h // (Hv // Hk).
    Per token: S = exp(g) S ; S = S + beta k (v - S^T k)^T ; o = scale S^T q.
    Returns (o [T, Hv, V], states [T, Hv, K, V]) float64; states[i] = state right after node i.
    """
    T, Hk, K = q.shape
    Hv, V = v.shape[1:]
    assert k.shape == (T, Hk, K) and v.shape[0] == T and Hv % Hk == 0, "q/k/v shapes"
    assert g.shape == (T, Hv) and beta.shape == (T, Hv), "g/beta must be [T, Hv]"
    assert state0.shape == (tree.num_requests, Hv, K, V), f"state0 must be [B, Hv, K, V], got {tuple(state0.shape)}"
    assert tree.num_nodes == T, "tree and inputs disagree on T"
    dev = q.device
    q, k, v, g, beta, state0 = (t.to(_F64) for t in (q, k, v, g, beta, state0))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (K**-0.5 if scale is None else scale)
    q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)  # [T, Hv, K]
    o = torch.zeros(T, Hv, V, dtype=_F64, device=dev)
    states = torch.zeros(T, Hv, K, V, dtype=_F64, device=dev)
    for idx, par, req in _levels(tree, dev):
        S = _prev(states, state0, par, req) * torch.exp(g[idx])[..., None, None]
        kt, qt = k[idx], q[idx]
        delta = beta[idx][..., None] * (v[idx] - torch.einsum("nhkv,nhk->nhv", S, kt))
        S = S + kt[..., :, None] * delta[..., None, :]
        states[idx] = S
        o[idx] = torch.einsum("nhkv,nhk->nhv", S, qt)
    return o, states


# ---------------------------------------------------------------------------------------- SSD
def ssd_tree_reference(
    tree, x, dt, A, B, C, state0, *, D=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, float("inf"))
):
    """Mamba2 / SSD over a tree batch.

    x: [T, H, P]; dt: [T, H] raw; A: [H] (negative); B, C: [T, G, N], head h uses group
    h // (H // G); D, dt_bias: [H] or None; state0: [B, H, P, N] (vLLM mamba2 ssm_state layout).
    dt_eff = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)
    h = exp(dt_eff A) h + dt_eff x B^T ; y = h C + D x.
    Returns (y [T, H, P], states [T, H, P, N]) float64; states[i] = state right after node i.
    """
    T, H, P = x.shape
    G, N = B.shape[1:]
    assert dt.shape == (T, H) and A.shape == (H,), "dt must be [T, H], A [H]"
    assert B.shape == (T, G, N) and C.shape == (T, G, N) and H % G == 0, "B/C must be [T, G, N], H % G == 0"
    assert state0.shape == (tree.num_requests, H, P, N), f"state0 must be [B, H, P, N], got {tuple(state0.shape)}"
    assert tree.num_nodes == T, "tree and inputs disagree on T"
    dev = x.device
    x, dt, A, B, C, state0 = (t.to(_F64) for t in (x, dt, A, B, C, state0))
    if dt_bias is not None:
        dt = dt + dt_bias.to(_F64)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    B, C = B.repeat_interleave(H // G, dim=1), C.repeat_interleave(H // G, dim=1)  # [T, H, N]
    y = torch.zeros(T, H, P, dtype=_F64, device=dev)
    states = torch.zeros(T, H, P, N, dtype=_F64, device=dev)
    for idx, par, req in _levels(tree, dev):
        dtn = dt[idx][..., None, None]
        h = torch.exp(dtn * A[:, None, None]) * _prev(states, state0, par, req)
        h = h + dtn * x[idx][..., :, None] * B[idx][..., None, :]
        states[idx] = h
        y[idx] = torch.einsum("nhpk,nhk->nhp", h, C[idx])
    if D is not None:
        y = y + D.to(_F64)[:, None] * x
    return y, states


# --------------------------------------------------------------------------------------- conv
def conv_tree_reference(tree, x, weight, conv_state0, *, bias=None, activation="silu"):
    """Depthwise causal conv1d of width W over a tree batch.

    x: [T, C] pre-conv inputs; weight: [C, W]; bias: [C] or None; conv_state0: [B, C, W-1] (the
    last W-1 committed inputs of each request, oldest first, vLLM's conv_state layout).
    The window of node i is its own input and those of its W-1 nearest ancestors, topped up from
    conv_state0 where the path is shorter. activation: "silu" or None.
    Returns (y [T, C], conv_states [T, C, W-1]) float64; conv_states[i] = last W-1 inputs up to i.
    """
    T, Cdim = x.shape
    W = weight.shape[-1]
    weight = weight.reshape(Cdim, W)
    assert conv_state0.shape == (tree.num_requests, Cdim, W - 1), (
        f"conv_state0 must be [B, C, W-1] = {(tree.num_requests, Cdim, W - 1)}, got {tuple(conv_state0.shape)}"
    )
    assert activation in ("silu", None), f"activation {activation!r} not in ('silu', None)"
    assert tree.num_nodes == T, "tree and inputs disagree on T"
    dev = x.device
    x, weight, conv_state0 = x.to(_F64), weight.to(_F64), conv_state0.to(_F64)
    y = torch.zeros(T, Cdim, dtype=_F64, device=dev)
    conv_states = torch.zeros(T, Cdim, W - 1, dtype=_F64, device=dev)
    for idx, par, req in _levels(tree, dev):
        window = torch.cat([_prev(conv_states, conv_state0, par, req), x[idx][..., None]], dim=-1)  # [n, C, W]
        conv_states[idx] = window[..., 1:]
        y[idx] = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias.to(_F64)
    if activation == "silu":
        y = F.silu(y)
    return y, conv_states


# ---------------------------------------------------------------------------------- attention
def attention_tree_reference(tree, q, k, v, k_prefix, v_prefix, *, scale=None):
    """Full attention of the tree nodes.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (the nodes' own K/V, RoPE already applied); k_prefix,
    v_prefix: lists of B tensors [L_b, Hkv, D] (committed prefix per request, may be empty).
    Node i attends to its request's whole prefix plus its ancestors-or-self. Query head h uses
    kv head h // (Hq // Hkv); scale defaults to D ** -0.5. Returns o [T, Hq, D] float64.
    """
    T, Hq, Dh = q.shape
    Hkv = k.shape[1]
    assert Hq % Hkv == 0 and k.shape == v.shape == (T, Hkv, Dh), "k/v must be [T, Hkv, D], Hq % Hkv == 0"
    assert len(k_prefix) == len(v_prefix) == tree.num_requests, "one prefix per request"
    scale = Dh**-0.5 if scale is None else scale
    q, k, v = q.to(_F64), k.to(_F64), v.to(_F64)
    o = torch.zeros(T, Hq, Dh, dtype=_F64, device=q.device)
    cu = tree.cu_nodes.tolist()
    path = tree.path.long().to(q.device)
    depth = tree.depth.long().to(q.device)
    for r in range(tree.num_requests):
        s, e = cu[r], cu[r + 1]
        n, L = e - s, k_prefix[r].shape[0]
        # anc[i, j]: local j is an ancestor-or-self of local i  <=>  path[i, depth[j]] == j
        j = torch.arange(n, device=q.device)
        anc = path[s:e][:, depth[s:e]] == j[None, :]
        keys = torch.cat([k_prefix[r].to(q.device, _F64), k[s:e]]).repeat_interleave(Hq // Hkv, dim=1)
        vals = torch.cat([v_prefix[r].to(q.device, _F64), v[s:e]]).repeat_interleave(Hq // Hkv, dim=1)
        mask = torch.cat([torch.ones(n, L, dtype=torch.bool, device=q.device), anc], dim=1)  # [n, L + n]
        scores = torch.einsum("ihd,jhd->hij", q[s:e], keys) * scale
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o[s:e] = torch.einsum("hij,jhd->ihd", p, vals)
    return o


# -------------------------------------------------------------------------------- tree builders
TREE_KINDS = ("random", "chain", "star", "deep", "wide")


def random_accepted_paths(tree: TreeBatch, width: int, generator=None) -> tuple[Tensor, Tensor]:
    """A random root-to-node path per request, as verification reports it: ``accepted``
    ``[B, width]`` int64 local indices, root first, -1 padded, and ``last`` ``[B]`` the flat index
    of each path's last node."""
    B = tree.num_requests
    accepted = torch.full((B, width), -1, dtype=torch.int64)
    last = torch.empty(B, dtype=torch.int64)
    for r in range(B):
        node = _randint(int(tree.nodes_per_request[r]), generator)
        path = tree.root_path(r, node)
        accepted[r, : len(path)] = torch.tensor(path)
        last[r] = int(tree.cu_nodes[r]) + node
    return accepted, last


def strided(t: Tensor) -> Tensor:
    """A non-contiguous view holding ``t``'s values (rows padded in memory), as the slices of a fused
    projection that vLLM hands to the layers."""
    wide = torch.cat([t, torch.full_like(t, float("nan"))], dim=-1)
    return wide[..., : t.shape[-1]]


def chain_tree(n: int, batch: int = 1) -> TreeBatch:
    """``batch`` requests, each a chain of ``n`` nodes (root included); token ids are 0."""
    return TreeBatch.from_parents([list(range(-1, n - 1))] * batch)


def _randint(high: int, generator) -> int:
    return int(torch.randint(high, (1,), generator=generator))


def random_tree(num_nodes: int, *, max_depth=None, kind="random", generator=None) -> list[int]:
    """Parent array (topological, root 0 with parent -1) of one request's tree of ``num_nodes``.

    kind: "random" (uniform random recursive tree), "chain", "star" (all children of the root),
    "deep" (a spine to ``max_depth`` — ``num_nodes // 2`` by default — plus random branches),
    "wide" (depth <= 2, many siblings). ``max_depth`` caps every kind (chain/star fail if they
    cannot fit).
    """
    if kind not in TREE_KINDS:
        raise ValueError(f"kind {kind!r} not in {TREE_KINDS}")
    if num_nodes < 1:
        raise ValueError("num_nodes must be >= 1 (the root)")
    cap = num_nodes if max_depth is None else int(max_depth)
    if num_nodes > 1 and cap < 1 or kind == "chain" and num_nodes - 1 > cap:
        raise ValueError(f"a {kind} tree of {num_nodes} nodes does not fit max_depth={max_depth}")
    spine = min(num_nodes - 1, cap if max_depth is not None else num_nodes // 2)
    parents, depth = [-1], [0]
    for i in range(1, num_nodes):
        if kind == "chain" or (kind == "deep" and i <= spine):
            p = i - 1
        elif kind == "star":
            p = 0
        else:
            limit = min(cap, 2) if kind == "wide" else cap
            cand = [j for j in range(i) if depth[j] < limit]
            p = cand[_randint(len(cand), generator)]
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def random_tree_batch(
    sizes: list[int], *, kind="random", generator=None, token_vocab=None, max_depth=None
) -> TreeBatch:
    """A ragged batch with one ``random_tree`` per entry of ``sizes``.

    ``kind`` is one kind for all requests or a sequence with one kind per request. Token ids are
    0 unless ``token_vocab`` is given: then roots and nodes get random ids in [0, token_vocab),
    distinct among siblings (as a draft tree's children are). ``max_depth`` caps every tree.
    """
    kinds = [kind] * len(sizes) if isinstance(kind, str) else list(kind)
    if len(kinds) != len(sizes):
        raise ValueError(f"{len(kinds)} kinds for {len(sizes)} requests")
    parents = [random_tree(n, max_depth=max_depth, kind=kd, generator=generator) for n, kd in zip(sizes, kinds)]
    tokens = None
    if token_vocab is not None:
        tokens = []
        for par in parents:
            tok = [0] * len(par)
            tok[0] = _randint(token_vocab, generator)
            for p in range(len(par)):
                kids = [i for i in range(len(par)) if par[i] == p]
                if len(kids) > token_vocab:
                    raise ValueError(f"token_vocab={token_vocab} < {len(kids)} siblings")
                for i, t in zip(kids, torch.randperm(token_vocab, generator=generator)[: len(kids)].tolist()):
                    tok[i] = t
            tokens.append(tok)
    return TreeBatch.from_parents(parents, tokens)


# The standard tree families for kernel tests: name -> random_tree_batch arguments.
TREE_SHAPES: dict[str, dict] = {
    "root_only": dict(sizes=[1, 1], kind="chain"),
    "chain": dict(sizes=[9], kind="chain"),
    "chains_batch": dict(sizes=[5, 1, 12], kind="chain"),
    "star": dict(sizes=[17], kind="star"),
    "deep16": dict(sizes=[40], kind="deep", max_depth=16),
    "wide": dict(sizes=[48], kind="wide"),
    "random": dict(sizes=[24], kind="random"),
    "ragged": dict(sizes=[1, 20, 1, 7, 33], kind=["chain", "random", "star", "deep", "wide"]),
}


def tree_shapes() -> list[str]:
    """Names of the standard tree families (for ``pytest.mark.parametrize``)."""
    return list(TREE_SHAPES)


def make_tree_shape(name: str, seed: int = 0, *, token_vocab=None) -> TreeBatch:
    """Build the standard family ``name`` deterministically from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return random_tree_batch(**TREE_SHAPES[name], generator=gen, token_vocab=token_vocab)
