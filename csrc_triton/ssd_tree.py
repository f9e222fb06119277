"""Mamba2 / SSD tree verification with the pending-path commit folded in (Triton).

One program per (request, head h, P tile of BP columns). It loads its tile of the request's
committed state h0 ([BP, N] of ``state[slot, h]``, vLLM's ``[H, P, N]`` layout addressed through
strides, any float dtype, computed in fp32) and:

1. commit (``HAS_PENDING``): if the slot holds a pending accepted path of m > 0 tokens (their own
   inputs x, raw dt, B from the previous step), in chunks of CP tokens, each from the state after
   the previous chunk: with a_j = dt_j A and Gp_j = the within-chunk cumulative sum of a,

       h <- exp(Gp_last) h + sum_{j in chunk} exp(Gp_last - Gp_j) dt_j x_j B_j^T

   and write it back in place (one write per step);
2. verify (``HAS_TREE``): every tree node's output from h and the node's ancestors only,

       G_i = sum_{j in anc*(i)} a_j
       y_i = exp(G_i) h C_i + sum_{j in anc*(i)} exp(G_i - G_j) (C_i . B_j) dt_j x_j + D x_i

   i.e. Y = diag(e^G) C h^T + (L o C B^T o dt^T) X + D X with L the ancestor-masked decay. No
   per-node state is formed and nothing needs inverting (the SSD recurrence has no delta rule).
   Nodes go in row blocks of BR (topological order: block i only reads blocks j <= i). A tree
   of at most BR = 32 nodes is one block; larger trees (up to 256 nodes) loop over blocks, each
   block's G kept in a small fp32 scratch for the later blocks (written and read back by the same
   program after a barrier).

dt_eff = clamp(softplus(dt + dt_bias) if DT_SOFTPLUS else dt + dt_bias, lo, hi) (the oracle's
convention; softplus threshold 20). Head h uses group h // (H // G). The group's C B^T tiles (a
[BR, N] x [N, BR] product per block pair) come from ``ssd_cb_kernel``, one launch before the step,
for blocked trees, and are computed by every (head, P tile) program for trees of one block (the
launcher's ``shared_cb``). Precision: fp32 inputs -> fp32 operands (tf32 tensor-core
products on the GPU, exact fp32 in the interpreter); 16-bit inputs -> bf16 operands with fp32
accumulation (the state tile rounded to bf16 for the C h^T product only), emulated exactly under
the interpreter (``tiles.mm``); the commit keeps fp32 operands and the state stays fp32 in
registers, stored in its own dtype. Shared memory on the H200 (227 KB): operand tiles stay at
most [64, 128] fp32 (BP = BR = 32 when d_state = 256). API and dispatch:
``vllm_bole.mamba.ssd_tree``; plain-torch twin: its ``naive.py``; float64 reference: its
``reference.py``; the accepted-path stash: ``csrc_triton.pending_stash``.
"""
import triton
import triton.language as tl

from csrc_triton.tiles import INTERPRET, anc_tile, mm, num_sms, program_head


