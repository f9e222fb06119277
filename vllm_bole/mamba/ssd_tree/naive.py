"""Plain-torch twin of the SSD tree kernel (``csrc_triton/ssd_tree.py``): the CPU path of
``vllm_bole.mamba.ssd_tree.ssd_tree_step``, in fp32 (fp64 for fp64 states): the pending path's
commit, then the tree's closed form per request on the padded tree. The float64 sequential
reference beside it is ``vllm_bole.mamba.ssd_tree.reference``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.pending import live_pending, pending_rows
from vllm_bole.tree_views import padded_tree

INF = float("inf")


def dt_effective(dt, dt_bias, dt_softplus, dt_limit, dtype):
    """clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit) in ``dtype``."""
    d = dt.to(dtype)
    if dt_bias is not None:
        d = d + dt_bias.to(dtype)
    if dt_softplus:
        d = F.softplus(d)
    return d.clamp(min=dt_limit[0], max=dt_limit[1])


def step_torch(x, dt, A, B, C, tree, state, state_idx, pending, D, dt_bias, dt_softplus, dt_limit, pending_idx):
    H = state.shape[1]
    ft = torch.float64 if state.dtype == torch.float64 else torch.float32
    A = A.to(ft)[None, :, None]  # [1, H, 1]
    slots = state_idx.long()
    heads = lambda t: t.repeat_interleave(H // t.shape[-2], dim=-2)  # noqa: E731  groups -> heads
    live = live_pending(pending, slots, pending_idx) if pending is not None else None
    if live is not None:
        sl, pr, m, valid = live
        xp = pending_rows(pending.x[pr], valid, ft)  # [b, H, L, P]
        dtp = pending_rows(dt_effective(pending.dt[pr], dt_bias, dt_softplus, dt_limit, ft), valid, ft)  # [b, H, L]
        Bp = pending_rows(heads(pending.B[pr].to(ft)), valid, ft)  # [b, H, L, N]
        Gp = torch.cumsum(dtp * A, -1)
        Gm = Gp.gather(-1, (m - 1)[:, None, None].expand(-1, H, 1))  # [b, H, 1]
        w = torch.where(valid[:, None, :], torch.exp(Gm - Gp) * dtp, 0)
        S = state[sl].to(ft)  # [b, H, P, N]
        S = torch.exp(Gm)[..., None] * S + (xp * w[..., None]).transpose(-1, -2) @ Bp
        state[sl] = S.to(state.dtype)
    if tree is None:
        return None
    pad, valid, M = padded_tree(tree, ft)
    X = pad(x)  # [B, H, n, P]
    dtt = pad(dt_effective(dt, dt_bias, dt_softplus, dt_limit, ft))  # [B, H, n]
    Bt, Ct = pad(heads(B.to(ft))), pad(heads(C.to(ft)))  # [B, H, n, N]
    Mh = M[:, None]
    Gt = torch.where(Mh, (dtt * A)[..., None, :], 0).sum(-1)  # [B, H, n]
    decay = torch.exp(torch.where(Mh, Gt[..., :, None] - Gt[..., None, :], -INF))
    W = decay * (Ct @ Bt.transpose(-1, -2)) * dtt[..., None, :]
    S0 = state[slots].to(ft)  # [B, H, P, N]
    y = torch.exp(Gt)[..., None] * (Ct @ S0.transpose(-1, -2)) + W @ X
    if D is not None:
        y = y + D.to(ft)[None, :, None, None] * X
    return y.transpose(1, 2)[valid].to(x.dtype)
