"""Gated DeltaNet tree step (Triton): the pending-path commit and the tree verification in one kernel
(one launch; the launcher splits them into two launches for blocked trees, ``gdn_step``).

One program per (request, value head, V split ``vs``): it owns the V tiles vs, vs + NV, vs + 2 NV, ...
(BV columns each) of the request's committed state S [K, V] = ``state[slot, h]`` (FLA's [K, V] and
vLLM's [V, K] slot layouts both work through strides; loaded as fp32 whatever its dtype, stored
in its own dtype). NV = V / BV gives each program one tile; NV = 1 gives each (request, head) one
program that loops over V (``gdn_step`` picks BV and NV from the launch probe). Everything that
does not depend on V (the ancestor-masked decays, the UT inverse, the query-key products) is computed
once per program and applied to each of its tiles.

1. commit (``HAS_PENDING``): if the request's row holds a pending accepted path of m > 0 tokens
   (their own inputs k, v, g, beta from the previous step), S <- S after those m tokens, in
   place. The path is a chain, processed in chunks of CP tokens with the chunked WY/UT form (FLA's
   ``chunk_gated_delta_rule`` update): per chunk, with Gp the within-chunk cumulative log decay,

       Ap = [j < i] beta_i e^{Gp_i - Gp_j} k_i.k_j,   dp = (I + Ap)^{-1} diag(beta) (V - diag(e^Gp) K S)
       S  <- e^{Gp_last} S + sum_j e^{Gp_last - Gp_j} k_j dp_j^T.

   Each tile goes back to the state once per chunk; the verification reads it back (from L2: the
   state crosses DRAM once in and once out per step).
2. verify (``HAS_TREE``): every tree node's output from S and the node's ancestors only, through
   the ancestor-masked WY/UT closed form (no per-node K x V state):

       G_i = sum_{j in anc*(i)} g_j,  A_ij = [j strict anc of i] beta_i e^{G_i - G_j} k_i.k_j
       d   = (I + A)^{-1} U,  U = diag(beta) (V - diag(e^G) K S)
       o_i = scale (e^{G_i} S^T q_i + sum_{j in anc*(i)} e^{G_i - G_j} (q_i.k_j) d_j)

   i.e. O = scale (diag(e^G) Q S + W U) with W = (E o Q K^T)(I + A)^{-1}: W is V-independent, so
   a tile costs three products (K S, Q S, W U). The nodes are taken in row blocks of BR
   (topological order, so A is block lower triangular). Trees of at most BR nodes (BR = 64 for
   K <= 128 in fp32, 32 with bf16 operands) are one block: everything stays on chip. Larger trees
   (up to 256 nodes) run a blocked forward substitution: block i gathers sum_{j<i} A_ij d_j and
   sum_{j<i} (e^{G_i - G_j} q_i.k_j) d_j from the earlier blocks (their d in a global fp32 scratch
   [T, Hv, V], their G in [NV, T, Hv], written and read back by the same program after a barrier),
   then d_i = (I + A_ii)^{-1} (U_i - sum_{j<i} A_ij d_j). Diagonal blocks are inverted as the
   Neumann series of the nilpotent A_ii ((I - A)(I + A^2)(I + A^4)..., ``tiles.unit_lower_inverse``:
   about log2(depth) squarings, once per program). G of a block is summed from the ancestor mask
   over the blocks at or before it.

Precision: fp32 inputs -> fp32 operands (tf32 tensor-core products on the GPU, exact fp32 in the
interpreter); 16-bit inputs -> bf16 operands with fp32 accumulation (``LOWP``; FLA's chunk
kernels do the same, the state tile included), emulated exactly under the interpreter
(``tiles.mm``). The commit always uses fp32 operands. Shared memory on the H200 (227 KB): the
launcher keeps every operand tile at most [64, 128] fp32 (BR = 32 when K = 256).
API and dispatch: ``vllm_bole.gdn``; plain-torch twin: ``vllm_bole/gdn/naive.py``; float64
reference: ``vllm_bole/gdn/reference.py``; the accepted-path stash: ``csrc_triton.pending_stash``.
"""

import triton
import triton.language as tl

from csrc_triton.tiles import INTERPRET, anc_tile, mm, num_sms, program_head, squarings, unit_lower_inverse