@triton.jit
def _dt_eff(dt, dt_bias_h, lo, hi, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    d = dt.to(tl.float32)
    if HAS_DT_BIAS:
        d = d + dt_bias_h
    if DT_SOFTPLUS:
        d = tl.where(d <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    return tl.minimum(tl.maximum(d, lo), hi)


@triton.jit
def _block_G(dt, anc_mask, bos, n, rows, row_ok, nblk, h, A_h, bias_h, lo, hi, H: tl.constexpr, BR: tl.constexpr,
             MW: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """G[r] = sum of dt_eff A over the ancestors-or-self of flat node rows[r], all in blocks < nblk."""
    o_c = tl.arange(0, BR)
    G = tl.zeros([BR], dtype=tl.float32)
    for cb in range(0, nblk):
        cols = cb * BR + o_c
        cm = cols < n
        M = anc_tile(anc_mask, rows, row_ok, cols, cm, MW)
        d = _dt_eff(tl.load(dt + (bos + cols).to(tl.int64) * H + h, mask=cm, other=0.0), bias_h, lo, hi,
                    HAS_DT_BIAS, DT_SOFTPLUS)
        G += tl.sum(tl.where(M, tl.where(cm, d * A_h, 0.0)[None, :], 0.0), axis=1)
    return G


@triton.jit
def _group_rows(ptr, rows, row_ok, g, G: tl.constexpr, N: tl.constexpr, o_n, nm):
    """Rows ``rows`` of a [*, G, N] tensor (B or C) for group g: [len(rows), BN], 0 where masked."""
    return tl.load(ptr + (rows[:, None] * G + g) * N + o_n[None, :], mask=row_ok[:, None] & nm[None, :], other=0.0)


@triton.jit
def ssd_cb_kernel(Bm, Cm, cb, cu_nodes, npair, G: tl.constexpr, N: tl.constexpr, BR: tl.constexpr,
                  BN: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr):
    """The group's C_i B_j^T tiles of a blocked tree, once per (request, group) instead of once per head:
    program (b * G + g, row block ib) writes the [BR, BR] fp32 tiles of the block pairs (ib, jb <= ib) into
    ``cb`` [B, G, npair, BR, BR] at pair ib (ib + 1) / 2 + jb (npair = NB (NB + 1) / 2 for NB row blocks)."""
    pid = tl.program_id(0)
    b, g, ib = pid // G, pid % G, tl.program_id(1)
    bos = tl.load(cu_nodes + b)
    n = tl.load(cu_nodes + b + 1) - bos
    if ib * BR < n:
        o_r = tl.arange(0, BR)
        o_n = tl.arange(0, BN)
        nm = o_n < N
        ri = ib * BR + o_r
        mi = ri < n
        rows_i = (bos + ri).to(tl.int64)
        C_i = _group_rows(Cm, rows_i, mi, g, G, N, o_n, nm)
        base = cb + (pid.to(tl.int64) * npair + ib * (ib + 1) // 2) * BR * BR + o_r[:, None] * BR + o_r[None, :]
        for jb in range(0, ib + 1):
            rj = jb * BR + o_r
            tile = _cb_tile(Bm, C_i, cb, (bos + rj).to(tl.int64), rj < n, ib, jb, g, o_n, nm, G, N, BR, False, LOWP,
                            EMUL)
            tl.store(base + jb * BR * BR, tile)


@triton.jit
def _cb_tile(Bm, C_i, cb_base, rows_j, mj, ib, jb, g, o_n, nm, G: tl.constexpr, N: tl.constexpr, BR: tl.constexpr,
             HAS_CB: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr):
    """C_i B_j^T [BR, BR] of block pair (ib, jb): read from ``ssd_cb_kernel``'s tiles (HAS_CB) or computed here."""
    if HAS_CB:
        o_r = tl.arange(0, BR)
        return tl.load(cb_base + (ib * (ib + 1) // 2 + jb) * BR * BR + o_r[:, None] * BR + o_r[None, :])
    return mm(C_i, tl.trans(_group_rows(Bm, rows_j, mj, g, G, N, o_n, nm)), LOWP, EMUL)


@triton.jit
def _verify_block(
    ib, x, dt, Bm, Cm, y, gscr, cb_base, anc_mask, bos, n, h, g, S, A_h, bias_h, lo, hi, D_h, o_p, pmask, o_n, nm,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BR: tl.constexpr, MW: tl.constexpr,
    MULTI: tl.constexpr, HAS_CB: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr,
):
    """Outputs of row block ib for one P tile (MULTI: its G into the scratch for later blocks; HAS_CB: the
    group's C B^T tiles from ``ssd_cb_kernel``)."""
    o_r = tl.arange(0, BR)
    ri = ib * BR + o_r
    mi = ri < n
    rows_i = (bos + ri).to(tl.int64)
    G_i = _block_G(dt, anc_mask, bos, n, rows_i, mi, ib + 1, h, A_h, bias_h, lo, hi, H, BR, MW, HAS_DT_BIAS, DT_SOFTPLUS)
    C_i = _group_rows(Cm, rows_i, mi, g, G, N, o_n, nm)
    out = tl.exp(G_i)[:, None] * mm(C_i, tl.trans(S), LOWP, EMUL)
    if MULTI:
        for jb in range(0, ib):
            rj = jb * BR + o_r
            mj = rj < n
            rows_j = (bos + rj).to(tl.int64)
            G_j = tl.load(gscr + rows_j * H + h, mask=mj, other=0.0)
            dt_j = tl.where(mj, _dt_eff(tl.load(dt + rows_j * H + h, mask=mj, other=0.0), bias_h, lo, hi,
                                        HAS_DT_BIAS, DT_SOFTPLUS), 0.0)
            X_j = tl.load(x + (rows_j[:, None] * H + h) * P + o_p[None, :], mask=mj[:, None] & pmask[None, :], other=0.0)
            M = anc_tile(anc_mask, rows_i, mi, rj, mj, MW)
            CB = _cb_tile(Bm, C_i, cb_base, rows_j, mj, ib, jb, g, o_n, nm, G, N, BR, HAS_CB, LOWP, EMUL)
            W = tl.exp(tl.where(M, G_i[:, None] - G_j[None, :], float("-inf"))) * dt_j[None, :] * CB
            out += mm(W, X_j, LOWP, EMUL)
    dt_i = tl.where(mi, _dt_eff(tl.load(dt + rows_i * H + h, mask=mi, other=0.0), bias_h, lo, hi, HAS_DT_BIAS, DT_SOFTPLUS), 0.0)
    x_mask = mi[:, None] & pmask[None, :]
    x_off = (rows_i[:, None] * H + h) * P + o_p[None, :]
    X_i = tl.load(x + x_off, mask=x_mask, other=0.0)
    M = anc_tile(anc_mask, rows_i, mi, ri, mi, MW)
    CB = _cb_tile(Bm, C_i, cb_base, rows_i, mi, ib, ib, g, o_n, nm, G, N, BR, HAS_CB, LOWP, EMUL)
    W = tl.exp(tl.where(M, G_i[:, None] - G_i[None, :], float("-inf"))) * dt_i[None, :] * CB
    out += mm(W, X_i, LOWP, EMUL)
    if HAS_D:
        out += D_h * X_i.to(tl.float32)
    tl.store(y + x_off, out.to(y.dtype.element_ty), mask=x_mask)
    if MULTI:
        tl.store(gscr + rows_i * H + h, G_i, mask=mi)
        tl.debug_barrier()  # later blocks of this program read G_i back


@triton.jit
def ssd_tree_step_kernel(
    x, dt, Bm, Cm, y, gscr,  # tree inputs [T, H, P], [T, H], [T, G, N] x2; y [T, H, P]; gscr [P tiles, T, H] fp32 (MULTI)
    cb, npair,  # HAS_CB: ssd_cb_kernel's tiles [B, G, npair, BR, BR] fp32
    cu_nodes, anc_mask, T,  # [B + 1] int32, [T, MW] int32, T
    A, D, dt_bias, dt_lo, dt_hi,  # [H] fp32 (D, dt_bias: dummies when absent), dt clamp
    state, state_idx, s_slot, s_h, s_p, s_n,  # state[slot, h, p, n] through strides; state_idx [B]
    px, pdt, pB, plen, pidx, L,  # pending path: [R, L, H, P], [R, L, H], [R, L, G, N], [R]; its rows [B]
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BR: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, CP: tl.constexpr, MW: tl.constexpr, MULTI: tl.constexpr,
    HAS_CB: tl.constexpr, HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, LOWP: tl.constexpr, BF16_EMUL: tl.constexpr, EVEN: tl.constexpr,
):
    b, h, g, slot = program_head(state_idx, H, G)
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
        row = tl.load(pidx + b).to(tl.int64)
        m = tl.load(plen + row)
        if m > 0:
            o_c = tl.arange(0, CP)
            for c0 in range(0, m, CP):  # the path in chunks of CP tokens, each from the state after the last
                o_j = c0 + o_c
                jm = o_j < m
                prow = row * L + o_j
                dtp = _dt_eff(tl.load(pdt + prow * H + h, mask=jm, other=0.0), bias_h, dt_lo, dt_hi, HAS_DT_BIAS, DT_SOFTPLUS)
                dtp = tl.where(jm, dtp, 0.0)
                Gp = tl.cumsum(dtp * A_h, axis=0)
                Gm = tl.sum(tl.where(o_j == tl.minimum(m, c0 + CP) - 1, Gp, 0.0), axis=0)
                w = tl.where(jm, tl.exp(Gm - Gp) * dtp, 0.0)
                Xp = tl.load(px + (prow[:, None] * H + h) * P + o_p[None, :], mask=jm[:, None] & pmask[None, :], other=0.0)
                Bp = _group_rows(pB, prow, jm, g, G, N, o_n, nm)
                S = tl.exp(Gm) * S + tl.dot(tl.trans(Xp.to(tl.float32) * w[:, None]), Bp.to(tl.float32))
            if EVEN:
                tl.store(s_ptr, S.to(state.dtype.element_ty))
            else:
                tl.store(s_ptr, S.to(state.dtype.element_ty), mask=s_mask)

    if HAS_TREE:
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        D_h = 0.0
        if HAS_D:
            D_h = tl.load(D + h).to(tl.float32)
        gscr += tl.program_id(1).to(tl.int64) * T * H
        cb_base = cb + (b.to(tl.int64) * G + g) * npair * BR * BR
        if MULTI:
            for ib in range(0, tl.cdiv(n, BR)):
                _verify_block(ib, x, dt, Bm, Cm, y, gscr, cb_base, anc_mask, bos, n, h, g, S, A_h, bias_h, dt_lo,
                              dt_hi, D_h, o_p, pmask, o_n, nm, H, G, P, N, BR, MW, True, HAS_CB, HAS_D, HAS_DT_BIAS,
                              DT_SOFTPLUS, LOWP, BF16_EMUL)
        else:
            _verify_block(0, x, dt, Bm, Cm, y, gscr, cb_base, anc_mask, bos, n, h, g, S, A_h, bias_h, dt_lo, dt_hi,
                          D_h, o_p, pmask, o_n, nm, H, G, P, N, BR, MW, False, HAS_CB, HAS_D, HAS_DT_BIAS,
                          DT_SOFTPLUS, LOWP, BF16_EMUL)


def ssd_tree_step(x, dt, A, B, C, tree, state, state_idx, pending, D, dt_bias, dt_softplus, dt_limit, out=None,
                  pending_idx=None, *, block_p=None, block_r=None, num_warps=None, num_stages=1, lowp=None,
                  shared_cb=None):
    """Launch ``ssd_tree_step_kernel``; arguments as ``vllm_bole.mamba.ssd_tree.ssd_tree_step``.

    ``tree=None`` runs the commit alone; ``pending=None`` the verification alone.
    Returns y [T, H, P] in x's dtype (``out`` if given; None without a tree).
    Defaults: BP = 64 (32 when d_state > 128); trees of up to 32 nodes are one block of that size
    rounded up to a power of two (>= 16), larger trees run blocks of BR = 32; 4 warps (8 for blocks
    of a d_state > 128); pending paths in chunks of 32 tokens (16 for paths of <= 16). ``lowp`` (bf16
    operands) defaults to 16-bit inputs. Chosen by the launch probe of ``benchmarks/bench_mamba2_tree.py``
    (H100, ff6ad01, ``mamba2_tree_quick.json``: B = 32, 64-node trees, Nemotron-H-8B and its TP-2
    shard): two blocks of 32 rows with 4 warps took 0.32 / 0.17 ms, one block of 64 with 4 warps 0.36 /
    0.19, two of 32 with 8 warps 0.43 / 0.22; BP = 32 slower in every case. Larger trees were not probed.
    ``shared_cb`` (default: blocked trees whose (request, head, P tile) grid is more than one wave, i.e. exceeds
    the GPU's SMs): the group's C B^T tiles from one ``ssd_cb_kernel`` launch before the step, instead of each
    of the group's H / G heads computing them (a [BR, N] x [N, BR] product per block pair and head: at BR = 32,
    d_state 128, 64 nodes about a third of the verification's multiply-adds, 44% at 128 nodes); one launch
    more, and [B, G, NB (NB + 1) / 2, BR, BR] fp32 of tiles (NB row blocks; 3 MB at B = 32, G = 8, 64 nodes),
    read from L2 by the group's heads. Timed on the H200 at 897331f (``mamba2_tree_quick.json``'s probe,
    Nemotron-H-8B, 64 nodes): B = 32 0.243 ms shared against 0.285 (its TP-2 shard 0.132 against 0.148); B = 1 (128
    programs, one wave) 0.0190 against 0.0165: within one wave the programs run side by side and the extra
    launch is the cost.
    """
    import torch

    H, P, N = state.shape[1:]
    nB = state_idx.numel()
    BN = max(16, triton.next_power_of_2(N))
    BP = min(block_p or (32 if BN > 128 else 64), max(16, triton.next_power_of_2(P)))
    n_pt = triton.cdiv(P, BP)
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    A = f32(A)
    if lowp is None:
        lowp = tree is not None and x.element_size() == 2
    BR, multi, gscr, cb, npair, has_cb = 16, False, state, state, 0, False
    if tree is not None:
        x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))  # the kernel assumes dense rows (no copy if they are)
        G = B.shape[1]
        T = x.shape[0]
        BT = max(16, triton.next_power_of_2(tree.max_nodes))
        BR = min(BT, block_r or 32)
        multi = BT > BR
        if multi:
            gscr = torch.empty(n_pt, T, H, dtype=torch.float32, device=x.device)
        has_cb = multi and nB * H * n_pt > num_sms(x.device) if shared_cb is None else bool(shared_cb)
        if has_cb:
            NB = triton.cdiv(BT, BR)
            npair = NB * (NB + 1) // 2
            cb = torch.empty(nB, G, npair, BR, BR, dtype=torch.float32, device=x.device)
            ssd_cb_kernel[(nB * G, NB)](B, C, cb, tree.cu_nodes, npair, G=G, N=N, BR=BR, BN=BN, LOWP=bool(lowp),
                                        EMUL=INTERPRET, num_warps=4)
        if out is None:
            out = torch.empty(T, H, P, dtype=x.dtype, device=x.device)
        assert out.is_contiguous(), "out must be contiguous"
        tree_args = (x, dt, B, C, out, gscr, cb, npair, tree.cu_nodes, tree.anc_mask, T)
        MW = tree.anc_mask.shape[1]
    else:
        G = pending.B.shape[2]
        out, MW = None, 1
        tree_args = (state,) * 7 + (0, state_idx, state_idx, 0)
    if pending is not None:
        Lmax = pending.max_len
        CP = min(32, max(16, triton.next_power_of_2(Lmax)))
        pend_args = (pending.x, pending.dt, pending.B, pending.length,
                     state_idx if pending_idx is None else pending_idx, Lmax)
    else:
        CP = 16
        pend_args = (state, state, state, state_idx, state_idx, 0)
    ssd_tree_step_kernel[(nB * H, n_pt)](
        *tree_args,
        A, f32(D) if D is not None else A, f32(dt_bias) if dt_bias is not None else A,
        float(dt_limit[0]), float(dt_limit[1]),
        state, state_idx, *state.stride(),
        *pend_args,
        H=H, G=G, P=P, N=N, BR=BR, BP=BP, BN=BN, CP=CP, MW=MW, MULTI=multi, EVEN=P % BP == 0 and BN == N,
        HAS_CB=has_cb, HAS_TREE=tree is not None, HAS_PENDING=pending is not None, HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), LOWP=bool(lowp), BF16_EMUL=INTERPRET,
        num_warps=num_warps or (8 if multi and BN > 128 else 4), num_stages=num_stages,
    )
    return out
