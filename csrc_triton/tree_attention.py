"""Triton kernel: tree attention over a paged KV cache.

The public API and the layout description live in ``vllm_bole.attention.tree_attention``, the
plain-torch twin beside it in ``naive.py``, the float64 reference in ``reference.py``; the
accepted-path KV compaction kernel is ``csrc_triton.kv_compaction``. Imported lazily by the API
(on CPU it only works under ``TRITON_INTERPRET=1``, set before this module is imported).

Paged layout (vLLM's Triton attention backend, per layer and per side):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], any strides
    with stride(-1) == 1; block_table: [B, max_blocks_per_req] int32; token position ``p`` of
    request ``b`` lives in block ``block_table[b, p // block_size]`` at offset ``p % block_size``.

Tree attention kernel (``_tree_attn_fwd``), flash-decoding style:
  * one program per (block of query nodes, request x kv head, key split); the query-block index
    is the fastest grid axis so the programs sharing one request's prefix run together and
    share it through L2;
  * the M dimension of every ``tl.dot`` is (BLOCK_M // G_PAD nodes) x (G_PAD query heads of one
    kv group): row r is node ``r // G_PAD``, query head ``kv_head * G + r % G_PAD``;
  * keys are positions 0 .. prefix_len + N_b - 1 of the request's paged cache (the tree nodes'
    K/V sit in slots prefix_len .. prefix_len + N_b - 1, in flat node order). The whole-prefix
    tiles run without masks; the remaining tiles (the prefix's tail and the tree) apply
    "key < prefix_len  or  bit (key - prefix_len) of anc_mask[node]";
  * online softmax in fp32 with exp2 (scale * log2 e folded into the scores);
  * two forms of one online-softmax body (``_attend``, oriented by ``_outer``): rows (S = Q K^T, [M, keys]; on Hopper q stays in shared memory as wgmma's A
    operand, P is the register A operand of P V) and swapped (S^T = K Q^T, acc^T = V^T P^T),
    the usual trick for small M;
  * optional split-K over the key range (for small batches): each split writes an unnormalised
    partial (acc, m, l) in fp32 and ``_tree_attn_reduce`` merges them;
  * optional prefix from elsewhere (``PREFIX_IN``): the prefix's normalised output and log-sum-exp
    (vLLM's FlashAttention, ``vllm_bole.adapter.flash_prefix``) are merged into the online state
    before the store, and the kernel reads only the tree's keys.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from csrc_triton.tiles import INTERPRET, num_sms

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- tree attention
@triton.jit
def _kv_tile(bt_row, start, kv_len, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Positions of one key tile, their physical blocks (int64) and in-block slots."""
    pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = pos < kv_len
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        key_ok = pos >= 0
        blk = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
    return pos, key_ok, blk, pos % PAGE_SIZE


