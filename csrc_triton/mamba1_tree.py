"""Mamba1 (selective SSM) tree verification with the pending-path commit folded in (Triton).

One program per (request, channel tile of BD channels); the whole state row (BN = d_state rounded up
to a power of two) stays in registers. It loads its tile of the request's committed state h0
([BD, BN] of ``state[slot]``, vLLM's mamba1 ``[Dn, N]`` layout addressed through strides, any float
dtype, computed in fp32) and:

1. commit (``HAS_PENDING``): if the slot holds a pending accepted path of m > 0 tokens (their own
   inputs x, raw dt, B from the previous step), token by token,
       h <- exp(dt_j A) h + dt_j x_j B_j
   and writes it back in place (one write per step);
2. verify (``HAS_TREE``): for every leaf of the tree (a node without children: tested against the
   request's parent vector), the same recurrence along its root-to-leaf path (``tree.path``) from
   h0, writing y_i = C_i . h_i + D x_i (then ``y * silu(z)`` when the gate is given) of every node
   on the path. A node on several paths is recomputed by each, with the same operations from the
   same state, so every write of it holds the same value; no per-node state is kept.

Why walks and not a closed form: the decay exp(A[d, n] dt) depends on (channel, state), so unlike SSD
there is no ``C . B`` low-rank form, and every tree form measured on the H200 lost to walking the
paths (``benchmarks/results/mamba1_tree*.json``): the closed form (every node summing over its
ancestors, one exponential per ancestor) 4.6x slower than serial, a level-synchronous register tile
(each node's state from its parent's through ``tl.gather``, depth + 1 sweeps) 1.8-2.1x slower.

dt_eff = softplus(dt + dt_bias) (threshold 20) or dt + dt_bias. All arithmetic in fp32 (no tensor
cores), so the interpreter is exact and 16-bit inputs lose nothing beyond their own rounding. API
and dispatch: ``vllm_bole.mamba.mamba1_tree``; plain-torch twin: its ``naive.py``; float64
reference: its ``reference.py``; the accepted-path stash: ``csrc_triton.pending_stash``.
"""
import triton
import triton.language as tl

TILE = 1024  # BD x BN state elements of one program
# one warp per program: the H200 sweep at B = 32, N = 64 (Jamba shapes, verification alone): 1 warp
# 0.54 ms, 2 warps 0.60, 4 warps 0.78 (fewer, fatter programs lose; mamba1_tree.json at 9b08516)
NUM_WARPS = 1
# path_groups=None: split a request's leaves over G programs until B x channel tiles x G reaches about
# this many programs (G a power of two, at most 16). The H200 sweep (mamba1_tree.json at 09da34c):
# Jamba shapes (128 tiles) best at G = 8 for B = 1 and G = 1 for B = 8; their TP-2 shard (64 tiles)
# best at G = 16 for B = 1 and G = 2 for B = 8; B = 1, N = 64: 0.038 ms at G = 8 against 0.115 at G = 1.
PATH_PROGRAMS = 1024
MAX_PATH_GROUPS = 16


def auto_path_groups(num_requests: int, channel_tiles: int) -> int:
    """G for ``path_groups=None``: the largest power of two <= MAX_PATH_GROUPS with
    num_requests x channel_tiles x G <= PATH_PROGRAMS (at least 1)."""
    g = 1
    while 2 * g <= MAX_PATH_GROUPS and num_requests * channel_tiles * 2 * g <= PATH_PROGRAMS:
        g *= 2
    return g


