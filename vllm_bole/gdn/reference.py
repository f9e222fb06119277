"""Float64 sequential reference of the GDN tree step (the oracle of ``vllm_bole.gdn``'s kernels).

Each node's state is computed from its parent's state, or from its request's committed state for
the root (local node 0), depth level by depth level: exactly what a sequential run along the
node's own root-to-node path gives. Inputs in any float dtype and device; float64 out.

Conventions (kernels must match them): state per value head ``S [K, V]`` (FLA / vLLM layout
``[B, Hv, K, V]``). Per token: ``S = exp(g) S``; ``S += beta k (v - S^T k)^T``; ``o = scale S^T q``
(the output reads the state *after* the token's own update, as FLA and transformers do). GQA:
value head ``h`` uses key head ``h // (Hv // Hk)``. L2 norm as FLA: ``x / sqrt(sum x^2 + 1e-6)``;
``scale`` defaults to ``K ** -0.5``. ``gdn_gating`` uses ``F.softplus`` (threshold 20, as
transformers, FLA and vLLM do). Per-node states are returned: keep T * Hv * K * V small on CPU.
Siblings: ``csrc_triton/gdn_tree.py`` (kernels), ``vllm_bole/gdn/naive.py`` (torch twin).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_bole.tree_views import depth_levels, start_state

_F64 = torch.float64
L2NORM_EPS = 1e-6


def _l2norm(x: Tensor) -> Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


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
    for idx, par, req in depth_levels(tree, dev):
        S = start_state(states, state0, par, req) * torch.exp(g[idx])[..., None, None]
        kt, qt = k[idx], q[idx]
        delta = beta[idx][..., None] * (v[idx] - torch.einsum("nhkv,nhk->nhv", S, kt))
        S = S + kt[..., :, None] * delta[..., None, :]
        states[idx] = S
        o[idx] = torch.einsum("nhkv,nhk->nhv", S, qt)
    return o, states