@triton.jit
def _rows(qb, node_start, n_nodes, h, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row r of a query tile: local node ``qb * BLOCK_Q + r // G_PAD``, query head
    ``h * G + r % G_PAD``. Returns flat node index (int64), query head and validity."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    rows = tl.arange(0, BLOCK_M)
    node = qb * BLOCK_Q + rows // G_PAD
    gh = rows % G_PAD
    return (node_start + node).to(tl.int64), h * G + gh, (node < n_nodes) & (gh < G)


@triton.jit
def _dmask(HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    return tl.arange(0, HEAD_PAD) < HEAD_DIM


@triton.jit
def _outer(row_vec, col_vec, SWAP: tl.constexpr):
    """(row_vec[:, None], col_vec[None, :]) in the tile's orientation: [rows = query x head,
    cols = keys or head dim] normally, transposed when SWAP."""
    if SWAP:  # one return: Triton checks every return of a function against the others
        r, c = row_vec[None, :], col_vec[:, None]
    else:
        r, c = row_vec[:, None], col_vec[None, :]
    return r, c


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend(
    acc, m_i, l_i, q, Anc_mask, bt_row, k_base, v_base, start, kv_len, P, t, row_ok, qk_scale,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_anc,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SWAP: tl.constexpr,
):
    """One key tile of the online softmax. Rows form: S = Q K^T [M, N], acc [M, D] += P V (q is
    wgmma's A operand, P the register A operand of P V). SWAP: S^T = K Q^T [N, M], acc^T [D, M]
    += V^T P^T (q^T a B operand: the usual trick for small M). MASKED tiles (the prefix's tail
    and the tree) allow "key < prefix_len or bit (key - prefix_len) of anc_mask[node]"."""
    AX: tl.constexpr = 0 if SWAP else 1  # the key axis of the score tile
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_PAD
    offs_d = tl.arange(0, HEAD_PAD)
    pos, key_ok, blk, slot = _kv_tile(bt_row, start, kv_len, PAGE_SIZE, BLOCK_N, MASKED)
    blk_c, d_r = _outer(blk, offs_d, not SWAP)  # K^T as [D, N] (rows) or K as [N, D] (SWAP)
    slot_c, _ = _outer(slot, offs_d, not SWAP)
    k_ptrs = k_base + blk_c * stride_kb + slot_c * stride_ks + d_r
    blk_v, d_v = _outer(blk, offs_d, SWAP)  # V as [N, D] (rows) or V^T as [D, N] (SWAP)
    slot_v, _ = _outer(slot, offs_d, SWAP)
    v_ptrs = v_base + blk_v * stride_vb + slot_v * stride_vs + d_v
    if MASKED or PAD_D:
        kk, dk = _outer(key_ok, _dmask(HEAD_DIM, HEAD_PAD), not SWAP)
        kv, dv = _outer(key_ok, _dmask(HEAD_DIM, HEAD_PAD), SWAP)
        if MASKED and PAD_D:
            k = tl.load(k_ptrs, mask=kk & dk, other=0.0)
            v = tl.load(v_ptrs, mask=kv & dv, other=0.0)
        elif MASKED:
            k = tl.load(k_ptrs, mask=kk, other=0.0)
            v = tl.load(v_ptrs, mask=kv, other=0.0)
        else:
            k = tl.load(k_ptrs, mask=dk, other=0.0)
            v = tl.load(v_ptrs, mask=dv, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if SWAP:
        s = _dot(k, q, IEEE) * qk_scale
    else:
        s = _dot(q, k, IEEE) * qk_scale
    if MASKED:
        j = pos - P  # local index of the tree node at this key (negative: prefix)
        is_tree = (j >= 0) & key_ok
        jj = tl.where(is_tree, j, 0)
        t_r, jw_c = _outer(t, jj // 32, SWAP)
        ok_r, tree_c = _outer(row_ok, is_tree, SWAP)
        word = tl.load(Anc_mask + t_r * stride_anc + jw_c, mask=ok_r & tree_c, other=0)
        _, bit_c = _outer(t, jj % 32, SWAP)
        _, pre_c = _outer(t, (pos < P) & key_ok, SWAP)
        s = tl.where(pre_c | (((word >> bit_c) & 1) != 0), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, AX))
    if MASKED:  # a row may have no allowed key yet in this tile
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    alpha = tl.exp2(m_i - m_new_safe)
    m_b, _ = _outer(m_new_safe, offs_d, SWAP)
    p = tl.exp2(s - m_b)
    l_i = l_i * alpha + tl.sum(p, AX)
    alpha_b, _ = _outer(alpha, offs_d, SWAP)
    if SWAP:
        acc = acc * alpha_b + _dot(v, p.to(v.dtype), IEEE)
    else:
        acc = acc * alpha_b + _dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _attn_body(
    Q, Out, Part_acc, Part_ml, Pre_out, Pre_lse, Anc_mask, bt_row, k_base, v_base, qb, node_start, n_nodes, h, sp, P,
    kv_len, lo, mid, hi, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb,
    stride_vs, stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh, stride_lh, stride_lt,
    PAGE_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr,
    PREFIX_IN: tl.constexpr,
):
    """The online softmax over keys [lo, hi) of one query block: unmasked prefix tiles [lo, mid),
    then masked tiles [mid, hi); writes the normalised output, or the split's partial. PREFIX_IN: the keys
    before ``lo`` were attended elsewhere (normalised output ``Pre_out`` [T, Hq, D] strided as ``Out``,
    log-sum-exp ``Pre_lse`` [Hq, T] in natural-log units of the scaled scores; a non-finite one: no keys),
    i.e. the online state (m = lse in log2 units, l = 1, acc = output): merged in before the store."""
    offs_d = tl.arange(0, HEAD_PAD)
    t, head, row_ok = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
    t_r, d_c = _outer(t, offs_d, SWAP)
    head_r, _ = _outer(head, offs_d, SWAP)
    ok_r, dm_c = _outer(row_ok, _dmask(HEAD_DIM, HEAD_PAD), SWAP)
    q = tl.load(Q + t_r * stride_qt + head_r * stride_qh + d_c, mask=ok_r & dm_c, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([HEAD_PAD, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, Anc_mask, bt_row, k_base, v_base, start, kv_len, P, t, row_ok,
                                qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_anc,
                                PAGE_SIZE, HEAD_DIM, HEAD_PAD, IEEE, BLOCK_N, False, SWAP)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, Anc_mask, bt_row, k_base, v_base, start, kv_len, P, t, row_ok,
                                qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, stride_anc,
                                PAGE_SIZE, HEAD_DIM, HEAD_PAD, IEEE, BLOCK_N, True, SWAP)
    if PREFIX_IN:
        lse = tl.load(Pre_lse + head * stride_lh + t * stride_lt, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        m_p = tl.where((lse == lse) & (tl.abs(lse) < float("inf")), lse, float("-inf"))  # FA: +inf without keys
        m_new = tl.maximum(tl.maximum(m_i, m_p), -1e30)  # finite: padding rows have no keys at all
        w_p = tl.exp2(m_p - m_new)
        w_t = tl.exp2(m_i - m_new)
        l_i = l_i * w_t + w_p
        w_p_r, _ = _outer(w_p, offs_d, SWAP)
        w_t_r, _ = _outer(w_t, offs_d, SWAP)
        pre = tl.load(Pre_out + t_r * stride_ot + head_r * stride_oh + d_c, mask=ok_r & dm_c & (w_p_r > 0.0),
                      other=0.0)
        acc = acc * w_t_r + pre.to(tl.float32) * w_p_r
    if SPLIT:
        tl.store(Part_acc + sp.to(tl.int64) * stride_ps + t_r * stride_pt + head_r * stride_ph + d_c, acc, mask=ok_r)
        pm = Part_ml + sp.to(tl.int64) * stride_ms + t * stride_mt + head * stride_mh
        tl.store(pm, m_i, mask=row_ok)
        tl.store(pm + 1, l_i, mask=row_ok)
    else:
        l_b, _ = _outer(tl.where(l_i > 0.0, l_i, 1.0), offs_d, SWAP)
        tl.store(Out + t_r * stride_ot + head_r * stride_oh + d_c, (acc / l_b).to(Out.dtype.element_ty), mask=ok_r & dm_c)


@triton.jit
def _tree_attn_fwd(
    Q,  # [T, Hq, D]
    K_cache,  # [num_blocks, block_size, Hkv, D] (strided)
    V_cache,
    Out,  # [T, Hq, D]
    Block_table,  # [B, max_blocks] int32
    Prefix_len,  # [B] int
    Cu_nodes,  # [B + 1] int32
    Num_keys,  # [B] int32 tree keys per request (HAS_NUM_KEYS; else the request's query rows)
    Anc_mask,  # [T, W] int32 bit words, local node (key) indices
    Part_acc,  # [S, T, Hq, HEAD_PAD] fp32 (SPLIT only)
    Part_ml,  # [S, T, Hq, 2] fp32 (SPLIT only): running max (log2 units) and sum
    Pre_out,  # [T, Hq, D] (PREFIX_IN only): the prefix's attention, strided as Out
    Pre_lse,  # [Hq, T] fp32 (PREFIX_IN only): its log-sum-exp (natural log)
    qk_scale,  # softmax scale * log2(e)
    num_kv_heads,
    split_keys,  # keys per split (multiple of BLOCK_N)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh, stride_lh, stride_lt,
    PAGE_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SWAP: tl.constexpr, HAS_NUM_KEYS: tl.constexpr, PREFIX_IN: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // num_kv_heads
    h = bh % num_kv_heads

    node_start = tl.load(Cu_nodes + b)
    n_nodes = tl.load(Cu_nodes + b + 1) - node_start
    if qb * BLOCK_Q >= n_nodes:
        return
    P = tl.load(Prefix_len + b).to(tl.int32)
    if HAS_NUM_KEYS:
        kv_len = P + tl.load(Num_keys + b)
    else:
        kv_len = P + n_nodes
    if SPLIT:
        lo = sp * split_keys
        hi = tl.minimum(lo + split_keys, kv_len)
    elif PREFIX_IN:  # the prefix's keys are in Pre_out / Pre_lse: the tree's keys only
        lo = P
        hi = kv_len
    else:
        lo = 0
        hi = kv_len
    # Tiles [lo, mid) hold prefix keys only: no mask. [mid, hi) needs the tree mask.
    mid = tl.maximum(tl.minimum((P // BLOCK_N) * BLOCK_N, hi), lo)
    bt_row = Block_table + b.to(tl.int64) * stride_bt
    k_base = K_cache + h * stride_kh
    v_base = V_cache + h * stride_vh
    _attn_body(
        Q, Out, Part_acc, Part_ml, Pre_out, Pre_lse, Anc_mask, bt_row, k_base, v_base, qb, node_start, n_nodes, h, sp,
        P, kv_len, lo, mid, hi, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb,
        stride_vs, stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh, stride_lh, stride_lt,
        PAGE_SIZE, G, G_PAD, HEAD_DIM, HEAD_PAD, SPLIT, IEEE, BLOCK_M, BLOCK_N, SWAP, PREFIX_IN,
    )


@triton.jit
def _tree_attn_reduce(
    Part_acc, Part_ml, Out, num_splits, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_PAD)
    pm = Part_ml + offs_s.to(tl.int64) * stride_ms + t * stride_mt + head * stride_mh
    m = tl.load(pm, mask=s_ok, other=float("-inf"))
    l = tl.load(pm + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # 0 for empty splits (m = -inf)
    w = tl.where(s_ok, w, 0.0)
    pa = Part_acc + offs_s.to(tl.int64)[:, None] * stride_ps + t * stride_pt + head * stride_ph + offs_d[None, :]
    acc = tl.load(pa, mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    o = num / den
    tl.store(Out + t * stride_ot + head * stride_oh + offs_d, o.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


# (BLOCK_M, BLOCK_N, warps, stages, SWAP) that compile for sm_90 without spills (Triton 3.9, head dim
# 256, bf16; registers / spill bytes): (64,32,8,3) 218/0, (128,16,8,3) 230/0, (64,16,4,3) 244/0,
# (128,32,8,3) 255/16, (64,32,4,3) 255/32, (64,64,8,2) 255/48, swapped (64,32,4,2) 254/0. Larger tiles
# spill hundreds of bytes or exceed 227 KB of shared memory. The benchmark sweeps them.
GPU_TILES = (
    (64, 32, 8, 3, False),
    (128, 16, 8, 3, False),
    (64, 16, 4, 3, False),
    (128, 32, 8, 3, False),
    (64, 32, 4, 3, False),
    (64, 64, 8, 2, False),
    (64, 32, 4, 2, True),
)
LONG_KEYS = 256  # from this many keys (prefix + tree) 16-bit inputs take 32-key tiles


def gpu_tile(max_kv_len: int, g_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of 16-bit inputs on the GPU: a fixed rule, no autotuning.

    Decision: Triton's autotuner benchmarks every candidate at the first launch of each key, and the
    tree step's shapes (requests, nodes, prefix) change every step: on the H200 (46e7407) a trained pair
    at 32 requests re-tuned for 1-7 s at new size classes in the middle of serving, whatever the
    warm-up had covered. Its picks there were (64, 16, 4, 3) below 256 keys and mostly (64, 32, 4, 3)
    above, which this rule takes; a kernel variant is then a (BLOCK_N, split) pair that the engine's
    warm-up compiles once."""
    return max(64, g_pad), (32 if max_kv_len >= LONG_KEYS else 16), 4, 3


# Split-K granularity: every split is a multiple of this many keys (a multiple of every BLOCK_N).
SPLIT_ALIGN = 128
MIN_SPLIT_KEYS = 256  # 512 left a one-query draft step at 17 us a call over 600 keys (H200, 345ea0b)


def choose_num_splits(batch: int, num_kv_heads: int, max_nodes: int, g_pad: int, max_kv_len: int, device) -> int:
    """Split the key range when the (request, kv head, query block) grid cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    base = batch * num_kv_heads * triton.cdiv(max_nodes * g_pad, 64)
    want = triton.cdiv(num_sms(device), base)
    return max(1, min(want, max_kv_len // MIN_SPLIT_KEYS))


def tree_attention_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    cu_nodes: torch.Tensor,
    anc_mask: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor,
    max_nodes: int,
    max_kv_len: int,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    swap: bool = False,
    num_keys: torch.Tensor | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Launch the tree attention kernel; arguments as ``vllm_bole.attention.tree_attention``.

    ``prefix`` = (output [T, Hq, D] strided as ``out``, log-sum-exp [Hq, T] fp32): the nodes' attention over
    their prefixes alone, computed elsewhere; the kernel then reads only the tree's keys and continues that
    softmax (no key splits).

    ``max_nodes`` / ``max_kv_len`` (host ints: the largest tree and largest prefix + tree of the
    batch; upper bounds are fine) size the grid and the splits without a device sync.
    ``block_m`` / ``block_n`` (and ``num_warps`` / ``num_stages``) force a tile (tests, sweeps);
    otherwise 16-bit inputs on the GPU take :func:`gpu_tile`'s tile, fp32 inputs (max(16, G_PAD), 16),
    and 16-bit ones (max(32, G_PAD), 16) in the interpreter.
    """
    T, Hq, D = q.shape
    _, page_size, Hkv, Dk = key_cache.shape
    assert Dk == D and value_cache.shape == key_cache.shape and Hq % Hkv == 0
    assert q.stride(-1) == 1 and out.stride(-1) == 1
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    B = cu_nodes.numel() - 1
    G = Hq // Hkv
    G_PAD = triton.next_power_of_2(G)
    HEAD_PAD = max(16, triton.next_power_of_2(D))
    if T == 0:
        return out
    ieee = q.dtype == torch.float32
    # fp32 inputs (correctness paths) take a small tile: big fp32 tiles spill kilobytes and compile for a minute
    rule = block_m is None and q.is_cuda and not (INTERPRET or ieee)
    if rule:  # with the prefix attended elsewhere the kernel reads the tree's keys only
        bm, bn, warps, stages = gpu_tile(max_kv_len if prefix is None else max_nodes, G_PAD)
    else:
        bm, bn, warps, stages = block_m or max(16 if ieee else 32, G_PAD), 16, 4, (1 if ieee else 2)
    bn, warps, stages = block_n or bn, num_warps or warps, num_stages or stages
    if prefix is not None:
        assert prefix[0].stride() == out.stride() and prefix[1].shape == (Hq, T)
        S = 1
    else:
        S = num_splits if num_splits is not None else choose_num_splits(B, Hkv, max_nodes, G_PAD, max_kv_len, q.device)
    split_keys = 0
    if S > 1:
        align = SPLIT_ALIGN if rule else bn  # splits start on tile boundaries
        split_keys = triton.cdiv(triton.cdiv(max_kv_len, S), align) * align
        S = triton.cdiv(max_kv_len, split_keys)
    split = S > 1
    if split:
        part_acc = torch.empty(S, T, Hq, HEAD_PAD, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(S, T, Hq, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = torch.empty(1, 1, 1, 1, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(1, 1, 1, 2, device=q.device, dtype=torch.float32)
    pre_out, pre_lse = prefix if prefix is not None else (out, part_ml)
    args = (
        q, key_cache, value_cache, out, block_table, prefix_len, cu_nodes,
        num_keys if num_keys is not None else cu_nodes, anc_mask, part_acc, part_ml, pre_out, pre_lse,
        float(scale) * _LOG2E, Hkv, split_keys,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), anc_mask.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2), pre_lse.stride(0), pre_lse.stride(1),
    )
    consts = dict(PAGE_SIZE=page_size, G=G, G_PAD=G_PAD, HEAD_DIM=D, HEAD_PAD=HEAD_PAD, SPLIT=split, IEEE=ieee,
                  HAS_NUM_KEYS=num_keys is not None, PREFIX_IN=prefix is not None)
    assert bm >= G_PAD and bm >= 16 and bn >= 16 and (bm & (bm - 1)) == 0 and (bn & (bn - 1)) == 0
    grid = (triton.cdiv(max_nodes, bm // G_PAD), B * Hkv, S)
    _tree_attn_fwd[grid](*args, **consts, BLOCK_M=bm, BLOCK_N=bn, SWAP=bool(swap), num_warps=warps, num_stages=stages)
    if split:
        _tree_attn_reduce[(T, Hq)](
            part_acc, part_ml, out, S,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
            out.stride(0), out.stride(1),
            HEAD_DIM=D, HEAD_PAD=HEAD_PAD, S_PAD=max(2, triton.next_power_of_2(S)),
            num_warps=4,
        )
    return out
