"""Mamba2 / SSD tree verification and accepted-path commit (engine-agnostic): the public API.

One operation, three implementations side by side:
  csrc_triton/ssd_tree.py                  the Triton kernel (commit + verify in one launch)
  vllm_bole/mamba/ssd_tree/naive.py        its plain-torch twin (the CPU path)
  vllm_bole/mamba/ssd_tree/reference.py    the float64 sequential reference (the tests' oracle)

Layouts (T flat tree nodes, B requests, S state slots; the oracle's conventions,
``vllm_bole.mamba.ssd_tree.reference``):
  x           [T, H, P]    the SSM input (after the conv), P = head_dim
  dt          [T, H]       raw (before dt_bias, softplus, clamp)
  A           [H]          negative (-exp(A_log)); D, dt_bias [H] or None
  B, C        [T, G, N]    N = d_state; head h uses group h // (H // G) (as transformers'
                           ``repeat_interleave`` and vLLM's mamba2 kernels)
  state       [S, H, P, N] fp32 (or the model dtype), any strides: vLLM's mamba2 ``ssm_state``
              as is; request b owns slot ``state_idx[b]`` (distinct slots)
  y           [T, H, P]    in x's dtype: h C + D x, BEFORE the model's z gate and norm
Envelope (``check_ssd_dims``): head_dim and d_state up to 256, n_groups dividing H; trees as
``TreeBatch`` allows (<= 256 nodes, depth <= 64).
dt_eff = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit).

Closed form (no per-node state, nothing to invert): with a_j = dt_j A and G_i the sum of a over
the root-to-i path,
  y_i = exp(G_i) h0 C_i + sum_{j in anc*(i)} exp(G_i - G_j) (C_i . B_j) dt_j x_j + D x_i.

Factors and commit, as the GDN layer (``vllm_bole.gdn``): a verify pass writes no
per-node state. After sampling, ``stash_accepted_path`` copies the accepted path's own inputs
(x, raw dt, B of the root and the accepted draft nodes: at most depth + 1 tokens, in their input
dtypes) into a per-slot ``PendingPath`` (the generic buffer of ``vllm_bole.pending``).
The next ``ssd_tree_step`` of that slot first applies them,
  h <- exp(G_m) h + sum_{j on path} exp(G_m - G_j) dt_j x_j B_j^T,
writes the state in place, and verifies the new tree from it while it is still on chip (one
state read + one write per step). The pending dt goes through the same dt_bias / softplus /
clamp as the step's own dt (per-layer constants). ``ssd_commit_pending`` applies a pending path
alone (request finishing, preemption).

``kernels`` (``vllm_bole.dispatch``): "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch"
(the twin), "auto" (triton on CUDA tensors, torch otherwise).
"""
from __future__ import annotations

import torch

from vllm_bole import pending as _pending
from vllm_bole.dispatch import use_triton
from vllm_bole.mamba.ssd_tree.naive import step_torch
from vllm_bole.spec_decode.tree import TreeBatch

INF = float("inf")


class PendingPath(_pending.PendingPath):
    """Per-slot accepted paths awaiting commit: the tokens' own SSD inputs, fields
    x [S, L, H, P], dt [S, L, H] (raw), B [S, L, G, N] and length [S] int32 (0 = nothing pending)."""

    @classmethod
    def empty(cls, num_slots, max_len, H, G, P, N, dtype=torch.bfloat16, dt_dtype=None, device="cpu") -> "PendingPath":
        """x and B in ``dtype``, dt in ``dt_dtype`` (default: ``dtype``; match the model's dt)."""
        dt_dtype = dtype if dt_dtype is None else dt_dtype
        return cls.allocate(num_slots, max_len, dict(x=((H, P), dtype), dt=((H,), dt_dtype), B=((G, N), dtype)), device)


MAX_DIM = 256


def check_ssd_dims(H: int, G: int, P: int, N: int) -> None:
    """Refuse dimensions outside the kernels' envelope (one-line ValueError naming the field)."""
    if not 1 <= P <= MAX_DIM:
        raise ValueError(f"Mamba2 head_dim={P} is not supported: head_dim must be from 1 to {MAX_DIM} (models: 32, 64, 128)")
    if not 1 <= N <= MAX_DIM:
        raise ValueError(f"Mamba2 d_state={N} is not supported: d_state must be from 1 to {MAX_DIM} (models: 16, 64, 128, 256)")
    if G < 1 or H % G:
        raise ValueError(f"Mamba2 n_groups={G} is not supported: n_groups must divide the {H} heads")


def ssd_tree_step(
    x, dt, A, B, C, tree: TreeBatch | None, state, state_idx, pending: PendingPath | None = None,
    *, D=None, dt_bias=None, dt_softplus: bool = True, dt_limit=(0.0, INF), out=None, kernels: str = "auto",
    reset_pending: bool = True, pending_idx=None,
):
    """Commit each request's pending path (if any) into its state ``state[state_idx]`` in place, then
    verify ``tree``. ``pending_idx`` [B]: each request's row of ``pending`` (default ``state_idx``).

    Returns y [T, H, P] (written into ``out`` when given; None when ``tree`` is None: commit
    only). Pending lengths of the touched rows are reset to 0.
    ``reset_pending=False`` leaves the pending lengths of the touched slots as they were, for a
    caller that stashes every one of them next (the engine: each verified slot's accepted path),
    which saves a launch per step; they must not be read before that stash.
    """
    triton = use_triton(kernels, state)
    if tree is None and pending is None:
        return None
    H, P, N = state.shape[1:]
    check_ssd_dims(H, B.shape[1] if tree is not None else pending.B.shape[2], P, N)

    def launch():  # imported here: Triton picks interpreter or compiled mode at the kernel module's import
        from csrc_triton.ssd_tree import ssd_tree_step as kernel

        return kernel(x, dt, A, B, C, tree, state, state_idx, pending, D, dt_bias, dt_softplus, dt_limit, out, rows)

    rows = state_idx if pending_idx is None else pending_idx
    return _pending.dispatch_step(
        triton, launch, lambda: step_torch(x, dt, A, B, C, tree, state, state_idx, pending, D, dt_bias, dt_softplus,
                                           dt_limit, rows),
        tensors=(state, x), out=out, pending=pending, pending_idx=rows, reset_pending=reset_pending)


def ssd_commit_pending(state, state_idx, pending: PendingPath, A, *, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF),
                       kernels="auto", pending_idx=None):
    """Apply each request's pending accepted path to its state in place (no verification)."""
    ssd_tree_step(None, None, A, None, None, None, state, state_idx, pending,
                  dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, kernels=kernels, pending_idx=pending_idx)


def stash_accepted_path(pending: PendingPath, state_idx, tree: TreeBatch, accepted, x, dt, B, *, kernels="auto"):
    """Copy the accepted nodes' x, raw dt and B into ``pending`` at the requests' rows ``state_idx``.

    accepted: [B, L] local node indices of each request's accepted path, root first, padded
    with -1 (verification's output); inputs as given to ``ssd_tree_step``. L must not exceed
    the buffer's length. Rows past a path's length keep stale values (readers mask them).
    """
    _pending.stash_accepted_path(pending, state_idx, tree, accepted, dict(x=x, dt=dt, B=B), kernels=kernels)
