"""Mamba1 (selective SSM) tree verification with the pending-path commit folded in (Triton).

One program per (request, channel tile of BD channels). It loads its tile of the request's
committed state h0 ([BD, N] of ``state[slot]``, vLLM's mamba1 ``[Dn, N]`` layout addressed through
strides, any float dtype, computed in fp32) and:

1. commit (``HAS_PENDING``): if the slot holds a pending accepted path of m > 0 tokens (their own
   inputs x, raw dt, B from the previous step), token by token,
       h <- exp(dt_j A) h + dt_j x_j B_j
   and writes it back in place (one write per step);
2. verify (``HAS_TREE``): every tree node's output from h and the node's ancestors only. Nodes go
   in row blocks of BR, each block's walks as deep as its deepest node; for a node i with s_i = dt
   summed over its root-to-i path (one walk along ``tree.path``) and p_k = the same sum up to its
   depth-k ancestor j_k (a second walk),
       y_i = sum_n C_i[n] exp(A s_i) h0 + sum_k dt_{j_k} x_{j_k} sum_n C_i[n] B_{j_k}[n] exp(A (s_i - p_k)) + D x_i
   then ``y * silu(z)`` when the gate is given. The decay exp(A[d, n] (s_i - p_k)[d]) depends on
   (channel, state): every term is formed, in [BR, BD, BN] tiles (no ``C . B`` shortcut, no
   per-node state, nothing to invert); (s_i - p_k) >= 0, so every exponential is at most 1.

dt_eff = softplus(dt + dt_bias) (threshold 20) or dt + dt_bias. All arithmetic in fp32 (no tensor
cores: the reductions run over N and the path, not a matmul), so the interpreter is exact and
16-bit inputs lose nothing beyond their own rounding. API and dispatch: ``vllm_bole.mamba.mamba1_tree``;
plain-torch twin: its ``naive.py``; float64 reference: its ``reference.py``; the accepted-path
stash: ``csrc_triton.pending_stash``.
"""
import triton
import triton.language as tl


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
    cu_nodes, path, W, depth,  # [B + 1] int32; path [T, W] int32 local ancestor at each depth (-1 beyond); depth [T]
    A, D, dt_bias,  # [Dn, N] fp32; [Dn] fp32 (dummies when absent)
    state, state_idx, s_slot, s_d, s_n,  # state[slot, d, n] through strides; state_idx [B]
    px, pdt, pB, plen, L,  # pending path: [S, L, Dn], [S, L, Dn], [S, L, N], [S]
    Dn, N: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(state_idx + b).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = o_d < Dn
    o_n = tl.arange(0, BN)
    nm = o_n < N
    A_t = tl.load(A + o_d[:, None] * N + o_n[None, :], mask=dm[:, None] & nm[None, :], other=0.0)  # [BD, BN]
    bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + o_d, mask=dm, other=0.0)
    s_ptr = state + slot * s_slot + o_d[:, None] * s_d + o_n[None, :] * s_n
    s_mask = dm[:, None] & nm[None, :]
    S = tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32)  # [BD, BN]

    if HAS_PENDING:
        m = tl.load(plen + slot)
        if m > 0:
            for j in range(0, m):
                prow = slot * L + j
                dtp = _dt_eff(tl.load(pdt + prow * Dn + o_d, mask=dm, other=0.0), bias, HAS_DT_BIAS, DT_SOFTPLUS)
                xp = tl.load(px + prow * Dn + o_d, mask=dm, other=0.0).to(tl.float32)
                Bp = tl.load(pB + prow * N + o_n, mask=nm, other=0.0).to(tl.float32)
                S = tl.exp(dtp[:, None] * A_t) * S + (dtp * xp)[:, None] * Bp[None, :]
            tl.store(s_ptr, S.to(state.dtype.element_ty), mask=s_mask)

    if HAS_TREE:
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        D_t = tl.zeros([BD], dtype=tl.float32)
        if HAS_D:
            D_t = tl.load(D + o_d, mask=dm, other=0.0)
        o_r = tl.arange(0, BR)
        for r0 in range(0, n, BR):
            ri = r0 + o_r
            rm = ri < n
            rows = (bos + ri).to(tl.int64)
            kend = tl.max(tl.load(depth + rows, mask=rm, other=0)) + 1  # the block's deepest path
            # s_i: dt summed along the root-to-i path
            s = tl.zeros([BR, BD], dtype=tl.float32)
            for k in range(0, kend):
                j = tl.load(path + rows * W + k, mask=rm, other=-1)
                jm = rm & (j >= 0)
                jr = (bos + tl.maximum(j, 0)).to(tl.int64)
                dj = _dt_eff(tl.load(dt + jr[:, None] * Dn + o_d[None, :], mask=jm[:, None] & dm[None, :], other=0.0),
                             bias[None, :], HAS_DT_BIAS, DT_SOFTPLUS)
                s += tl.where(jm[:, None], dj, 0.0)
            C_i = tl.load(Cm + rows[:, None] * N + o_n[None, :], mask=rm[:, None] & nm[None, :], other=0.0).to(tl.float32)
            out = tl.sum(C_i[:, None, :] * tl.exp(A_t[None, :, :] * s[:, :, None]) * S[None, :, :], axis=2)  # [BR, BD]
            p = tl.zeros([BR, BD], dtype=tl.float32)
            for k in range(0, kend):  # the ancestors-or-self, root first
                j = tl.load(path + rows * W + k, mask=rm, other=-1)
                jm = rm & (j >= 0)
                jr = (bos + tl.maximum(j, 0)).to(tl.int64)
                m2 = jm[:, None] & dm[None, :]
                dj = tl.where(m2, _dt_eff(tl.load(dt + jr[:, None] * Dn + o_d[None, :], mask=m2, other=0.0),
                                          bias[None, :], HAS_DT_BIAS, DT_SOFTPLUS), 0.0)
                p += dj
                xj = tl.load(x + jr[:, None] * Dn + o_d[None, :], mask=m2, other=0.0).to(tl.float32)
                Bj = tl.load(Bm + jr[:, None] * N + o_n[None, :], mask=jm[:, None] & nm[None, :], other=0.0).to(tl.float32)
                dec = tl.exp(A_t[None, :, :] * tl.maximum(s - p, 0.0)[:, :, None])  # [BR, BD, BN]
                out += tl.sum(dec * (C_i * Bj)[:, None, :], axis=2) * dj * xj
            io = rows[:, None] * Dn + o_d[None, :]
            im = rm[:, None] & dm[None, :]
            if HAS_D:
                out += D_t[None, :] * tl.load(x + io, mask=im, other=0.0).to(tl.float32)
            if HAS_Z:
                zi = tl.load(z + io, mask=im, other=0.0).to(tl.float32)
                out = out * zi / (1.0 + tl.exp(-zi))
            tl.store(y + io, out.to(y.dtype.element_ty), mask=im)


