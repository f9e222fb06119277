"""Float64 sequential reference of the Mamba1 tree step (the oracle of ``vllm_bole.mamba.mamba1_tree``).

Each node's state from its parent's (or the committed state for the root), depth level by depth
level, as a sequential run along its own path. Inputs in any float dtype and device; float64 out.

Conventions (vLLM's ``MambaMixer``, transformers' Mamba / FalconMamba / Jamba mixers): per channel
``d`` and state ``n``, ``dt_eff = softplus(dt + dt_bias)`` (or ``dt + dt_bias``),
``h = exp(dt_eff A) h + dt_eff B x``, ``y = C . h + D x``, then ``y * silu(z)`` when the gate is
given. State ``[Dn, N]`` per request (vLLM's mamba1 ``ssm_state`` ``[S, Dn, N]``).
Siblings: ``csrc_triton/mamba1_tree.py`` (kernel), ``vllm_bole/mamba/mamba1_tree/naive.py`` (torch twin).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_bole.tree_views import depth_levels, start_state

_F64 = torch.float64


def mamba1_tree_reference(tree, x, dt, A, B, C, state0, *, D=None, z=None, dt_bias=None, dt_softplus=True):
    """Mamba1 over a tree batch.

    x, dt: [T, Dn] (dt raw); A: [Dn, N] (negative); B, C: [T, N]; D, dt_bias: [Dn] or None;
    z: [T, Dn] or None; state0: [B, Dn, N]. Returns (y [T, Dn], states [T, Dn, N]) float64;
    states[i] = state right after node i.
    """
    T, Dn = x.shape
    N = A.shape[1]
    assert dt.shape == (T, Dn) and A.shape == (Dn, N), "dt must be [T, Dn], A [Dn, N]"
    assert B.shape == (T, N) and C.shape == (T, N), "B/C must be [T, N]"
    assert state0.shape == (tree.num_requests, Dn, N), f"state0 must be [B, Dn, N], got {tuple(state0.shape)}"
    assert tree.num_nodes == T, "tree and inputs disagree on T"
    dev = x.device
    x, dt, A, B, C, state0 = (t.to(_F64) for t in (x, dt, A, B, C, state0))
    if dt_bias is not None:
        dt = dt + dt_bias.to(_F64)
    if dt_softplus:
        dt = F.softplus(dt)
    y = torch.zeros(T, Dn, dtype=_F64, device=dev)
    states = torch.zeros(T, Dn, N, dtype=_F64, device=dev)
    for idx, par, req in depth_levels(tree, dev):
        dtn = dt[idx][..., None]  # [n, Dn, 1]
        h = torch.exp(dtn * A) * start_state(states, state0, par, req)
        h = h + dtn * x[idx][..., None] * B[idx][:, None, :]
        states[idx] = h
        y[idx] = torch.einsum("idn,in->id", h, C[idx])
    if D is not None:
        y = y + D.to(_F64) * x
    if z is not None:
        y = y * F.silu(z.to(_F64))
    return y, states
