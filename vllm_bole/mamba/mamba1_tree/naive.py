"""Plain-torch twin of the Mamba1 tree kernel (``csrc_triton/mamba1_tree.py``): the CPU path of
``vllm_bole.mamba.mamba1_tree.mamba1_tree_step``, in fp32 (fp64 for fp64 states): the pending
path's commit, then the tree's closed form per request on the padded tree, in channel chunks
(the decay ``exp(A[d, n] (s_i - s_j))`` has no low-rank form, so every (node, ancestor, channel,
state) term is formed). The float64 sequential reference beside it is
``vllm_bole.mamba.mamba1_tree.reference``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.mamba.ssd_tree.naive import dt_effective as _dt_ssd
from vllm_bole.pending import live_pending
from vllm_bole.tree_views import padded_tree

CHUNK_ELEMENTS = 1 << 24  # largest [B, n, n, channels, N] block formed at once
UNBOUNDED = (-float("inf"), float("inf"))


def dt_effective(dt, dt_bias, dt_softplus, dtype):
    """softplus(dt + dt_bias) (or dt + dt_bias) in ``dtype``: Mamba2's, without its clamp."""
    return _dt_ssd(dt, dt_bias, dt_softplus, UNBOUNDED, dtype)


def _chunks(total: int, per: int):
    step = max(1, CHUNK_ELEMENTS // max(per, 1))
    return [slice(c, min(c + step, total)) for c in range(0, total, step)]


def step_torch(x, dt, A, B, C, tree, state, state_idx, pending, D, z, dt_bias, dt_softplus, pending_idx):
    ft = torch.float64 if state.dtype == torch.float64 else torch.float32
    Dn, N = state.shape[1:]
    A = A.to(ft)
    slots = state_idx.long()
    live = live_pending(pending, slots, pending_idx) if pending is not None else None
    if live is not None:
        sl, pr, m, valid = live  # [b], [b], [b], [b, L]
        v = valid[..., None]
        dtp = torch.where(v, dt_effective(pending.dt[pr], dt_bias, dt_softplus, ft), 0)  # [b, L, Dn]
        xp = torch.where(v, pending.x[pr].to(ft), 0)
        Bp = torch.where(v, pending.B[pr].to(ft), 0)  # [b, L, N]
        s = dtp.cumsum(1)
        sm = s.gather(1, (m - 1)[:, None, None].expand(-1, 1, Dn))  # [b, 1, Dn]
        S = state[sl].to(ft)  # [b, Dn, N]
        for c in _chunks(Dn, dtp.shape[0] * dtp.shape[1] * N):
            w = torch.exp(A[c] * (sm - s)[:, :, c, None]) * (dtp * xp)[:, :, c, None]  # [b, L, c, N]
            S[:, c] = torch.exp(A[c] * sm[:, 0, c, None]) * S[:, c] + (w * Bp[:, :, None, :]).sum(1)
        state[sl] = S.to(state.dtype)
    if tree is None:
        return None
    pad, valid, M = padded_tree(tree, ft)
    Bq, n = valid.shape
    col = lambda t: pad(t).transpose(1, 2)  # noqa: E731  [T, X] -> [Bq, n, X], zeros in padding
    X, dtt = col(x), col(dt_effective(dt, dt_bias, dt_softplus, ft))
    Bt, Ct = col(B), col(C)
    Mf = M.to(ft)
    s = Mf @ dtt  # [Bq, n, Dn]: dt summed over each node's root-to-node path
    S0 = state[slots].to(ft)  # [Bq, Dn, N]
    y = torch.empty(Bq, n, Dn, dtype=ft, device=x.device)
    for c in _chunks(Dn, Bq * n * n * N):
        Ac = A[c]  # [c, N]
        y1 = (Ct[:, :, None, :] * torch.exp(Ac * s[:, :, c, None]) * S0[:, None, c]).sum(-1)  # [Bq, n, c]
        diff = torch.where(M[..., None], s[:, :, None, c] - s[:, None, :, c], 0)  # [Bq, i, j, c]
        dec = torch.exp(Ac * diff[..., None])  # [Bq, i, j, c, N]
        kern = (dec * Ct[:, :, None, None, :] * Bt[:, None, :, None, :]).sum(-1) * Mf[..., None]  # [Bq, i, j, c]
        y[:, :, c] = y1 + (kern * (dtt * X)[:, None, :, c]).sum(2)
    if D is not None:
        y = y + D.to(ft) * X
    if z is not None:
        y = y * F.silu(col(z).to(ft))
    return y[valid].to(x.dtype)
