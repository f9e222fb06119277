"""Gated DeltaNet tree verification with the pending-path commit folded in (Triton).

One program per (request, value head). It loads the request's committed state S (fp32,
[K, V] addressed through strides, so FLA's [K, V] and vLLM's [V, K] slot layouts both work)
tile by tile along V and, per tile:

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

The per-request / per-head quantities (G, A, its inverse, the masked q.k matrix) are computed
once per program before the V loop. The plain-torch twin is ``vllm_bole.mamba.gdn_tree``.
"""
import triton
import triton.language as tl


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, steps):
    """(I + A)^{-1} for a strictly lower nilpotent A [BT, BT] with A^(2^(steps+1)) = 0."""
    o = tl.arange(0, BT)
    T = (o[:, None] == o[None, :]).to(tl.float32) - A
    P = A
    for _ in range(steps):
        P = tl.dot(P, P)
        T = T + tl.dot(T, P)
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
    HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, USE_L2NORM: tl.constexpr,
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
        Tp = _unit_lower_inverse(Ap, DP, STEPS_P)
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
        word = tl.load(anc_mask + rows[:, None] * MW + (o_t // 32)[None, :], mask=tm[:, None] & tm[None, :], other=0)
        M = (((word >> (o_t % 32)[None, :]) & 1) != 0) & tm[:, None] & tm[None, :]
        G = tl.sum(tl.where(M, gt[None, :], 0.0), axis=1)
        E = tl.exp(tl.where(M, G[:, None] - G[None, :], float("-inf")))
        strict = M & (o_t[:, None] != o_t[None, :])
        A = tl.where(strict, E * bt[:, None] * tl.dot(kt, tl.trans(kt)), 0.0)
        T = _unit_lower_inverse(A, BT, tree_steps)
        QK = E * tl.dot(qt, tl.trans(kt))
        eG = tl.exp(G)

    for v0 in range(0, V, BV):
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
            U = bt[:, None] * (vt.to(tl.float32) - eG[:, None] * tl.dot(kt, S))
            d = tl.dot(T, U)
            out = scale * (eG[:, None] * tl.dot(qt, S) + tl.dot(QK, d))
            tl.store(o + (rows[:, None] * Hv + h) * V + v0 + o_v[None, :], out.to(o.dtype.element_ty), mask=tm[:, None])


def _squarings(max_path_len: int) -> int:
    """Squarings so that the product covers A^0 .. A^(max_path_len - 1)."""
    return max(int(max_path_len - 1).bit_length() - 1, 0)


def gdn_tree_step(q, k, v, g, beta, tree, state, state_idx, pending, scale, use_qk_l2norm, *, block_v=32, num_warps=8):
    """Launch ``gdn_tree_step_kernel``; arguments as ``vllm_bole.mamba.gdn_tree.gdn_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone.
    Returns ``o`` [T, Hv, V] in v's dtype (None without a tree).
    """
    import torch

    Hv, K, V = state.shape[1:]
    B = state_idx.numel()
    if tree is not None:
        Hk = k.shape[1]
        T = q.shape[0]
        max_n = int(tree.nodes_per_request.max())
        BT = max(16, triton.next_power_of_2(max_n))
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
    gdn_tree_step_kernel[(B * Hv,)](
        *tree_args,
        state, state_idx, *state.stride(),
        *pend_args,
        scale,
        Hk=Hk, Hv=Hv, K=K, V=V, BT=BT, BV=min(block_v, V), DP=DP, MW=MW, STEPS_P=_squarings(P if pending is not None else 1),
        HAS_TREE=tree is not None, HAS_PENDING=pending is not None, USE_L2NORM=use_qk_l2norm,
        num_warps=num_warps,
    )
    return o
