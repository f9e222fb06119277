"""The paged draft's best-first tree search over per-depth candidates in one launch (Triton).

One program per request runs every depth level of
:func:`~vllm_bole.spec_decode.best_first.level_search_packed` (the torch twin, ~25 launches per
level: on the H200 the draft's step graph is bound by its kernel count). The search state lives in
the output ``[B, S, 7]`` itself (fields ``PACKED_FIELDS``; during the search a free slot has depth
-1). Per level ``d``:

1. **candidates**: the kept nodes (slots in order), then the children of the depth-``d`` nodes
   (parent-major, rank-minor), exactly the twin's candidate order; only those with a finite score
   are written, compacted in that order, to a scratch row (``cand``);
2. **ranks**: a candidate is kept when fewer than ``caps + 1`` candidates precede it in (score desc,
   order asc), the twin's stable sort; counted pairwise in ``BLOCK x BLOCK`` tiles over the compacted
   candidates only (at most ``S + S * c``, in practice the kept nodes and a few frontier nodes'
   children);
3. **new state**: kept candidates land in their order (cumulative count), parents re-pointed
   through the old slot's new position; the other slots free.

Scores are added in float64 from the twin's per-depth log scores (computed by torch before the
launch), so trees are equal to the twin's bit for bit. Global scratch written and read by other
threads of the same program is ordered by ``tl.debug_barrier`` (CUDA: ``__syncthreads`` makes a
block's global writes visible to the block).
"""
import triton
import triton.language as tl

# offsets in a packed slot (0: valid) and the slot's width; the scratch candidates hold the fields after "valid"
TOK = tl.constexpr(1)
PAR = tl.constexpr(2)
DEP = tl.constexpr(3)
KIND = tl.constexpr(4)
LOG = tl.constexpr(5)
Q = tl.constexpr(6)
NF = tl.constexpr(7)


