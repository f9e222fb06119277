"""The accepted-path stash of ``PendingPath`` buffers (Triton).

``stash_kernel``: one program per (request, path position) copies the accepted node's row of
every field (up to four) into the request's slot, and position 0 sets the slot's pending length.
Rows are copied as they are (the caller casts inputs to the buffers' dtypes).
API, dispatch and plain-torch twin: ``vllm_bole.pending.stash_accepted_path``.
"""
import triton
import triton.language as tl


@triton.jit
def _copy_row(src, dst, row, dst_row, R: tl.constexpr, BLK: tl.constexpr):
    for off in tl.static_range(0, R, BLK):
        o = off + tl.arange(0, BLK)
        m = o < R
        tl.store(dst + dst_row * R + o, tl.load(src + row * R + o, mask=m), mask=m)


@triton.jit
def stash_kernel(s0, d0, s1, d1, s2, d2, s3, d3, plen, accepted, cu_nodes, state_idx, L, P,
                 R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                 K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
                 NF: tl.constexpr, B_L: tl.constexpr):
    """Program (request b, path position j): copy node accepted[b, j]'s rows (R_f elements of
    field f, blocks of K_f) into row j of the slot; position 0 writes the path length."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(state_idx + b).to(tl.int64)
    node = tl.load(accepted + b * L + j)
    if j == 0:
        o_l = tl.arange(0, B_L)
        acc = tl.load(accepted + b * L + o_l, mask=o_l < L, other=-1)
        tl.store(plen + slot, tl.sum((acc >= 0).to(tl.int32), axis=0))
    if node >= 0:
        row = (tl.load(cu_nodes + b) + node).to(tl.int64)
        dst = slot * P + j
        _copy_row(s0, d0, row, dst, R0, K0)
        if NF > 1:
            _copy_row(s1, d1, row, dst, R1, K1)
        if NF > 2:
            _copy_row(s2, d2, row, dst, R2, K2)
        if NF > 3:
            _copy_row(s3, d3, row, dst, R3, K3)


def stash_rows(pairs, plen, state_idx, cu_nodes, accepted, max_len, block=2048):
    """Launch ``stash_kernel``. pairs: up to 4 (src [T, ...] contiguous, dst [S, max_len, ...]
    contiguous) of one dtype each; accepted [B, L] int, contiguous."""
    B, L = accepted.shape
    nf = len(pairs)
    assert 0 < nf <= 4
    rows = [dst[0, 0].numel() for _, dst in pairs]
    ptrs = [t for src, dst in pairs for t in (src, dst)]
    dummy = pairs[0][0]
    ptrs += [dummy] * (8 - len(ptrs))
    rows += [1] * (4 - nf)
    blks = [min(block, triton.next_power_of_2(r)) for r in rows]
    stash_kernel[(B, L)](
        *ptrs, plen, accepted, cu_nodes, state_idx, L, max_len,
        R0=rows[0], R1=rows[1], R2=rows[2], R3=rows[3], K0=blks[0], K1=blks[1], K2=blks[2], K3=blks[3],
        NF=nf, B_L=triton.next_power_of_2(L),
    )
