"""Gated DeltaNet tree verification and pending-path commit (Triton): two kernels.

Both address the committed state S [K, V] of ``state[slot, h]`` through strides (FLA's [K, V]
and vLLM's [V, K] slot layouts both work), load it as fp32 whatever its dtype (fp32, bf16,
fp16) and store it back in its own dtype. One program per (request, value head, V tile of BV
columns).

``gdn_commit_kernel``: if the slot holds a pending accepted path of m > 0 tokens (their own
inputs k, v, g, beta from the previous step), S <- S after those m tokens, in place. The path is
a chain, processed in chunks of CP tokens with the chunked WY/UT form (FLA's
``chunk_gated_delta_rule`` update): per chunk, with Gp the within-chunk cumulative log decay,

    Ap = [j < i] beta_i e^{Gp_i - Gp_j} k_i.k_j,   dp = (I + Ap)^{-1} diag(beta) (V - diag(e^Gp) K S)
    S  <- e^{Gp_last} S + sum_j e^{Gp_last - Gp_j} k_j dp_j^T.

``gdn_verify_kernel``: every tree node's output from S and the node's ancestors only, through the
ancestor-masked WY/UT closed form (no per-node K x V state):

    G_i = sum_{j in anc*(i)} g_j,  A_ij = [j strict anc of i] beta_i e^{G_i - G_j} k_i.k_j
    d   = (I + A)^{-1} diag(beta) (V - diag(e^G) K S)
    o_i = scale (e^{G_i} S^T q_i + sum_{j in anc*(i)} e^{G_i - G_j} (q_i.k_j) d_j)

The tree's nodes are taken in row blocks of BR (topological order, so A is block lower
triangular). Trees of at most BR nodes (BR = 64 for K <= 128) are one block: everything stays on
chip. Larger trees (up to 256 nodes) run a blocked forward substitution: block i gathers
sum_{j<i} A_ij d_j and sum_{j<i} (e^{G_i - G_j} q_i.k_j) d_j from the earlier blocks (their d in a
global fp32 scratch [T, Hv, V], and their G, written and read back by the same program after a
barrier), then
d_i = (I + A_ii)^{-1} (U_i - sum_{j<i} A_ij d_j). Diagonal blocks are inverted as the Neumann
series of the nilpotent A_ii ((I - A)(I + A^2)(I + A^4)..., ``tiles.unit_lower_inverse``).
G of a block is summed from the ancestor mask over the blocks at or before it.

Precision: fp32 inputs -> fp32 operands (tf32 tensor-core products on the GPU, exact fp32 in the
interpreter); 16-bit inputs -> bf16 operands with fp32 accumulation (``LOWP``; FLA's chunk
kernels do the same, the state tile included), emulated exactly under the interpreter
(``tiles.mm``). The commit always uses fp32 operands. Shared memory on the H200 (227 KB):
the launcher keeps every operand tile at most [64, 128] fp32 (BR = CP = 32, BV = 32 when K = 256).
API and dispatch: ``vllm_bole.gdn``; plain-torch twin: ``vllm_bole/gdn/naive.py``; float64
reference: ``vllm_bole/gdn/reference.py``; the accepted-path stash: ``csrc_triton.pending_stash``.
"""
import triton
import triton.language as tl

from csrc_triton.tiles import INTERPRET, anc_tile, mm, program_head, squarings, unit_lower_inverse

MAX_BLOCK_R = 64  # node rows per block (trees of up to this many nodes run as one block)