@triton.jit
def level_search_kernel(out, cand, keep, newpos, slotpos, root, logs_main, logs_other, tokd, vals, caps,
                        S, L, C, M_P,
                        S_P: tl.constexpr, C_P: tl.constexpr, PB: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    NEG = float("-inf")
    row = out + b * S * NF
    crow = cand + b * M_P * 6
    krow = keep + b * M_P
    nrow = newpos + b * M_P
    srow = slotpos + b * S_P
    keep_n = tl.load(caps + b) + 1
    p = tl.arange(0, S_P)
    pm = p < S
    zero = tl.zeros([S_P], dtype=tl.float64)
    tl.store(row + p * NF + TOK, tl.where(p == 0, tl.load(root + b).to(tl.float64), zero), mask=pm)
    tl.store(row + p * NF + PAR, zero - 1.0, mask=pm)
    tl.store(row + p * NF + DEP, tl.where(p == 0, zero, zero - 1.0), mask=pm)
    tl.store(row + p * NF + KIND, zero, mask=pm)
    tl.store(row + p * NF + LOG, tl.where(p == 0, zero, zero + NEG), mask=pm)
    tl.store(row + p * NF + Q, tl.where(p == 0, zero + 1.0, zero), mask=pm)
    r = tl.arange(0, C_P)
    rm = r < C
    bi = tl.arange(0, BLOCK)
    for d in range(0, L):
        tl.debug_barrier()
        # 1. the kept nodes, compacted (their compacted position per old slot: the parents' map)
        k_log = tl.load(row + p * NF + LOG, mask=pm, other=NEG)
        kv = pm & (k_log > NEG)
        kpos = tl.cumsum(kv.to(tl.int32), 0) - 1
        for f in tl.static_range(TOK, NF):
            tl.store(crow + kpos * 6 + (f - TOK), tl.load(row + p * NF + f, mask=kv), mask=kv)
        tl.store(srow + p, kpos, mask=kv)
        n = tl.sum(kv.to(tl.int32), 0)
        # ... then the depth-d nodes' children, parent-major
        off = n * 0  # children so far
        lm = tl.load(logs_main + (b * L + d) * C + r, mask=rm, other=NEG)
        lo = tl.load(logs_other + (b * L + d) * C + r, mask=rm, other=NEG)
        qv = tl.load(vals + (b * L + d) * C + r, mask=rm, other=0.0)
        tv = tl.load(tokd + (b * L + d) * C + r, mask=rm, other=0.0)
        has = rm & (qv > 0)
        for p0 in range(0, S, PB):
            pp = p0 + tl.arange(0, PB)
            ppm = pp < S
            dep = tl.load(row + pp * NF + DEP, mask=ppm, other=-1.0)
            kind = tl.load(row + pp * NF + KIND, mask=ppm, other=0.0)
            plog = tl.load(row + pp * NF + LOG, mask=ppm, other=NEG)
            main = kind == 0
            cv = (ppm & (dep == d))[:, None] & has[None, :]
            clog = tl.where(cv, plog[:, None] + tl.where(main[:, None], lm[None, :], lo[None, :]), NEG)
            cv = cv & (clog > NEG)
            cvi = cv.to(tl.int32)
            per = tl.sum(cvi, 1)
            pos = n + off + (tl.cumsum(per, 0) - per)[:, None] + tl.cumsum(cvi, 1) - 1
            ones = tl.zeros([PB, C_P], dtype=tl.float64) + 1.0
            ckind = tl.where(main[:, None], tl.where(r[None, :] == 0, ones * 0, ones), ones * 2)
            tl.store(crow + pos * 6 + 0, ones * tv[None, :], mask=cv)
            tl.store(crow + pos * 6 + 1, ones * pp.to(tl.float64)[:, None], mask=cv)
            tl.store(crow + pos * 6 + 2, ones * (d + 1), mask=cv)
            tl.store(crow + pos * 6 + 3, ckind, mask=cv)
            tl.store(crow + pos * 6 + 4, clog, mask=cv)
            tl.store(crow + pos * 6 + 5, ones * qv[None, :], mask=cv)
            off += tl.sum(per, 0)
        n = n + off
        tl.debug_barrier()
        # 2. kept: fewer than caps + 1 candidates before it in (score desc, order asc)
        for i0 in range(0, n, BLOCK):
            ii = i0 + bi
            li = tl.load(crow + ii * 6 + 4, mask=ii < n, other=NEG)
            cnt = tl.zeros([BLOCK], dtype=tl.int32)
            for j0 in range(0, n, BLOCK):
                jj = j0 + bi
                lj = tl.load(crow + jj * 6 + 4, mask=jj < n, other=NEG)
                ahead = (lj[None, :] > li[:, None]) | ((lj[None, :] == li[:, None]) & (jj[None, :] < ii[:, None]))
                cnt += tl.sum(ahead.to(tl.int32), 1)
            tl.store(krow + ii, (cnt < keep_n).to(tl.int32), mask=ii < n)
        tl.debug_barrier()
        # ... their new slots: the running count of kept candidates (-1: dropped)
        carry = n * 0
        for i0 in range(0, n, BLOCK):
            ii = i0 + bi
            k = tl.load(krow + ii, mask=ii < n, other=0)
            tl.store(nrow + ii, tl.where(k > 0, carry + tl.cumsum(k, 0) - 1, -1), mask=ii < n)
            carry += tl.sum(k, 0)
        # 3. the new state: every slot free, then the kept candidates at their slots
        tl.store(row + p * NF + TOK, zero, mask=pm)
        tl.store(row + p * NF + PAR, zero - 1.0, mask=pm)
        tl.store(row + p * NF + DEP, zero - 1.0, mask=pm)
        tl.store(row + p * NF + KIND, zero, mask=pm)
        tl.store(row + p * NF + LOG, zero + NEG, mask=pm)
        tl.store(row + p * NF + Q, zero, mask=pm)
        tl.debug_barrier()
        for i0 in range(0, n, BLOCK):
            ii = i0 + bi
            im = ii < n
            slot = tl.load(nrow + ii, mask=im, other=-1)
            w = im & (slot >= 0)
            par = tl.load(crow + ii * 6 + 1, mask=w, other=-1.0)
            has_par = w & (par >= 0)
            ppos = tl.load(srow + par.to(tl.int32), mask=has_par, other=0)
            npar = tl.load(nrow + ppos, mask=has_par, other=-1).to(tl.float64)
            for f in tl.static_range(TOK, NF):
                v = tl.load(crow + ii * 6 + (f - TOK), mask=w)
                if f == PAR:
                    v = tl.where(has_par, npar, -1.0)
                tl.store(row + slot * NF + f, v, mask=w)
    tl.debug_barrier()
    dep = tl.load(row + p * NF + DEP, mask=pm, other=-1.0)
    valid = dep >= 0
    tl.store(row + p * NF, valid.to(tl.float64), mask=pm)
    tl.store(row + p * NF + DEP, tl.where(valid, dep, 0.0), mask=pm)


def level_search_triton(root, logs_main, logs_other, tokd, vals, caps, slots: int):
    """:func:`~vllm_bole.spec_decode.best_first.level_search_packed` after its score prelude:
    ``root``/``caps`` [B] int64, ``logs_main``/``logs_other``/``tokd``/``vals`` [B, L, c] float64
    (a main-path parent's and any other parent's child log scores, tokens, probabilities; ``vals
    <= 0``: no candidate) -> ``[B, slots, 7]`` float64 packed trees. No host synchronisation."""
    import torch

    B, L, c = vals.shape
    S = int(slots)
    dev = vals.device
    S_P, C_P = max(2, triton.next_power_of_2(S)), max(2, triton.next_power_of_2(c))
    M_P = S * (1 + c)
    PB = max(1, min(S_P, 512 // C_P))
    out = torch.empty(B, S, NF, dtype=torch.float64, device=dev)
    cand = torch.empty(B, M_P, 6, dtype=torch.float64, device=dev)
    keep = torch.empty(B, M_P, dtype=torch.int32, device=dev)
    newpos = torch.empty(B, M_P, dtype=torch.int32, device=dev)
    slotpos = torch.empty(B, S_P, dtype=torch.int32, device=dev)
    if B:
        level_search_kernel[(B,)](out, cand, keep, newpos, slotpos, root.long().contiguous(), logs_main.contiguous(),
                                  logs_other.contiguous(), tokd.contiguous(), vals.contiguous(),
                                  caps.long().contiguous(), S, L, c, M_P, S_P=S_P, C_P=C_P, PB=PB, BLOCK=64)
    return out