MAX_BLOCK_R = 64  # node rows per block in fp32 (trees of up to this many nodes run as one block)
MAX_BLOCK_R_LOWP = 32  # ... and with bf16 operands: a 64-row bf16 block faults on the GPU (see gdn_step)
BLOCK_V = (32, 64)  # state columns per tile: 64 where one program per (request, head) fills the GPU, else 32


@triton.jit
def _load_qk(ptr, rows, row_mask, hk, Hk: tl.constexpr, K: tl.constexpr, USE_L2NORM: tl.constexpr):
    """Rows of a [*, Hk, K] tensor for key head hk, as fp32, optionally L2-normalised."""
    o_k = tl.arange(0, K)
    x = tl.load(ptr + (rows[:, None] * Hk + hk) * K + o_k[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    if USE_L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _commit(s_base, s_k, s_v, pk, pv, pg, pbeta, row, m, P, h, hk, vs,
            Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
            CP: tl.constexpr, STEPS: tl.constexpr, USE_L2NORM: tl.constexpr):
    """The pending path's m tokens into this program's state tiles, in place (each chunk's factors once)."""
    o_k = tl.arange(0, K)
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
        eGp = tl.exp(Gp)
        kpw = kp * tl.where(pm, tl.exp(Gm - Gp), 0.0)[:, None]
        for vt in range(vs, V // BV, NV):
            o_v = vt * BV + tl.arange(0, BV)
            s_ptr = s_base + o_k[:, None] * s_k + o_v[None, :] * s_v
            S = tl.load(s_ptr).to(tl.float32)
            vp = tl.load(pv + (prow[:, None] * Hv + h) * V + o_v[None, :], mask=pm[:, None], other=0.0)
            dp = tl.dot(Tp, bp[:, None] * (vp.to(tl.float32) - eGp[:, None] * tl.dot(kp, S)))
            S = tl.exp(Gm) * S + tl.dot(tl.trans(kpw), dp)
            tl.store(s_ptr, S.to(s_base.dtype.element_ty))
        tl.debug_barrier()  # the next chunk and the verification read these tiles back


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
    ib, q, k, v, g, beta, o, dscr, gscr, anc_mask, bos, n, h, hk, s_base, s_k, s_v, vs, scale, inv_steps,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, MW: tl.constexpr,
    MULTI: tl.constexpr, USE_L2NORM: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr, INV_LOWP: tl.constexpr,
):
    """Outputs of row block ib for this program's V tiles (MULTI: its d and G into the scratch)."""
    o_r = tl.arange(0, BR)
    o_k = tl.arange(0, K)
    ri = ib * BR + o_r
    mi = ri < n
    rows_i = (bos + ri).to(tl.int64)
    q_i = _load_qk(q, rows_i, mi, hk, Hk, K, USE_L2NORM)
    k_i = _load_qk(k, rows_i, mi, hk, Hk, K, USE_L2NORM)
    b_i = tl.load(beta + rows_i * Hv + h, mask=mi, other=0.0).to(tl.float32)
    G_i = _block_G(g, anc_mask, bos, n, rows_i, mi, ib + 1, h, Hv, BR, MW)
    M = anc_tile(anc_mask, rows_i, mi, ri, mi, MW)
    E = tl.exp(tl.where(M, G_i[:, None] - G_i[None, :], float("-inf")))
    strict = M & (o_r[:, None] != o_r[None, :])
    A = tl.where(strict, E * b_i[:, None] * mm(k_i, tl.trans(k_i), LOWP, EMUL), 0.0)
    Tinv = unit_lower_inverse(A, BR, inv_steps, INV_LOWP, EMUL)
    W = mm(E * mm(q_i, tl.trans(k_i), LOWP, EMUL), Tinv, LOWP, EMUL)  # the block's own nodes, on U
    eG = tl.exp(G_i)
    if MULTI:
        tl.store(gscr + rows_i * Hv + h, G_i, mask=mi)
    for vt in range(vs, V // BV, NV):
        o_v = vt * BV + tl.arange(0, BV)
        S = tl.load(s_base + o_k[:, None] * s_k + o_v[None, :] * s_v).to(tl.float32)
        v_i = tl.load(v + (rows_i[:, None] * Hv + h) * V + o_v[None, :], mask=mi[:, None], other=0.0).to(tl.float32)
        U = b_i[:, None] * (v_i - eG[:, None] * mm(k_i, S, LOWP, EMUL))
        acc = eG[:, None] * mm(q_i, S, LOWP, EMUL)
        if MULTI:  # the earlier blocks: U -= sum_j A_ij d_j, acc += sum_j e^{G_i - G_j} (q_i.k_j) d_j
            for jb in range(0, ib):
                rj = jb * BR + o_r
                mj = rj < n
                rows_j = (bos + rj).to(tl.int64)
                k_j = _load_qk(k, rows_j, mj, hk, Hk, K, USE_L2NORM)
                G_j = tl.load(gscr + rows_j * Hv + h, mask=mj, other=0.0)
                Ej = tl.exp(tl.where(anc_tile(anc_mask, rows_i, mi, rj, mj, MW), G_i[:, None] - G_j[None, :],
                                     float("-inf")))
                d_j = tl.load(dscr + (rows_j[:, None] * Hv + h) * V + o_v[None, :], mask=mj[:, None], other=0.0)
                U -= mm(Ej * b_i[:, None] * mm(k_i, tl.trans(k_j), LOWP, EMUL), d_j, LOWP, EMUL)
                acc += mm(Ej * mm(q_i, tl.trans(k_j), LOWP, EMUL), d_j, LOWP, EMUL)
            tl.store(dscr + (rows_i[:, None] * Hv + h) * V + o_v[None, :], mm(Tinv, U, LOWP, EMUL), mask=mi[:, None])
        out = scale * (acc + mm(W, U, LOWP, EMUL))
        tl.store(o + (rows_i[:, None] * Hv + h) * V + o_v[None, :], out.to(o.dtype.element_ty), mask=mi[:, None])
    if MULTI:
        tl.debug_barrier()  # later blocks of this program read d_i and G_i back


@triton.jit
def gdn_step_kernel(
    q, k, v, g, beta, o, dscr, gscr,  # [T, Hk, K] x2, [T, Hv, V], [T, Hv] x2; o [T, Hv, V]
    # MULTI only, fp32 scratch: dscr [T, Hv, V] (d), gscr [NV, T, Hv] (G, one copy per V split)
    cu_nodes, anc_mask, inv_steps, T,  # [B + 1] int32, [T, MW] int32, squarings of a diagonal block's inverse
    state, state_idx, s_slot, s_h, s_k, s_v,  # state[slot, h, k, v] through strides; state_idx [B]
    pk, pv, pg, pbeta, plen, pidx, P,  # pending path: [R, P, Hk, K], [R, P, Hv, V], [R, P, Hv] x2, [R]; rows [B]
    scale,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BR: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, MW: tl.constexpr, CP: tl.constexpr, STEPS: tl.constexpr,
    MULTI: tl.constexpr, HAS_TREE: tl.constexpr, HAS_PENDING: tl.constexpr,
    USE_L2NORM: tl.constexpr, LOWP: tl.constexpr, EMUL: tl.constexpr, INV_LOWP: tl.constexpr,
):
    b, h, hk, slot = program_head(state_idx, Hv, Hk)
    vs = tl.program_id(1)
    s_base = state + slot * s_slot + h * s_h
    if HAS_PENDING:
        row = tl.load(pidx + b).to(tl.int64)
        m = tl.load(plen + row)
        if m > 0:
            _commit(s_base, s_k, s_v, pk, pv, pg, pbeta, row, m, P, h, hk, vs,
                    Hk, Hv, K, V, BV, NV, CP, STEPS, USE_L2NORM)
    if HAS_TREE:
        bos = tl.load(cu_nodes + b)
        n = tl.load(cu_nodes + b + 1) - bos
        gscr += vs.to(tl.int64) * T * Hv
        if MULTI:
            for ib in range(0, tl.cdiv(n, BR)):
                _verify_block(ib, q, k, v, g, beta, o, dscr, gscr, anc_mask, bos, n, h, hk, s_base, s_k, s_v, vs,
                              scale, inv_steps, Hk, Hv, K, V, BR, BV, NV, MW, True, USE_L2NORM, LOWP, EMUL, INV_LOWP)
        else:
            _verify_block(0, q, k, v, g, beta, o, dscr, gscr, anc_mask, bos, n, h, hk, s_base, s_k, s_v, vs,
                          scale, inv_steps, Hk, Hv, K, V, BR, BV, NV, MW, False, USE_L2NORM, LOWP, EMUL, INV_LOWP)


def _pow2_divisor(x: int, cap: int) -> int:
    """The largest power of two <= cap dividing x."""
    d = 1
    while d * 2 <= cap and x % (d * 2) == 0:
        d *= 2
    return d


def v_splits(programs: int, tiles: int, device) -> int:
    """Programs per (request, head) by default: the fewest (a power of two dividing ``tiles``) that put two
    programs on every SM, at most one per tile; one on CPU. Fewer programs compute the V-independent factors
    fewer times; more fill the GPU when the batch is small."""
    if device.type != "cuda":
        return 1
    nv = 1
    while nv < tiles and programs * nv < 2 * num_sms(device) and tiles % (2 * nv) == 0:
        nv *= 2
    return nv


def launch_config(B: int, Hv: int, V: int, device, block_v=None, v_split=None) -> tuple[int, int]:
    """(BV, NV): BV = 64 columns where one program per (request, head) already puts two on every SM, else
    32 columns split by :func:`v_splits` (or ``block_v`` / ``v_split`` as given)."""
    if block_v is None:
        wide = _pow2_divisor(V, BLOCK_V[1])
        block_v = wide if v_splits(B * Hv, V // wide, device) == 1 else BLOCK_V[0]
    BV = _pow2_divisor(V, block_v)
    NV = v_split or v_splits(B * Hv, V // BV, device)
    if (V // BV) % NV:
        raise ValueError(f"v_split={NV} must divide the {V // BV} V tiles of BV={BV} columns")
    return BV, NV


def block_rows(max_nodes: int, K: int, lowp: bool, block_r=None) -> tuple[int, bool]:
    """(BR, blocked) for trees of up to ``max_nodes`` nodes: one block of that size rounded up to a power of two
    (>= 16) up to ``MAX_BLOCK_R`` rows (``MAX_BLOCK_R_LOWP`` with bf16 operands or K > 128), else blocks of 32
    (or ``block_r``); blocked when the tree needs more than one."""
    BT = max(16, triton.next_power_of_2(max_nodes))
    one_block = MAX_BLOCK_R_LOWP if lowp or K > 128 else MAX_BLOCK_R
    BR = min(BT, block_r) if block_r else (BT if BT <= one_block else 32)
    return BR, BT > BR


def default_lowp(max_nodes: int, K: int, sixteen_bit: bool) -> bool:
    """bf16 operands for 16-bit inputs, except trees of 33-64 nodes at K <= 128: fp32 operands in ONE 64-row
    block beat bf16 ones in two blocks of 32 (``gdn_probe_configs.json`` at ad1f02e, H100, Qwen3-Next-80B
    shapes: B = 32, 64 nodes 0.203 against 0.225 ms, 48 nodes 0.198 against 0.217; B = 1, 64 nodes 0.0197
    against 0.0218 ms; error 0.0022 against 0.0037)."""
    return sixteen_bit and not (MAX_BLOCK_R_LOWP < max_nodes <= MAX_BLOCK_R and K <= 128)


def gdn_step(q, k, v, g, beta, tree, state, state_idx, scale, use_qk_l2norm, pending=None, pending_idx=None, out=None,
             *, block_r=None, block_v=None, v_split=None, num_warps=None, lowp=None, inv_lowp=None, launches=None):
    """Launch ``gdn_step_kernel``; arguments as ``vllm_bole.gdn.gdn_tree_step``. ``tree=None``: the commit alone;
    ``pending=None``: the verification alone. Returns o [T, Hv, V] in v's dtype (``out`` if given: contiguous;
    None without a tree).

    Defaults, from the launch probe on an H100 (``gdn_probe_configs.json``, fbec640, Qwen3-Next-80B shapes,
    bf16, a 5-token pending path): trees of up to 64 nodes in fp32 (32 with bf16 operands, or K = 256) are one
    block of BR = that size rounded up to a power of two (>= 16); larger trees run blocks of BR = 32. A
    64-row block with bf16 operands gave wrong outputs then an illegal memory access on the H100 (every
    launch config; ``kernel_envelope.json`` at fbec640: the only failures), where 32-row blocks and fp32
    64-row blocks are exact: such trees take two blocks of 32. The same pattern as FLA's reports of
    Triton >= 3.4 on Hopper (fla-org/flash-linear-attention#984: wrong results at 64-row chunks only, 16 and
    32 exact; #640 / PR #826: 16-bit wgmma outputs moved to shared memory through a miscompiled stmatrix);
    not reduced to a reproducer here. Tiles and splits: :func:`launch_config`
    (B = 32, 16 nodes: BV 64 unsplit 0.110 ms against 0.126 for BV 32; B = 1: BV 32 in four splits 0.012
    ms against 0.017 unsplit). One launch for one-block trees (0.110 against 0.126 ms for commit and
    verification apart at B = 32), two for blocked trees (``launches``; 0.446 against 0.540 ms at B =
    32, 128 nodes; 0.042 against 0.047 at B = 1). 4 warps (8 were slower in all but one probed config).
    Pending paths in chunks of 32 tokens (16 for paths of <= 16). ``lowp`` (bf16 operands) defaults to
    :func:`default_lowp`, ``inv_lowp`` (bf16 inverse) to ``lowp``.
    """
    import torch

    Hv, K, V = state.shape[1:]
    B = state_idx.numel()
    BV, NV = launch_config(B, Hv, V, state.device, block_v, v_split)
    if tree is not None and lowp is None:
        lowp = default_lowp(tree.max_nodes, K, v.element_size() == 2)
    BR, multi, MW, T, steps, dscr = 16, False, 1, 0, 0, state
    if tree is not None:
        BR, multi = block_rows(tree.max_nodes, K, lowp, block_r)
    if tree is not None and pending is not None and (launches or (2 if multi else 1)) == 2:
        gdn_step(None, None, None, None, None, None, state, state_idx, scale, use_qk_l2norm, pending, pending_idx,
                 block_v=BV, v_split=NV, num_warps=num_warps)
        pending = None
    if tree is not None:
        q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # dense rows assumed (no copy if they are)
        T = q.shape[0]
        if out is None:
            out = torch.empty(T, Hv, V, dtype=v.dtype, device=v.device)
        assert out.is_contiguous(), "out must be contiguous"
        if multi:
            dscr = torch.empty(T, Hv, V, dtype=torch.float32, device=v.device)
        gscr = torch.empty(NV, T, Hv, dtype=torch.float32, device=v.device) if multi else dscr
        tree_args = (q, k, v, g, beta, out, dscr, gscr, tree.cu_nodes, tree.anc_mask)
        steps, MW, Hk = squarings(min(BR, tree.max_depth + 1)), tree.anc_mask.shape[1], k.shape[1]
    else:
        tree_args = (state,) * 8 + (state_idx, state_idx)
        Hk = pending.k.shape[2]
    if pending is not None:
        P = pending.max_len
        CP = min(32, max(16, triton.next_power_of_2(P)))
        pend_args = (pending.k, pending.v, pending.g, pending.beta, pending.length,
                     state_idx if pending_idx is None else pending_idx, P)
    else:
        CP, P = 16, 0
        pend_args = (state,) * 4 + (state_idx, state_idx, 0)
    if inv_lowp is None:
        inv_lowp = bool(lowp)  # bf16 inverse: same error at 16-bit inputs (probe), 25% faster verify
    gdn_step_kernel[(B * Hv, NV)](
        *tree_args, steps, T, state, state_idx, *state.stride(), *pend_args, scale,
        Hk=Hk, Hv=Hv, K=K, V=V, BR=BR, BV=BV, NV=NV, MW=MW, CP=CP, STEPS=squarings(min(CP, max(P, 1))),
        MULTI=multi, HAS_TREE=tree is not None, HAS_PENDING=pending is not None,
        USE_L2NORM=use_qk_l2norm, LOWP=bool(lowp), EMUL=INTERPRET, INV_LOWP=bool(inv_lowp),
        num_warps=num_warps or 4, num_stages=1,
    )
    return out
