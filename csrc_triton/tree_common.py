"""Triton pieces shared by the recurrent tree kernels (GDN, SSD).

* ``mm``: a @ b with fp32 accumulation, bf16 operands when LOWP. Under Triton's CPU
  interpreter (whose bf16 ``tl.dot`` returns garbage in Triton 3.9) the operands are rounded to
  bf16 and multiplied in fp32 instead (``BF16_EMUL``, set by the launchers from
  ``INTERPRET``): the same products, exact in fp32, so CPU tests cover the 16-bit path's logic.
* ``anc_tile``: a block of the ancestor-or-self mask of one request's tree (rows x columns of
  local nodes) from ``TreeBatch.anc_mask`` bit words.
* ``unit_lower_inverse`` / ``squarings``: (I + A)^{-1} of a strictly lower nilpotent tile.
* ``stash_kernel`` / ``stash_rows``: the accepted-path stash of ``PendingPath`` buffers: one
  program per (request, path position) copies the accepted node's row of every field (up to
  four) into the request's slot, and position 0 sets the slot's pending length. Rows are
  copied as they are (the caller casts inputs to the buffers' dtypes).
The plain-torch twin is ``vllm_bole.mamba.tree_common``.
"""
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def mm(a, b, LOWP: tl.constexpr, BF16_EMUL: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 operands when LOWP (emulated under the interpreter),
    else fp32 operands (tf32 tensor-core products on the GPU, exact fp32 in the interpreter)."""
    if LOWP:
        if BF16_EMUL:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32))
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def anc_tile(anc_mask, rows, row_ok, cols, col_ok, MW: tl.constexpr):
    """M[i, j] = local node ``cols[j]`` is an ancestor-or-self of the node at flat row ``rows[i]``
    (False where ``~row_ok[i]`` or ``~col_ok[j]``)."""
    ok = row_ok[:, None] & col_ok[None, :]
    word = tl.load(anc_mask + rows[:, None] * MW + (cols // 32)[None, :], mask=ok, other=0)
    return (((word >> (cols % 32)[None, :]) & 1) != 0) & ok


@triton.jit
def unit_lower_inverse(A, BT: tl.constexpr, steps, LOWP: tl.constexpr, BF16_EMUL: tl.constexpr):
    """(I + A)^{-1} for a strictly lower nilpotent A [BT, BT] with A^(2^(steps+1)) = 0: the
    Neumann series as (I - A)(I + A^2)(I + A^4)..."""
    o = tl.arange(0, BT)
    T = (o[:, None] == o[None, :]).to(tl.float32) - A
    P = A
    for _ in range(steps):
        P = mm(P, P, LOWP, BF16_EMUL)
        T = T + mm(T, P, LOWP, BF16_EMUL)
    return T


def squarings(max_path_len: int) -> int:
    """Squarings for ``unit_lower_inverse`` so that the product covers A^0 .. A^(max_path_len - 1)."""
    return max(int(max_path_len - 1).bit_length() - 1, 0)


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
