"""Plain-torch twin of the GDN tree kernels (``csrc_triton/gdn_tree.py``): the CPU path of
``vllm_bole.gdn.gdn_tree_step``, in fp32 (fp64 for fp64 states).

The ancestor-masked closed form (``closed_form``) is computed per request on the padded tree,
with one batched triangular solve; the pending path's commit is the same closed form on the
path as a chain. The float64 sequential reference beside it is ``vllm_bole.gdn.reference``.
"""
from __future__ import annotations

import torch

from vllm_bole.pending import live_pending, pending_rows
from vllm_bole.tree_views import padded_tree


def closed_form(S, q, k, v, g, beta, M, scale):
    """The ancestor-masked closed form, batched and padded.

    S [B, H, K, V]; q, k [B, H, N, K] (normalised, GQA-expanded); v [B, H, N, V]; g, beta
    [B, H, N]; M [B, N, N] bool ancestor-or-self mask (padding rows/cols all False, padded
    inputs zero). Returns (o [B, H, N, V], d [B, H, N, V], G [B, H, N]), all in S's dtype.
    """
    M = M[:, None]
    G = torch.where(M, g[..., None, :], 0).sum(-1)
    E = torch.exp(torch.where(M, G[..., :, None] - G[..., None, :], float("-inf")))
    eye = torch.eye(M.shape[-1], dtype=torch.bool, device=M.device)
    A = torch.where(M & ~eye, E * beta[..., :, None] * (k @ k.transpose(-1, -2)), 0)
    U = beta[..., None] * (v - torch.exp(G)[..., None] * (k @ S))
    I = torch.eye(M.shape[-1], dtype=S.dtype, device=S.device)
    d = torch.linalg.solve_triangular(I + A, U, upper=False, unitriangular=True)
    o = scale * (torch.exp(G)[..., None] * (q @ S) + (E * (q @ k.transpose(-1, -2))) @ d)
    return o, d, G


def _prep_qk(x, Hv, use_qk_l2norm, dtype):
    x = x.to(dtype)
    if use_qk_l2norm:
        x = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    return x.repeat_interleave(Hv // x.shape[-2], dim=-2)


def step_torch(q, k, v, g, beta, tree, state, state_idx, pending, scale, use_qk_l2norm, pending_idx):
    Hv = state.shape[1]
    dt = torch.float64 if state.dtype == torch.float64 else torch.float32
    slots = state_idx.long()
    live = live_pending(pending, slots, pending_idx) if pending is not None else None
    if live is not None:
        sl, pr, m, valid = live
        P = valid.shape[1]
        pos = torch.arange(P, device=m.device)
        Mc = (pos[None, :, None] >= pos[None, None, :]) & valid[:, :, None] & valid[:, None, :]
        kp = pending_rows(_prep_qk(pending.k[pr], Hv, use_qk_l2norm, dt), valid, dt)
        vp, gp, bp = (pending_rows(x[pr], valid, dt) for x in (pending.v, pending.g, pending.beta))
        S = state[sl].to(dt)
        _, d, G = closed_form(S, kp, kp, vp, gp, bp, Mc, 1.0)
        last = (m - 1)[:, None, None]
        Gm = G.gather(-1, last.expand(-1, Hv, 1))  # [b, H, 1]
        w = torch.where(valid[:, None, :], torch.exp(Gm - G), 0)
        S = torch.exp(Gm)[..., None] * S + (kp * w[..., None]).transpose(-1, -2) @ d
        state[sl] = S.to(state.dtype)
    if tree is None:
        return None
    pad, valid, M = padded_tree(tree, dt)
    qb, kb = pad(_prep_qk(q, Hv, use_qk_l2norm, dt)), pad(_prep_qk(k, Hv, use_qk_l2norm, dt))
    o, _, _ = closed_form(state[slots].to(dt), qb, kb, pad(v), pad(g), pad(beta), M, scale)
    return o.transpose(1, 2)[valid].to(v.dtype)


def gating_torch(a, b, A_log, dt_bias):
    """Twin of ``csrc_triton.gdn_gating``: (g, beta) [T, Hv] fp32 (see ``vllm_bole.gdn.gdn_gating``)."""
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())
