"""Mamba2 / SSD tree verification with the pending-path commit folded in (Triton).

One program per (request, head h, P tile of BP columns). It loads its tile of the request's
committed state h0 ([BP, N] of ``state[slot, h]``, vLLM's ``[H, P, N]`` layout addressed through
strides, any float dtype, computed in fp32) and:

1. commit (``HAS_PENDING``): if the slot holds a pending accepted path of m > 0 tokens (their own
   inputs x, raw dt, B from the previous step), with a_j = dt_j A and Gp_j = a_1 + ... + a_j,

       h <- exp(Gp_m) h + sum_{j <= m} exp(Gp_m - Gp_j) dt_j x_j B_j^T

   and write it back in place (one write per step);
2. verify (``HAS_TREE``): every tree node's output from h and the node's ancestors only,

       G_i = sum_{j in anc*(i)} a_j
       y_i = exp(G_i) h C_i + sum_{j in anc*(i)} exp(G_i - G_j) (C_i . B_j) dt_j x_j + D x_i

   i.e. Y = diag(e^G) C h^T + (L o C B^T o dt^T) X + D X with L the ancestor-masked decay. No
   per-node state is formed and nothing needs inverting (the SSD recurrence has no delta rule).

dt_eff = clamp(softplus(dt + dt_bias) if DT_SOFTPLUS else dt + dt_bias, lo, hi) (the oracle's
convention; softplus threshold 20). Head h uses group h // (H // G). The group's C B^T is
recomputed by every (head, P tile) program: a [BT, N] x [N, BT] product, cheap against the
state tile's bytes. Precision: dots take bf16 operands with fp32 accumulation when the inputs
are 16-bit or the tree has over 64 nodes (the state tile is rounded to bf16 for the C h^T
product only), fp32 (tf32 on tensor cores) otherwise; the commit keeps fp32 operands and the
state stays fp32 in registers (``tree_common.mm``). The plain-torch twin is ``vllm_bole.mamba.ssd_tree``; the
accepted-path stash is the shared ``csrc_triton.tree_common.stash_kernel``.
"""
import os

import triton
import triton.language as tl

from csrc_triton.tree_common import INTERPRET, anc_tile, mm