@triton.jit
def _load_qk(ptr, rows, row_mask, hk, Hk: tl.constexpr, K: tl.constexpr, USE_L2NORM: tl.constexpr):
    """Rows of a [*, Hk, K] tensor for key head hk, as fp32, optionally L2-normalised."""
    o_k = tl.arange(0, K)
    x = tl.load(ptr + (rows[:, None] * Hk + hk) * K + o_k[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    if USE_L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def gdn_commit_kernel(
    state, state_idx, s_slot, s_h, s_k, s_v,  # state[slot, h, k, v] through strides; state_idx [B]
    pk, pv, pg, pbeta, plen, pidx, P,  # pending path: [R, P, Hk, K], [R, P, Hv, V], [R, P, Hv] x2, [R]; rows [B]
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BV: tl.constexpr, CP: tl.constexpr, STEPS: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    b, h, hk, slot = program_head(state_idx, Hv, Hk)
    row = tl.load(pidx + b).to(tl.int64)
    m = tl.load(plen + row)
    if m > 0:
        o_k = tl.arange(0, K)
        o_v = tl.program_id(1) * BV + tl.arange(0, BV)
        s_ptr = state + slot * s_slot + h * s_h + o_k[:, None] * s_k + o_v[None, :] * s_v
        S = tl.load(s_ptr).to(tl.float32)
        o_c = tl.arange(0, CP)
        for c0 in range(0, m, CP):
            o_p = c0 + o_c
            pm = o_p < m
            prow = row * P + o_p
            kp = _load_qk(pk, prow, pm, hk, Hk, K, USE_L2NORM)
            gp = tl.load(pg + prow * Hv + h, mask=pm, other=0.0).to(tl.float32)
            bp = tl.load(pbeta + prow * Hv + h, mask=pm, other=0.0).to(tl.float32)
            Mp = (o_c[None, :] <= o_c[:, None]) & pm[:, None] & pm[None, :]
            Gp = tl.sum(tl.where(Mp, gp[None, :], 0.0), axis=1)
            Gm = tl.sum(tl.where(o_p == tl.minimum(m, c0 + CP) - 1, Gp, 0.0), axis=0)
            Ep = tl.exp(tl.where(Mp, Gp[:, None] - Gp[None, :], float("-inf")))
            strict = Mp & (o_c[:, None] != o_c[None, :])
            Ap = tl.where(strict, Ep * bp[:, None] * tl.dot(kp, tl.trans(kp)), 0.0)
            Tp = unit_lower_inverse(Ap, CP, STEPS, False, False)
            vp = tl.load(pv + (prow[:, None] * Hv + h) * V + o_v[None, :], mask=pm[:, None], other=0.0)
            Up = bp[:, None] * (vp.to(tl.float32) - tl.exp(Gp)[:, None] * tl.dot(kp, S))
            dp = tl.dot(Tp, Up)
            kpw = kp * tl.where(pm, tl.exp(Gm - Gp), 0.0)[:, None]
            S = tl.exp(Gm) * S + tl.dot(tl.trans(kpw), dp)
        tl.store(s_ptr, S.to(state.dtype.element_ty))


@triton.jit
def _block_G(g, anc_mask, bos, n, rows, row_ok, nblk, h, Hv: tl.constexpr, BR: tl.constexpr, MW: tl.constexpr):
    """G[r] = sum of g over the ancestors-or-self of flat node rows[r], all in blocks < nblk."""
    o_c = tl.arange(0, BR)
    G = tl.zeros([BR], dtype=tl.float32)
    for cb in range(0, nblk):
        cols = cb * BR + o_c
        cm = cols < n
        M = anc_tile(anc_mask, rows, row_ok, cols, cm, MW)
        gc = tl.load(g + (bos + cols).to(tl.int64) * Hv + h, mask=cm, other=0.0).to(tl.float32)
        G += tl.sum(tl.where(M, gc[None, :], 0.0), axis=1)
    return G


@triton.jit
def _verify_block(
    ib, q, k, v, g, beta, o, dscr, gscr, anc_mask, bos, n, h, hk, o_v, S, scale, inv_steps,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    MW: tl.constexpr,
    MULTI: tl.constexpr, USE_L2NORM: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr, INV_LOWP: tl.constexpr,
):
    """Outputs of row block ib (and, MULTI, its d into the scratch) for one V tile."""
    o_r = tl.arange(0, BR)
    ri = ib * BR + o_r
    mi = ri < n
    rows_i = (bos + ri).to(tl.int64)
    q_i = _load_qk(q, rows_i, mi, hk, Hk, K, USE_L2NORM)
    k_i = _load_qk(k, rows_i, mi, hk, Hk, K, USE_L2NORM)
    b_i = tl.load(beta + rows_i * Hv + h, mask=mi, other=0.0).to(tl.float32)
    G_i = _block_G(g, anc_mask, bos, n, rows_i, mi, ib + 1, h, Hv, BR, MW)
    acc = tl.zeros([BR, BV], dtype=tl.float32)  # sum_{j < block} A_ij d_j
    oacc = tl.zeros([BR, BV], dtype=tl.float32)  # sum_{j < block} e^{G_i - G_j} (q_i.k_j) d_j
    if MULTI:
        for jb in range(0, ib):
            rj = jb * BR + o_r
            mj = rj < n
            rows_j = (bos + rj).to(tl.int64)
            k_j = _load_qk(k, rows_j, mj, hk, Hk, K, USE_L2NORM)
            G_j = tl.load(gscr + rows_j * Hv + h, mask=mj, other=0.0)
            M = anc_tile(anc_mask, rows_i, mi, rj, mj, MW)
            E = tl.exp(tl.where(M, G_i[:, None] - G_j[None, :], float("-inf")))
            d_j = tl.load(dscr + (rows_j[:, None] * Hv + h) * V + o_v[None, :], mask=mj[:, None], other=0.0)
            A = E * b_i[:, None] * mm(k_i, tl.trans(k_j), LOWP, EMUL)
            acc += mm(A, d_j, LOWP, EMUL)
            oacc += mm(E * mm(q_i, tl.trans(k_j), LOWP, EMUL), d_j, LOWP, EMUL)
    M = anc_tile(anc_mask, rows_i, mi, ri, mi, MW)
    E = tl.exp(tl.where(M, G_i[:, None] - G_i[None, :], float("-inf")))
    strict = M & (o_r[:, None] != o_r[None, :])
    A = tl.where(strict, E * b_i[:, None] * mm(k_i, tl.trans(k_i), LOWP, EMUL), 0.0)
    T = unit_lower_inverse(A, BR, inv_steps, INV_LOWP, EMUL)
    eG = tl.exp(G_i)
    v_i = tl.load(v + (rows_i[:, None] * Hv + h) * V + o_v[None, :], mask=mi[:, None], other=0.0).to(tl.float32)
    U = b_i[:, None] * (v_i - eG[:, None] * mm(k_i, S, LOWP, EMUL)) - acc
    d_i = mm(T, U, LOWP, EMUL)
    if MULTI:
        tl.store(dscr + (rows_i[:, None] * Hv + h) * V + o_v[None, :], d_i, mask=mi[:, None])
        tl.store(gscr + rows_i * Hv + h, G_i, mask=mi)
        tl.debug_barrier()  # later blocks of this program read d_i and G_i back
    QK = E * mm(q_i, tl.trans(k_i), LOWP, EMUL)
    out = scale * (eG[:, None] * mm(q_i, S, LOWP, EMUL) + oacc + mm(QK, d_i, LOWP, EMUL))
    tl.store(o + (rows_i[:, None] * Hv + h) * V + o_v[None, :], out.to(o.dtype.element_ty), mask=mi[:, None])


@triton.jit
def gdn_verify_kernel(
    q, k, v, g, beta, o, dscr, gscr,  # [T, Hk, K] x2, [T, Hv, V], [T, Hv] x2; o [T, Hv, V]
    # MULTI only, fp32 scratch: dscr [T, Hv, V] (d), gscr [V // BV, T, Hv] (G, one copy per V tile)
    cu_nodes, anc_mask, inv_steps, T,  # [B + 1] int32, [T, MW] int32, squarings of a diagonal block's inverse
    state, state_idx, s_slot, s_h, s_k, s_v,  # state[slot, h, k, v] through strides; state_idx [B]
    scale,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BR: tl.constexpr, BV: tl.constexpr, MW: tl.constexpr, MULTI: tl.constexpr,
    USE_L2NORM: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr, INV_LOWP: tl.constexpr,
):
    b, h, hk, slot = program_head(state_idx, Hv, Hk)
    bos = tl.load(cu_nodes + b)
    n = tl.load(cu_nodes + b + 1) - bos
    o_k = tl.arange(0, K)
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    S = tl.load(state + slot * s_slot + h * s_h + o_k[:, None] * s_k + o_v[None, :] * s_v).to(tl.float32)
    gscr += tl.program_id(1).to(tl.int64) * T * Hv
    if MULTI:
        for ib in range(0, tl.cdiv(n, BR)):
            _verify_block(ib, q, k, v, g, beta, o, dscr, gscr, anc_mask, bos, n, h, hk, o_v, S, scale, inv_steps,
                          Hk, Hv, K, V, BR, BV, MW, True, USE_L2NORM, LOWP, EMUL, INV_LOWP)
    else:
        _verify_block(0, q, k, v, g, beta, o, dscr, gscr, anc_mask, bos, n, h, hk, o_v, S, scale, inv_steps,
                      Hk, Hv, K, V, BR, BV, MW, False, USE_L2NORM, LOWP, EMUL, INV_LOWP)


def _pow2_divisor(x: int, cap: int) -> int:
    """The largest power of two <= cap dividing x."""
    d = 1
    while d * 2 <= cap and x % (d * 2) == 0:
        d *= 2
    return d


def gdn_commit(state, state_idx, pending, use_qk_l2norm, pending_idx=None, *, block_v=None, block_c=None, num_warps=4):
    """Launch ``gdn_commit_kernel`` (arguments as ``vllm_bole.gdn.gdn_commit_pending``).
    Defaults: BV = 64 (32 when K = 256), chunks of CP = 32 tokens (16 for paths of <= 16).
    """
    Hv, K, V = state.shape[1:]
    B = state_idx.numel()
    P = pending.k.shape[1]
    BV = _pow2_divisor(V, block_v or (32 if K > 128 else 64))
    CP = block_c or min(32, max(16, triton.next_power_of_2(P)))
    gdn_commit_kernel[(B * Hv, V // BV)](
        state, state_idx, *state.stride(),
        pending.k, pending.v, pending.g, pending.beta, pending.length,
        state_idx if pending_idx is None else pending_idx, P,
        Hk=pending.k.shape[2], Hv=Hv, K=K, V=V, BV=BV, CP=CP, STEPS=squarings(min(CP, P)),
        USE_L2NORM=use_qk_l2norm, num_warps=num_warps, num_stages=1,
    )


def gdn_verify(q, k, v, g, beta, tree, state, state_idx, scale, use_qk_l2norm, out=None, *,
               block_r=None, block_v=None, num_warps=None, lowp=None, inv_lowp=None):
    """Launch ``gdn_verify_kernel``; arguments as ``vllm_bole.gdn.gdn_tree_step``.
    Returns o [T, Hv, V] in v's dtype (``out`` if given: contiguous).

    Defaults: trees of up to 64 nodes (32 when K = 256) are one block of BR = that size rounded
    up to a power of two (>= 16); larger trees run blocks of BR = 32. BV = 64 (32 when K = 256):
    the fastest correct config of the H200 probe at 64 nodes (benchmarks/device/
    probe_gdn_configs.py; BV = 32 with bf16 operands hit an illegal access in Triton 3.6).
    ``lowp`` (bf16 operands) defaults to 16-bit inputs, ``inv_lowp`` (bf16 inverse) to ``lowp``.
    Warps: 4 for one block, 8 for the blocked form (fewer spills: benchmarks/device/probe_kernel_smem.py).
    """
    import torch

    Hv, K, V = state.shape[1:]
    B = state_idx.numel()
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # dense rows assumed (no copy if they are)
    T = q.shape[0]
    BT = max(16, triton.next_power_of_2(tree.max_nodes))
    one_block = MAX_BLOCK_R if K <= 128 else 32
    BR = min(BT, block_r) if block_r else (BT if BT <= one_block else 32)
    multi = BT > BR
    BV = _pow2_divisor(V, block_v or (32 if K > 128 else 64))
    o = torch.empty(T, Hv, V, dtype=v.dtype, device=v.device) if out is None else out
    assert o.is_contiguous(), "out must be contiguous"
    dscr = torch.empty(T, Hv, V, dtype=torch.float32, device=v.device) if multi else o
    gscr = torch.empty(V // BV, T, Hv, dtype=torch.float32, device=v.device) if multi else o
    if lowp is None:
        lowp = v.element_size() == 2
    if inv_lowp is None:
        inv_lowp = lowp  # bf16 inverse: same error at 16-bit inputs (probe), 25% faster verify
    gdn_verify_kernel[(B * Hv, V // BV)](
        q, k, v, g, beta, o, dscr, gscr, tree.cu_nodes, tree.anc_mask, squarings(min(BR, tree.max_depth + 1)), T,
        state, state_idx, *state.stride(), scale,
        Hk=k.shape[1], Hv=Hv, K=K, V=V, BR=BR, BV=BV, MW=tree.anc_mask.shape[1], MULTI=multi,
        USE_L2NORM=use_qk_l2norm, LOWP=bool(lowp), EMUL=INTERPRET, INV_LOWP=bool(inv_lowp),
        num_warps=num_warps or (8 if multi else 4), num_stages=1,
    )
    return o
