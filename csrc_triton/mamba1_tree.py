"""Mamba1 (selective SSM) tree verification with the pending-path commit folded in (Triton).

One program per (request, channel tile of BD channels); the state dimension goes in chunks of BN.
For each chunk it loads its tile of the request's committed state h0 ([BD, BN] of ``state[slot]``,
vLLM's mamba1 ``[Dn, N]`` layout addressed through strides, any float dtype, computed in fp32) and:

1. commit (``HAS_PENDING``): if the slot holds a pending accepted path of m > 0 tokens (their own
   inputs x, raw dt, B from the previous step), token by token,
       h <- exp(dt_j A) h + dt_j x_j B_j
   and writes it back in place (one write per step);
2. verify (``HAS_TREE``): every node's state from its parent's, ONE exponential per (node, channel,
   state): the request's nodes are one register tile ``H [NP, BD, BN]`` (NP = the batch's largest
   tree, rounded up to a power of two), and
       H <- exp(dt A) * gather(H, parent) + dt x B        (the root's parent: h0)
   is applied max_depth + 1 times: after k applications every node of depth < k holds its exact
   state, computed by exactly the sequential recurrence's operations (a level-synchronous pass;
   ``tl.gather`` moves the parents' states). Then y_i += sum_n C_i[n] H_i[:, n] per chunk, and
   ``y + D x``, ``y * silu(z)`` when the gate is given.
The decay exp(A[d, n] dt_i[d]) depends on (channel, state), so there is no ``C . B`` low-rank form;
per node this does what the serial recurrence does per token, once per node instead of once per
(node, root-to-leaf path through it). Tiles: NP x BD x BN <= ``TILE`` elements.

dt_eff = softplus(dt + dt_bias) (threshold 20) or dt + dt_bias. All arithmetic in fp32 (no tensor
cores), so the interpreter is exact and 16-bit inputs lose nothing beyond their own rounding. API
and dispatch: ``vllm_bole.mamba.mamba1_tree``; plain-torch twin: its ``naive.py``; float64
reference: its ``reference.py``; the accepted-path stash: ``csrc_triton.pending_stash``.
"""
import triton
import triton.language as tl