def mamba1_tree_step(x, dt, A, B, C, tree, state, state_idx, pending, D, z, dt_bias, dt_softplus, out=None, *,
                     block_d=None, block_r=16, num_warps=4):
    """Launch ``mamba1_tree_step_kernel``; arguments as ``vllm_bole.mamba.mamba1_tree.mamba1_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone. Returns y [T, Dn]
    in x's dtype (``out`` if given; None without a tree). Tiles: BR = 16 nodes, BN = d_state rounded
    up to a power of two (>= 16), BD channels with BR x BD x BN <= 8192 (BD = 32 at d_state 16).
    """
    import torch

    Dn, N = state.shape[1:]
    nB = state_idx.numel()
    BN = max(16, triton.next_power_of_2(N))
    BD = block_d or max(2, min(64, 8192 // (block_r * BN)))
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    A = f32(A)
    if tree is not None:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
        z = z.contiguous() if z is not None else None
        if out is None:
            out = torch.empty_like(x)
        assert out.is_contiguous(), "out must be contiguous"
        path = tree.path.contiguous()
        tree_args = (x, dt, B, C, z if z is not None else x, out, tree.cu_nodes, path, path.shape[1], tree.depth)
    else:
        out = None
        tree_args = (state, state, state, state, state, state, state_idx, state_idx, 0, state_idx)
    if pending is not None:
        pend_args = (pending.x, pending.dt, pending.B, pending.length, pending.max_len)
    else:
        pend_args = (state, state, state, state_idx, 0)
    mamba1_tree_step_kernel[(nB, triton.cdiv(Dn, BD))](
        *tree_args,
        A, f32(D) if D is not None else A, f32(dt_bias) if dt_bias is not None else A,
        state, state_idx, *state.stride(),
        *pend_args,
        Dn, N=N, BR=block_r, BD=BD, BN=BN,
        HAS_TREE=tree is not None, HAS_PENDING=pending is not None, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), num_warps=num_warps,
    )
    return out
