"""Gated DeltaNet tree verification with the pending-path commit folded in (Triton).

One program per (request, value head, V tile of BV columns). It loads its tile of the request's
committed state S (fp32, [K, BV] addressed through strides, so FLA's [K, V] and vLLM's [V, K]
slot layouts both work) and:

1. commit (``HAS_PENDING``): if the slot holds a pending accepted path of m > 0 tokens (their own
   inputs k, v, g, beta from the previous step), rebuild S <- S after those m tokens with the
   chain closed form and write it back in place (one write per step);
2. verify (``HAS_TREE``): compute every tree node's output from S and the node's ancestors only,
   through the ancestor-masked WY/UT closed form

       G_i = sum_{j in anc*(i)} g_j,  A_ij = [j strict anc of i] beta_i e^{G_i - G_j} k_i.k_j
       d   = (I + A)^{-1} diag(beta) (V - diag(e^G) K S)
       o_i = scale (e^{G_i} S^T q_i + sum_{j in anc*(i)} e^{G_i - G_j} (q_i.k_j) d_j)

   No per-node K x V state is formed. (I + A)^{-1} is the Neumann series of the nilpotent A
   (A^{depth+1} = 0), evaluated by repeated squaring: (I - A)(I + A^2)(I + A^4)...

The per-(request, head) quantities (G, A, its inverse, the masked q.k matrix) are recomputed by
each V tile's program: that buys V / BV times more parallel programs for a few small matmuls.
Precision: dots take bf16 operands with fp32 accumulation when the inputs are 16-bit (FLA's chunk
kernels do the same, the state tile included) or the tree has over 64 nodes; fp32 (tf32 on
tensor cores) otherwise. The triangular inverse stays fp32 up to 64 nodes. The plain-torch twin is ``vllm_bole.mamba.gdn_tree``;
the accepted-path stash is the shared ``csrc_triton.tree_common.stash_kernel``.
"""
import os

import triton
import triton.language as tl

from csrc_triton.tree_common import anc_tile


@triton.jit
def _mm(a, b, LOWP: tl.constexpr):
    """a @ b with fp32 accumulation; bf16 operands when LOWP (trees over 64 nodes: the fp32
    operand tiles would not fit in shared memory; this is FLA chunk kernels' precision)."""
    if LOWP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a, b)


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, steps, LOWP: tl.constexpr):
    """(I + A)^{-1} for a strictly lower nilpotent A [BT, BT] with A^(2^(steps+1)) = 0."""
    o = tl.arange(0, BT)
    T = (o[:, None] == o[None, :]).to(tl.float32) - A
    P = A
    for _ in range(steps):
        P = _mm(P, P, LOWP)
        T = T + _mm(T, P, LOWP)
    return T