TILE = 4096  # NP x BD x BN elements of one program's state tile
BN = 16  # state elements per chunk (the shipped models' whole d_state)


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
    cu_nodes, parent, depth,  # [B + 1] int32; parent [T] int32 local (-1: the root); depth [T] int32
    A, D, dt_bias,  # [Dn, N] fp32; [Dn] fp32 (dummies when absent)
    state, state_idx, s_slot, s_d, s_n,  # state[slot, d, n] through strides; state_idx [B]
    px, pdt, pB, plen, L,  # pending path: [S, L, Dn], [S, L, Dn], [S, L, N], [S]
    Dn, N: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(state_idx + b).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = o_d < Dn
    bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias + o_d, mask=dm, other=0.0)
    m = 0
    if HAS_PENDING:
        m = tl.load(plen + slot)
    if HAS_TREE:  # tiles with the node axis last (fastest): the parent gather stays within warps
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        o_r = tl.arange(0, NP)
        rm = o_r < n
        rows = (bos + o_r).to(tl.int64)
        par = tl.load(parent + rows, mask=rm, other=-1)
        kend = tl.max(tl.load(depth + rows, mask=rm, other=0)) + 1
        io = rows[None, :] * Dn + o_d[:, None]  # [BD, NP]
        im = dm[:, None] & rm[None, :]
        dtn = tl.where(im, _dt_eff(tl.load(dt + io, mask=im, other=0.0), bias[:, None], HAS_DT_BIAS, DT_SOFTPLUS), 0.0)
        xn = tl.load(x + io, mask=im, other=0.0).to(tl.float32)
        dx = dtn * xn  # [BD, NP]
        gidx = tl.broadcast_to(tl.maximum(par, 0)[None, None, :], (BD, BN, NP))
        root = (par < 0)[None, None, :]
        out = tl.zeros([BD, NP], dtype=tl.float32)
    for n0 in tl.static_range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        nm = o_n < N
        s_mask = dm[:, None] & nm[None, :]
        A_t = tl.load(A + o_d[:, None] * N + o_n[None, :], mask=s_mask, other=0.0)  # [BD, BN]
        s_ptr = state + slot * s_slot + o_d[:, None] * s_d + o_n[None, :] * s_n
        S = tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32)  # [BD, BN]
        if HAS_PENDING:
            if m > 0:
                for j in range(0, m):
                    prow = slot * L + j
                    dtp = _dt_eff(tl.load(pdt + prow * Dn + o_d, mask=dm, other=0.0), bias, HAS_DT_BIAS, DT_SOFTPLUS)
                    xp = tl.load(px + prow * Dn + o_d, mask=dm, other=0.0).to(tl.float32)
                    Bp = tl.load(pB + prow * N + o_n, mask=nm, other=0.0).to(tl.float32)
                    S = tl.exp(dtp[:, None] * A_t) * S + (dtp * xp)[:, None] * Bp[None, :]
                tl.store(s_ptr, S.to(state.dtype.element_ty), mask=s_mask)
        if HAS_TREE:
            cm = nm[:, None] & rm[None, :]
            Bn = tl.load(Bm + rows[None, :] * N + o_n[:, None], mask=cm, other=0.0).to(tl.float32)  # [BN, NP]
            Cn = tl.load(Cm + rows[None, :] * N + o_n[:, None], mask=cm, other=0.0).to(tl.float32)
            dec = tl.exp(dtn[:, None, :] * A_t[:, :, None])  # [BD, BN, NP]
            u = dx[:, None, :] * Bn[None, :, :]
            H = tl.zeros([BD, BN, NP], dtype=tl.float32)
            for _ in range(0, kend):
                H = dec * tl.where(root, S[:, :, None], tl.gather(H, gidx, 2)) + u
            out += tl.sum(Cn[None, :, :] * H, axis=1)
    if HAS_TREE:
        if HAS_D:
            out += tl.load(D + o_d, mask=dm, other=0.0)[:, None] * xn
        if HAS_Z:
            zi = tl.load(z + io, mask=im, other=0.0).to(tl.float32)
            out = out * zi / (1.0 + tl.exp(-zi))
        tl.store(y + io, out.to(y.dtype.element_ty), mask=im)


def mamba1_tree_step(x, dt, A, B, C, tree, state, state_idx, pending, D, z, dt_bias, dt_softplus, out=None, *,
                     tile=TILE, num_warps=4):
    """Launch ``mamba1_tree_step_kernel``; arguments as ``vllm_bole.mamba.mamba1_tree.mamba1_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone. Returns y [T, Dn]
    in x's dtype (``out`` if given; None without a tree). Tiles: NP = the largest tree rounded up to
    a power of two (>= 2), BN = 16 state elements, BD = tile / (NP x BN) channels (>= 1).
    """
    import torch

    Dn, N = state.shape[1:]
    nB = state_idx.numel()
    NP = max(2, triton.next_power_of_2(tree.max_nodes)) if tree is not None else 2
    BD = max(1, min(64, tile // (NP * BN), triton.next_power_of_2(Dn)))
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    A = f32(A)
    if tree is not None:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
        z = z.contiguous() if z is not None else None
        if out is None:
            out = torch.empty_like(x)
        assert out.is_contiguous(), "out must be contiguous"
        tree_args = (x, dt, B, C, z if z is not None else x, out, tree.cu_nodes, tree.parent, tree.depth)
    else:
        out = None
        tree_args = (state, state, state, state, state, state, state_idx, state_idx, state_idx)
    if pending is not None:
        pend_args = (pending.x, pending.dt, pending.B, pending.length, pending.max_len)
    else:
        pend_args = (state, state, state, state_idx, 0)
    mamba1_tree_step_kernel[(nB, triton.cdiv(Dn, BD))](
        *tree_args,
        A, f32(D) if D is not None else A, f32(dt_bias) if dt_bias is not None else A,
        state, state_idx, *state.stride(),
        *pend_args,
        Dn, N=N, NP=NP, BD=BD, BN=BN,
        HAS_TREE=tree is not None, HAS_PENDING=pending is not None, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), num_warps=num_warps,
    )
    return out
