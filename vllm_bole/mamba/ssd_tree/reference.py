"""Float64 sequential reference of the SSD tree step (the oracle of ``vllm_bole.mamba.ssd_tree``).

Each node's state from its parent's (or the committed state for the root), depth level by depth
level, as a sequential run along its own path. Inputs in any float dtype and device; float64 out.

Conventions (kernels must match them): state per head ``h [P, N]`` (vLLM's ``ssm_state``
``[B, H, P, N]``; also transformers' cache layout). ``dt_eff = clamp(softplus(dt + dt_bias),
*dt_limit)``: bias, then softplus, then clamp, exactly as transformers' ``torch_chunk_scan`` of
Mamba2 / NemotronH / GraniteMoeHybrid / FalconH1 (the clamp is applied even when
``dt_softplus=False``). The default ``dt_limit=(0, inf)`` is what vLLM always passes (it ignores
the config's ``time_step_limit``); transformers' single-token decode path
(``selective_state_update``) never clamps, its chunked path clamps with ``time_step_limit``.
Pass the limit you want to model. ``y = h C + D x`` (the D skip is added, the z gate and the
norm are NOT part of the reference). Head ``h`` uses group ``h // (H // G)``.
Siblings: ``csrc_triton/ssd_tree.py`` (kernel), ``vllm_bole/mamba/ssd_tree/naive.py`` (torch twin).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.tree_views import depth_levels, start_state

_F64 = torch.float64


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
    for idx, par, req in depth_levels(tree, dev):
        dtn = dt[idx][..., None, None]
        h = torch.exp(dtn * A[:, None, None]) * start_state(states, state0, par, req)
        h = h + dtn * x[idx][..., :, None] * B[idx][..., None, :]
        states[idx] = h
        y[idx] = torch.einsum("nhpk,nhk->nhp", h, C[idx])
    if D is not None:
        y = y + D.to(_F64)[:, None] * x
    return y, states