@triton.jit
def _load_qk(ptr, rows, row_mask, hk, Hk: tl.constexpr, K: tl.constexpr, USE_L2NORM: tl.constexpr):
    """Rows of a [*, Hk, K] tensor for key head hk, as fp32, optionally L2-normalised."""
    o_k = tl.arange(0, K)
    x = tl.load(ptr + (rows[:, None] * Hk + hk) * K + o_k[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    if USE_L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def gdn_tree_step_kernel(
    q, k, v, g, beta, o,  # tree inputs [T, Hk, K] x2, [T, Hv, V], [T, Hv] x2; o [T, Hv, V]
    cu_nodes, anc_mask, tree_steps,  # [B + 1] int32, [T, MW] int32, squarings for the tree inverse
    state, state_idx, s_slot, s_h, s_k, s_v,  # state[slot, h, k, v] through strides; state_idx [B]
    pk, pv, pg, pbeta, plen, P,  # pending path: [S, P, Hk, K], [S, P, Hv, V], [S, P, Hv] x2, [S]
    scale,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, DP: tl.constexpr, MW: tl.constexpr, STEPS_P: tl.constexpr,
    HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, USE_L2NORM: tl.constexpr, LOWP: tl.constexpr, INV_LOWP: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // Hv
    h = pid % Hv
    hk = h // (Hv // Hk)
    slot = tl.load(state_idx + b).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, BV)
    s_base = state + slot * s_slot + h * s_h

    if HAS_PENDING:
        m = tl.load(plen + slot)
        o_p = tl.arange(0, DP)
        pm = o_p < m
        prow = slot * P + o_p
        kp = _load_qk(pk, prow, pm, hk, Hk, K, USE_L2NORM)
        gp = tl.load(pg + prow * Hv + h, mask=pm, other=0.0).to(tl.float32)
        bp = tl.load(pbeta + prow * Hv + h, mask=pm, other=0.0).to(tl.float32)
        Mp = (o_p[None, :] <= o_p[:, None]) & pm[:, None] & pm[None, :]
        Gp = tl.sum(tl.where(Mp, gp[None, :], 0.0), axis=1)
        Gm = tl.sum(tl.where(o_p == m - 1, Gp, 0.0), axis=0)
        Ep = tl.exp(tl.where(Mp, Gp[:, None] - Gp[None, :], float("-inf")))
        strict_p = Mp & (o_p[:, None] != o_p[None, :])
        Ap = tl.where(strict_p, Ep * bp[:, None] * tl.dot(kp, tl.trans(kp)), 0.0)
        Tp = _unit_lower_inverse(Ap, DP, STEPS_P, False)
        kpw = kp * tl.where(pm, tl.exp(Gm - Gp), 0.0)[:, None]
        eGp = tl.exp(Gp)
        decay_m = tl.exp(Gm)

    if HAS_TREE:
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        o_t = tl.arange(0, BT)
        tm = o_t < n
        rows = (bos + o_t).to(tl.int64)
        qt = _load_qk(q, rows, tm, hk, Hk, K, USE_L2NORM)
        kt = _load_qk(k, rows, tm, hk, Hk, K, USE_L2NORM)
        gt = tl.load(g + rows * Hv + h, mask=tm, other=0.0).to(tl.float32)
        bt = tl.load(beta + rows * Hv + h, mask=tm, other=0.0).to(tl.float32)
        M = anc_tile(anc_mask, rows, o_t, tm, MW)
        G = tl.sum(tl.where(M, gt[None, :], 0.0), axis=1)
        E = tl.exp(tl.where(M, G[:, None] - G[None, :], float("-inf")))
        strict = M & (o_t[:, None] != o_t[None, :])
        A = tl.where(strict, E * bt[:, None] * _mm(kt, tl.trans(kt), LOWP), 0.0)
        T = _unit_lower_inverse(A, BT, tree_steps, INV_LOWP)
        QK = E * _mm(qt, tl.trans(kt), LOWP)
        eG = tl.exp(G)

    v0 = tl.program_id(1) * BV
    s_ptr = s_base + o_k[:, None] * s_k + (v0 + o_v)[None, :] * s_v
    S = tl.load(s_ptr)
    if HAS_PENDING:
        if m > 0:
            vp = tl.load(pv + (prow[:, None] * Hv + h) * V + v0 + o_v[None, :], mask=pm[:, None], other=0.0)
            Up = bp[:, None] * (vp.to(tl.float32) - eGp[:, None] * tl.dot(kp, S))
            dp = tl.dot(Tp, Up)
            S = decay_m * S + tl.dot(tl.trans(kpw), dp)
            tl.store(s_ptr, S)
    if HAS_TREE:
        vt = tl.load(v + (rows[:, None] * Hv + h) * V + v0 + o_v[None, :], mask=tm[:, None], other=0.0)
        U = bt[:, None] * (vt.to(tl.float32) - eG[:, None] * _mm(kt, S, LOWP))
        d = _mm(T, U, LOWP)
        out = scale * (eG[:, None] * _mm(qt, S, LOWP) + _mm(QK, d, LOWP))
        tl.store(o + (rows[:, None] * Hv + h) * V + v0 + o_v[None, :], out.to(o.dtype.element_ty), mask=tm[:, None])


def _squarings(max_path_len: int) -> int:
    """Squarings so that the product covers A^0 .. A^(max_path_len - 1)."""
    return max(int(max_path_len - 1).bit_length() - 1, 0)


def gdn_tree_step(q, k, v, g, beta, tree, state, state_idx, pending, scale, use_qk_l2norm, *, block_v=64, num_warps=None, num_stages=1, lowp=None, inv_lowp=None):
    """Launch ``gdn_tree_step_kernel``; arguments as ``vllm_bole.mamba.gdn_tree.gdn_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone.
    Returns ``o`` [T, Hv, V] in v's dtype (None without a tree). Defaults are the fastest
    correct configs of the H200 probe (benchmarks/device/probe_gdn_configs.py; BV=32 with bf16
    operands and 64+ node trees hit an illegal access in Triton 3.6's code, so BV=64). The commit
    alone is 13% faster with BV=128 (probe_gdn_commit.py) but the whole step was slower with it in
    bench_gdn_tree.py (B=1: too few programs; B=128, N=64: 0.618 against 0.591 ms), so BV=64 there too.
    """
    import torch

    Hv, K, V = state.shape[1:]
    B = state_idx.numel()
    if tree is not None:
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # dense rows assumed (no copy if they are)
        Hk = k.shape[1]
        T = q.shape[0]
        BT = max(16, triton.next_power_of_2(tree.max_nodes))
        o = torch.empty(T, Hv, V, dtype=v.dtype, device=v.device)
        tree_args = (q, k, v, g, beta, o, tree.cu_nodes, tree.anc_mask, _squarings(tree.max_depth + 1))
        MW = tree.anc_mask.shape[1]
    else:
        Hk = pending.k.shape[2]
        o, BT, MW = None, 16, 1
        dummy = state
        tree_args = (dummy, dummy, dummy, dummy, dummy, dummy, state_idx, state_idx, 0)
    if pending is not None:
        P = pending.k.shape[1]
        DP = max(16, triton.next_power_of_2(P))
        pend_args = (pending.k, pending.v, pending.g, pending.beta, pending.length, P)
    else:
        DP = 16
        pend_args = (state, state, state, state, state_idx, 0)
    BV = min(block_v, V)
    if lowp is None:
        lowp = BT >= 128 or (tree is not None and v.element_size() == 2)
    if inv_lowp is None:
        inv_lowp = lowp  # bf16 inverse: same error at 16-bit inputs (probe), 25% faster verify
    if num_warps is None:
        num_warps = 4 if BT <= 64 else 8
    kernel = gdn_tree_step_kernel[(B * Hv, V // BV)](
        *tree_args,
        state, state_idx, *state.stride(),
        *pend_args,
        scale,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=BT, BV=BV, DP=DP, MW=MW, STEPS_P=_squarings(P if pending is not None else 1),
        HAS_TREE=tree is not None, HAS_PENDING=pending is not None, USE_L2NORM=use_qk_l2norm, LOWP=lowp, INV_LOWP=inv_lowp,
        num_warps=num_warps, num_stages=num_stages,
    )
    if os.environ.get("BOLE_KERNEL_STATS"):
        print(f"gdn_tree_step_kernel BT={BT} DP={DP}: regs {kernel.n_regs} spills {kernel.n_spills} smem {kernel.metadata.shared}")
    return o