@triton.jit
def _dt_eff(dt, bias, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    d = dt.to(tl.float32)
    if HAS_DT_BIAS:
        d = d + bias
    if DT_SOFTPLUS:
        d = tl.where(d <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    return d


@triton.jit
def mamba1_tree_step_kernel(
    x, dt, Bm, Cm, z, y,  # tree inputs [T, Dn] x2, [T, N] x2, gate [T, Dn]; y [T, Dn]
    cu_nodes, parent, depth, path, W,  # [B + 1]; parent [T] local (-1: the root); depth [T]; path [T, W] int32
    A, D, dt_bias,  # [Dn, N] fp32; [Dn] fp32 (dummies when absent)
    state, state_idx, s_slot, s_d, s_n,  # state[slot, d, n] through strides; state_idx [B]
    px, pdt, pB, plen, pidx, L,  # pending path: [R, L, Dn], [R, L, Dn], [R, L, N], [R]; its rows [B]
    Dn, N: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(state_idx + b).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = o_d < Dn
    o_n = tl.arange(0, BN)
    nm = o_n < N
    s_mask = dm[:, None] & nm[None, :]
    A_t = tl.load(A + o_d[:, None] * N + o_n[None, :], mask=s_mask, other=0.0)  # [BD, BN]
    bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + o_d, mask=dm, other=0.0)
    s_ptr = state + slot * s_slot + o_d[:, None] * s_d + o_n[None, :] * s_n
    S = tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32)  # [BD, BN]

    if HAS_PENDING:
        row = tl.load(pidx + b).to(tl.int64)
        m = tl.load(plen + row)
        if m > 0:
            for j in range(0, m):
                prow = row * L + j
                dtp = _dt_eff(tl.load(pdt + prow * Dn + o_d, mask=dm, other=0.0), bias, HAS_DT_BIAS, DT_SOFTPLUS)
                xp = tl.load(px + prow * Dn + o_d, mask=dm, other=0.0).to(tl.float32)
                Bp = tl.load(pB + prow * N + o_n, mask=nm, other=0.0).to(tl.float32)
                S = tl.exp(dtp[:, None] * A_t) * S + (dtp * xp)[:, None] * Bp[None, :]
            tl.store(s_ptr, S.to(state.dtype.element_ty), mask=s_mask)

    if HAS_TREE:
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        o_r = tl.arange(0, NP)
        par = tl.load(parent + bos + o_r, mask=o_r < n, other=-1)
        D_t = tl.zeros([BD], dtype=tl.float32)
        if HAS_D:
            D_t = tl.load(D + o_d, mask=dm, other=0.0)
        g = tl.program_id(2)
        k = 0  # leaves seen: this program walks the leaves k = g, g + G, ...
        for leaf in range(0, n):
            is_leaf = tl.sum((par == leaf).to(tl.int32)) == 0
            mine = is_leaf & (k % G == g)
            k += is_leaf.to(tl.int32)
            if mine:
                lrow = (bos + leaf).to(tl.int64)
                h = S
                for t in range(0, tl.load(depth + lrow) + 1):  # the root-to-leaf path, root first
                    i = bos + tl.load(path + lrow * W + t).to(tl.int64)
                    d = _dt_eff(tl.load(dt + i * Dn + o_d, mask=dm, other=0.0), bias, HAS_DT_BIAS, DT_SOFTPLUS)
                    xi = tl.load(x + i * Dn + o_d, mask=dm, other=0.0).to(tl.float32)
                    Bi = tl.load(Bm + i * N + o_n, mask=nm, other=0.0).to(tl.float32)
                    Ci = tl.load(Cm + i * N + o_n, mask=nm, other=0.0).to(tl.float32)
                    h = tl.exp(d[:, None] * A_t) * h + (d * xi)[:, None] * Bi[None, :]
                    out = tl.sum(h * Ci[None, :], axis=1) + D_t * xi
                    if HAS_Z:
                        zi = tl.load(z + i * Dn + o_d, mask=dm, other=0.0).to(tl.float32)
                        out = out * zi / (1.0 + tl.exp(-zi))
                    tl.store(y + i * Dn + o_d, out.to(y.dtype.element_ty), mask=dm)


def mamba1_tree_step(x, dt, A, B, C, tree, state, state_idx, pending, D, z, dt_bias, dt_softplus, out=None,
                     pending_idx=None, *, tile=TILE, num_warps=NUM_WARPS, path_groups=None):
    """Launch ``mamba1_tree_step_kernel``; arguments as ``vllm_bole.mamba.mamba1_tree.mamba1_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone. Returns y [T, Dn]
    in x's dtype (``out`` if given; None without a tree). Tiles: BN = d_state rounded up to a power of
    two (>= 2), BD = tile / BN channels (1..64), NP = the largest tree rounded up (the parent vector).
    ``path_groups`` G > 1 splits each request's leaves over G programs (shorter serial chains for
    small batches, where B x channel tiles programs leave the GPU idle); the pending commit then runs
    as its own launch first (the programs of a request must all read the committed state). None:
    :func:`auto_path_groups` (G = 1, one launch, from B x channel tiles >= PATH_PROGRAMS on).
    """
    import torch

    Dn, N = state.shape[1:]
    nB = state_idx.numel()
    BN = max(2, triton.next_power_of_2(N))
    BD = max(1, min(64, tile // BN, triton.next_power_of_2(Dn)))
    NP = max(2, triton.next_power_of_2(tree.max_nodes)) if tree is not None else 2
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    A = f32(A)
    if tree is not None:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
        z = z.contiguous() if z is not None else None
        if out is None:
            out = torch.empty_like(x)
        assert out.is_contiguous(), "out must be contiguous"
        path = tree.path.contiguous()
        tree_args = (x, dt, B, C, z if z is not None else x, out, tree.cu_nodes, tree.parent, tree.depth, path,
                     path.shape[1])
    else:
        out = None
        tree_args = (state, state, state, state, state, state, state_idx, state_idx, state_idx, state_idx, 0)
    if path_groups is None:
        path_groups = auto_path_groups(nB, triton.cdiv(Dn, BD))
    if pending is not None and tree is not None and path_groups > 1:
        mamba1_tree_step(None, None, A, None, None, None, state, state_idx, pending, D, None, dt_bias, dt_softplus,
                         pending_idx=pending_idx, tile=tile, num_warps=num_warps)
        pending = None
    if pending is not None:
        pend_args = (pending.x, pending.dt, pending.B, pending.length,
                     state_idx if pending_idx is None else pending_idx, pending.max_len)
    else:
        pend_args = (state, state, state, state_idx, state_idx, 0)
    G = path_groups if tree is not None else 1
    mamba1_tree_step_kernel[(nB, triton.cdiv(Dn, BD), G)](
        *tree_args,
        A, f32(D) if D is not None else A, f32(dt_bias) if dt_bias is not None else A,
        state, state_idx, *state.stride(),
        *pend_args,
        Dn, N=N, NP=NP, BD=BD, BN=BN, G=G,
        HAS_TREE=tree is not None, HAS_PENDING=pending is not None, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), num_warps=num_warps,
    )
    return out
