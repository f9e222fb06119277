"""Mamba1 (selective SSM: Jamba, Falcon-Mamba, Mamba) tree verification and accepted-path commit
(engine-agnostic): the public API.

One operation, three implementations side by side:
  csrc_triton/mamba1_tree.py                 the Triton kernel (commit + verify in one launch)
  vllm_bole/mamba/mamba1_tree/naive.py       its plain-torch twin (the CPU path)
  vllm_bole/mamba/mamba1_tree/reference.py   the float64 sequential reference (the tests' oracle)

Layouts (T flat tree nodes, B requests, S state slots; vLLM's ``MambaMixer``):
  x        [T, Dn]   the SSM input (after the conv and its SiLU), Dn = intermediate size (per TP shard)
  dt       [T, Dn]   raw (``dt_proj`` without its bias)
  A        [Dn, N]   negative (-exp(A_log)); N = d_state
  B, C     [T, N]    shared by all channels
  D, dt_bias [Dn] or None; z [T, Dn] or None (the gate: ``y * silu(z)``, as vLLM fuses it)
  state    [S, Dn, N] fp32 (or the model dtype), any strides: vLLM's mamba1 ``ssm_state``;
           request b owns slot ``state_idx[b]`` (distinct slots)
  y        [T, Dn]   in x's dtype
Envelope (``check_mamba1_dims``): d_state up to 256 (models: 16), any channel count; trees as
``TreeBatch`` allows (<= 256 nodes, depth <= 64). dt_eff = softplus(dt + dt_bias) (or dt + dt_bias).

Closed form: the decay depends on (channel, state), ``exp(dt_eff[d] A[d, n])``, so unlike SSD there
is no ``C . B`` low-rank shortcut; but its log is ``A[d, n]`` times the dt summed along a path, so
with ``s_i[d]`` = dt_eff summed over the root-to-i path,
  h_i[d, n] = exp(A[d, n] s_i[d]) h0[d, n] + sum_{j in anc*(i)} exp(A[d, n] (s_i[d] - s_j[d])) dt_j[d] x_j[d] B_j[n]
  y_i[d]    = sum_n C_i[n] h_i[d, n] + D[d] x_i[d]
every node from the committed state and its at most ``depth + 1`` ancestors, no per-node state:
the torch twin's form (dense per request). The Triton kernel instead walks every root-to-leaf
path with the sequential recurrence from the committed state (shared prefixes recomputed, no
per-node state): on the H200 every tree form measured lost to that (kernel docstring).

Factors and commit, as Mamba2 (``vllm_bole.mamba.ssd_tree``): after sampling,
``stash_accepted_path`` copies the accepted path's own inputs (x, raw dt, B: at most depth + 1
tokens) into a per-slot ``PendingPath``; the next ``mamba1_tree_step`` of that slot first applies
them (``h <- exp(A s_m) h + sum_j exp(A (s_m - s_j)) dt_j x_j B_j``), writes the state in place and
verifies the new tree from it. ``mamba1_commit_pending`` applies a pending path alone.

``kernels`` (``vllm_bole.dispatch``): "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch"
(the twin), "auto" (triton on CUDA tensors, torch otherwise).
"""
from __future__ import annotations

import torch

from vllm_bole import pending as _pending
from vllm_bole.dispatch import use_triton
from vllm_bole.mamba.mamba1_tree.naive import step_torch
from vllm_bole.spec_decode.tree import TreeBatch

MAX_STATE = 256


class PendingPath(_pending.PendingPath):
    """Per-slot accepted paths awaiting commit: x [S, L, Dn], dt [S, L, Dn] (raw), B [S, L, N] and
    length [S] int32 (0 = nothing pending)."""

    @classmethod
    def empty(cls, num_slots, max_len, Dn, N, dtype=torch.bfloat16, dt_dtype=None, device="cpu") -> "PendingPath":
        """x and B in ``dtype``, dt in ``dt_dtype`` (default: ``dtype``; match the model's dt)."""
        dt_dtype = dtype if dt_dtype is None else dt_dtype
        return cls.allocate(num_slots, max_len, dict(x=((Dn,), dtype), dt=((Dn,), dt_dtype), B=((N,), dtype)), device)


def check_mamba1_dims(Dn: int, N: int) -> None:
    """Refuse dimensions outside the kernels' envelope (one-line ValueError naming the field)."""
    if Dn < 1:
        raise ValueError(f"Mamba1 intermediate_size={Dn} is not supported: it must be at least 1")
    if not 1 <= N <= MAX_STATE:
        raise ValueError(f"Mamba1 d_state={N} is not supported: d_state must be from 1 to {MAX_STATE} (models: 16)")


def mamba1_tree_step(x, dt, A, B, C, tree: TreeBatch | None, state, state_idx, pending: PendingPath | None = None,
                     *, D=None, z=None, dt_bias=None, dt_softplus: bool = True, out=None, kernels: str = "auto",
                     reset_pending: bool = True, pending_idx=None):
    """Commit each request's pending path (if any) into its state ``state[state_idx]`` in place, then
    verify ``tree``. ``pending_idx`` [B]: each request's row of ``pending`` (default ``state_idx``).

    Returns y [T, Dn] (written into ``out`` when given; None when ``tree`` is None: commit only).
    Pending lengths of the touched rows are reset to 0.
    ``reset_pending=False`` leaves the pending lengths of the touched slots as they were, for a
    caller that stashes every one of them next (the engine: each verified slot's accepted path),
    which saves a launch per step; they must not be read before that stash.
    """
    if tree is None and pending is None:
        return None
    Dn, N = state.shape[1:]
    check_mamba1_dims(Dn, N)

    def launch():  # imported here: Triton picks interpreter or compiled mode at the kernel module's import
        from csrc_triton.mamba1_tree import mamba1_tree_step as kernel

        return kernel(x, dt, A, B, C, tree, state, state_idx, pending, D, z, dt_bias, dt_softplus, out, rows)

    rows = state_idx if pending_idx is None else pending_idx
    return _pending.dispatch_step(
        use_triton(kernels, state), launch,
        lambda: step_torch(x, dt, A, B, C, tree, state, state_idx, pending, D, z, dt_bias, dt_softplus, rows),
        tensors=(state, x), out=out, pending=pending, pending_idx=rows, reset_pending=reset_pending)


def mamba1_commit_pending(state, state_idx, pending: PendingPath, A, *, dt_bias=None, dt_softplus=True, kernels="auto",
                          pending_idx=None):
    """Apply each request's pending accepted path to its state in place (no verification)."""
    mamba1_tree_step(None, None, A, None, None, None, state, state_idx, pending, dt_bias=dt_bias,
                     dt_softplus=dt_softplus, kernels=kernels, pending_idx=pending_idx)


def stash_accepted_path(pending: PendingPath, state_idx, tree: TreeBatch, accepted, x, dt, B, *, kernels="auto"):
    """Copy the accepted nodes' x, raw dt and B into ``pending`` at the requests' rows ``state_idx`` (as
    ``vllm_bole.mamba.ssd_tree.stash_accepted_path``)."""
    _pending.stash_accepted_path(pending, state_idx, tree, accepted, dict(x=x, dt=dt, B=B), kernels=kernels)