@triton.jit
def _dt_eff(dt, dt_bias_h, lo, hi, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    d = dt.to(tl.float32)
    if HAS_DT_BIAS:
        d = d + dt_bias_h
    if DT_SOFTPLUS:
        d = tl.where(d <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    return tl.minimum(tl.maximum(d, lo), hi)


@triton.jit
def ssd_tree_step_kernel(
    x, dt, Bm, Cm, y,  # tree inputs [T, H, P], [T, H], [T, G, N] x2; y [T, H, P]
    cu_nodes, anc_mask,  # [B + 1] int32, [T, MW] int32
    A, D, dt_bias, dt_lo, dt_hi,  # [H] fp32 (D, dt_bias: dummies when absent), dt clamp
    state, state_idx, s_slot, s_h, s_p, s_n,  # state[slot, h, p, n] through strides; state_idx [B]
    px, pdt, pB, plen, L,  # pending path: [S, L, H, P], [S, L, H], [S, L, G, N], [S]
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, MW: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, LOWP: tl.constexpr, BF16_EMUL: tl.constexpr, EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    g = h // (H // G)
    slot = tl.load(state_idx + b).to(tl.int64)
    o_n = tl.arange(0, BN)
    nm = o_n < N
    o_p = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = o_p < P
    A_h = tl.load(A + h).to(tl.float32)
    bias_h = 0.0
    if HAS_DT_BIAS:
        bias_h = tl.load(dt_bias + h).to(tl.float32)

    s_ptr = state + slot * s_slot + h * s_h + o_p[:, None] * s_p + o_n[None, :] * s_n
    s_mask = pmask[:, None] & nm[None, :]
    if EVEN:  # unmasked state tile (P % BP == 0, N a power of two): plain vector loads/stores
        S = tl.load(s_ptr).to(tl.float32)  # [BP, BN]
    else:
        S = tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32)

    if HAS_PENDING:
        m = tl.load(plen + slot)
        if m > 0:
            o_j = tl.arange(0, DP)
            jm = o_j < m
            prow = slot * L + o_j
            dtp = _dt_eff(tl.load(pdt + prow * H + h, mask=jm, other=0.0), bias_h, dt_lo, dt_hi, HAS_DT_BIAS, DT_SOFTPLUS)
            dtp = tl.where(jm, dtp, 0.0)
            Gp = tl.cumsum(dtp * A_h, axis=0)
            Gm = tl.sum(tl.where(o_j == m - 1, Gp, 0.0), axis=0)
            w = tl.where(jm, tl.exp(Gm - Gp) * dtp, 0.0)
            Xp = tl.load(px + (prow[:, None] * H + h) * P + o_p[None, :], mask=jm[:, None] & pmask[None, :], other=0.0)
            Bp = tl.load(pB + (prow[:, None] * G + g) * N + o_n[None, :], mask=jm[:, None] & nm[None, :], other=0.0)
            S = tl.exp(Gm) * S + tl.dot(tl.trans(Xp.to(tl.float32) * w[:, None]), Bp.to(tl.float32))
            if EVEN:
                tl.store(s_ptr, S.to(state.dtype.element_ty))
            else:
                tl.store(s_ptr, S.to(state.dtype.element_ty), mask=s_mask)

    if HAS_TREE:
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        o_t = tl.arange(0, BT)
        tm = o_t < n
        rows = (bos + o_t).to(tl.int64)
        M = anc_tile(anc_mask, rows, o_t, tm, MW)
        dtt = _dt_eff(tl.load(dt + rows * H + h, mask=tm, other=0.0), bias_h, dt_lo, dt_hi, HAS_DT_BIAS, DT_SOFTPLUS)
        dtt = tl.where(tm, dtt, 0.0)
        Gt = tl.sum(tl.where(M, (dtt * A_h)[None, :], 0.0), axis=1)
        bc_mask = tm[:, None] & nm[None, :]
        Ct = tl.load(Cm + (rows[:, None] * G + g) * N + o_n[None, :], mask=bc_mask, other=0.0)
        Bt = tl.load(Bm + (rows[:, None] * G + g) * N + o_n[None, :], mask=bc_mask, other=0.0)
        CB = mm(Ct, tl.trans(Bt), LOWP, BF16_EMUL)
        W = tl.exp(tl.where(M, Gt[:, None] - Gt[None, :], float("-inf"))) * dtt[None, :] * CB
        x_mask = tm[:, None] & pmask[None, :]
        x_off = (rows[:, None] * H + h) * P + o_p[None, :]
        Xt = tl.load(x + x_off, mask=x_mask, other=0.0)
        out = tl.exp(Gt)[:, None] * mm(Ct, tl.trans(S), LOWP, BF16_EMUL) + mm(W, Xt, LOWP, BF16_EMUL)
        if HAS_D:
            out += tl.load(D + h).to(tl.float32) * Xt.to(tl.float32)
        tl.store(y + x_off, out.to(y.dtype.element_ty), mask=x_mask)


def ssd_tree_step(x, dt, A, B, C, tree, state, state_idx, pending, D, dt_bias, dt_softplus, dt_limit, out=None,
                  *, block_p=64, num_warps=None, num_stages=1, lowp=None):
    """Launch ``ssd_tree_step_kernel``; arguments as ``vllm_bole.mamba.ssd_tree.ssd_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone.
    Returns y [T, H, P] in x's dtype (``out`` if given; None without a tree).
    """
    import torch

    H, P, N = state.shape[1:]
    nB = state_idx.numel()
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    A = f32(A)
    if tree is not None:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))  # the kernel assumes dense rows (no copy if they are)
        G = B.shape[1]
        T = x.shape[0]
        BT = max(16, triton.next_power_of_2(tree.max_nodes))
        if out is None:
            out = torch.empty(T, H, P, dtype=x.dtype, device=x.device)
        tree_args = (x, dt, B, C, out, tree.cu_nodes, tree.anc_mask)
        MW = tree.anc_mask.shape[1]
    else:
        G = pending.B.shape[2]
        out, BT, MW = None, 16, 1
        tree_args = (state, state, state, state, state, state_idx, state_idx)
    if pending is not None:
        Lmax = pending.max_len
        DP = max(16, triton.next_power_of_2(Lmax))
        pend_args = (pending.x, pending.dt, pending.B, pending.length, Lmax)
    else:
        DP = 16
        pend_args = (state, state, state, state_idx, 0)
    BP = min(block_p, triton.next_power_of_2(P))
    BN = triton.next_power_of_2(N)
    if lowp is None:
        lowp = BT >= 128 or (tree is not None and x.element_size() == 2)
    if num_warps is None:
        num_warps = 4 if BT <= 64 else 8
    kernel = ssd_tree_step_kernel[(nB * H, triton.cdiv(P, BP))](
        *tree_args,
        A, f32(D) if D is not None else A, f32(dt_bias) if dt_bias is not None else A,
        float(dt_limit[0]), float(dt_limit[1]),
        state, state_idx, *state.stride(),
        *pend_args,
        H=H, G=G, P=P, N=N, BT=BT, BP=BP, BN=BN, DP=DP, MW=MW, EVEN=P % BP == 0 and BN == N,
        HAS_TREE=tree is not None, HAS_PENDING=pending is not None, HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), LOWP=lowp, BF16_EMUL=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
    if os.environ.get("BOLE_KERNEL_STATS"):
        print(f"ssd_tree_step_kernel BT={BT} DP={DP} BP={BP}: regs {kernel.n_regs} spills {kernel.n_spills} smem {kernel.metadata.shared}")
    return out
