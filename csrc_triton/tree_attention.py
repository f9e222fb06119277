"""Triton kernels: tree attention over a paged KV cache, and accepted-path KV compaction.

Plain-torch twins, the public API and the layout description live in
``vllm_bole.attention.tree_attention``; this module is imported lazily from there (on CPU it
only works under ``TRITON_INTERPRET=1``, which must be set before this module is imported).

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
  * two forms, picked by the autotuner: rows (S = Q K^T, [M, keys]; on Hopper q stays in shared
    memory as wgmma's A operand, P is the register A operand of P V) and swapped (S^T = K Q^T,
    acc^T = V^T P^T), the usual trick for small M;
  * optional split-K over the key range (for small batches): each split writes an unnormalised
    partial (acc, m, l) in fp32 and ``_tree_attn_reduce`` merges them.

Compaction kernel (``_compact_kv``): one program per (request, layer x {K, V}, kv head); all
layers' caches are addressed as element offsets from the first layer's pointer, so every layer
goes in one launch. Each program gathers the whole accepted path of its head into registers,
then a barrier, then scatters it: overlapping sources and destinations are safe.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
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
def _body_rows(
    Q, Out, Part_acc, Part_ml, Anc_mask, bt_row, k_base, v_base, qb, node_start, n_nodes, h, sp, P, kv_len, lo,
    mid, hi, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb, stride_vs,
    stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
    PAGE_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Scores as [BLOCK_M (node x head), BLOCK_N (keys)]: q is the A operand of QK^T, P of PV."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_PAD
    offs_d = tl.arange(0, HEAD_PAD)
    t, head, row_ok = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
    q_ptrs = Q + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    if PAD_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & _dmask(HEAD_DIM, HEAD_PAD)[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        pos, key_ok, blk, slot = _kv_tile(bt_row, start, kv_len, PAGE_SIZE, BLOCK_N, False)
        k_ptrs = k_base + blk[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_base + blk[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
        if PAD_D:
            k = tl.load(k_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for start in range(mid, hi, BLOCK_N):
        pos, key_ok, blk, slot = _kv_tile(bt_row, start, kv_len, PAGE_SIZE, BLOCK_N, True)
        k_ptrs = k_base + blk[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_base + blk[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
        if PAD_D:
            k = tl.load(k_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[:, None] & key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[None, :] & key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        t2, head2, row_ok2 = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
        j = pos - P  # local index of the tree node at this key (negative: prefix)
        is_tree = (j >= 0) & key_ok
        jj = tl.where(is_tree, j, 0)
        word = tl.load(Anc_mask + t2[:, None] * stride_anc + (jj // 32)[None, :],
                       mask=row_ok2[:, None] & is_tree[None, :], other=0)
        allowed = ((pos < P) & key_ok)[None, :] | (((word >> (jj % 32)[None, :]) & 1) != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    t, head, row_ok = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
    if SPLIT:
        pa = Part_acc + sp.to(tl.int64) * stride_ps + t[:, None] * stride_pt + head[:, None] * stride_ph
        tl.store(pa + offs_d[None, :], acc, mask=row_ok[:, None])
        pm = Part_ml + sp.to(tl.int64) * stride_ms + t * stride_mt + head * stride_mh
        tl.store(pm, m_i, mask=row_ok)
        tl.store(pm + 1, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = Out + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & _dmask(HEAD_DIM, HEAD_PAD)[None, :])


@triton.jit
def _body_cols(
    Q, Out, Part_acc, Part_ml, Anc_mask, bt_row, k_base, v_base, qb, node_start, n_nodes, h, sp, P, kv_len, lo,
    mid, hi, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb, stride_vs,
    stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
    PAGE_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Swapped operands: scores as [BLOCK_N (keys), BLOCK_M (node x head)] = K Q^T and
    acc^T [HEAD_PAD, BLOCK_M] += V^T P^T (q^T is a B operand)."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_PAD
    offs_d = tl.arange(0, HEAD_PAD)
    t, head, row_ok = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
    qt_ptrs = Q + t[None, :] * stride_qt + head[None, :] * stride_qh + offs_d[:, None]
    if PAD_D:
        qt = tl.load(qt_ptrs, mask=row_ok[None, :] & _dmask(HEAD_DIM, HEAD_PAD)[:, None], other=0.0)
    else:
        qt = tl.load(qt_ptrs, mask=row_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([HEAD_PAD, BLOCK_M], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        pos, key_ok, blk, slot = _kv_tile(bt_row, start, kv_len, PAGE_SIZE, BLOCK_N, False)
        k_ptrs = k_base + blk[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :]
        vt_ptrs = v_base + blk[None, :] * stride_vb + slot[None, :] * stride_vs + offs_d[:, None]
        if PAD_D:
            k = tl.load(k_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[None, :], other=0.0)
            vt = tl.load(vt_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            vt = tl.load(vt_ptrs)
        if IEEE:
            s = tl.dot(k, qt, input_precision="ieee")
        else:
            s = tl.dot(k, qt)
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        if IEEE:
            acc = acc * alpha[None, :] + tl.dot(vt, p.to(vt.dtype), input_precision="ieee")
        else:
            acc = acc * alpha[None, :] + tl.dot(vt, p.to(vt.dtype))
        m_i = m_new
    for start in range(mid, hi, BLOCK_N):
        pos, key_ok, blk, slot = _kv_tile(bt_row, start, kv_len, PAGE_SIZE, BLOCK_N, True)
        k_ptrs = k_base + blk[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :]
        vt_ptrs = v_base + blk[None, :] * stride_vb + slot[None, :] * stride_vs + offs_d[:, None]
        if PAD_D:
            k = tl.load(k_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[None, :] & key_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=_dmask(HEAD_DIM, HEAD_PAD)[:, None] & key_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=key_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(k, qt, input_precision="ieee")
        else:
            s = tl.dot(k, qt)
        s = s * qk_scale
        t2, head2, row_ok2 = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
        j = pos - P
        is_tree = (j >= 0) & key_ok
        jj = tl.where(is_tree, j, 0)
        word = tl.load(Anc_mask + t2[None, :] * stride_anc + (jj // 32)[:, None],
                       mask=row_ok2[None, :] & is_tree[:, None], other=0)
        allowed = ((pos < P) & key_ok)[:, None] | (((word >> (jj % 32)[:, None]) & 1) != 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        if IEEE:
            acc = acc * alpha[None, :] + tl.dot(vt, p.to(vt.dtype), input_precision="ieee")
        else:
            acc = acc * alpha[None, :] + tl.dot(vt, p.to(vt.dtype))
        m_i = m_new
    t, head, row_ok = _rows(qb, node_start, n_nodes, h, G, G_PAD, BLOCK_M)
    if SPLIT:
        pa = Part_acc + sp.to(tl.int64) * stride_ps + t[None, :] * stride_pt + head[None, :] * stride_ph
        tl.store(pa + offs_d[:, None], acc, mask=row_ok[None, :])
        pm = Part_ml + sp.to(tl.int64) * stride_ms + t * stride_mt + head * stride_mh
        tl.store(pm, m_i, mask=row_ok)
        tl.store(pm + 1, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[None, :]
        o_ptrs = Out + t[None, :] * stride_ot + head[None, :] * stride_oh + offs_d[:, None]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[None, :] & _dmask(HEAD_DIM, HEAD_PAD)[:, None])


@triton.jit(do_not_specialize=["tune_bucket"])
def _tree_attn_fwd(
    Q,  # [T, Hq, D]
    K_cache,  # [num_blocks, block_size, Hkv, D] (strided)
    V_cache,
    Out,  # [T, Hq, D]
    Block_table,  # [B, max_blocks] int32
    Prefix_len,  # [B] int
    Cu_nodes,  # [B + 1] int32
    Anc_mask,  # [T, W] int32 bit words, local node indices
    Part_acc,  # [S, T, Hq, HEAD_PAD] fp32 (SPLIT only)
    Part_ml,  # [S, T, Hq, 2] fp32 (SPLIT only): running max (log2 units) and sum
    qk_scale,  # softmax scale * log2(e)
    num_kv_heads,
    split_keys,  # keys per split (multiple of BLOCK_N)
    tune_bucket,  # unused by the kernel: a coarse problem-size class for the autotuner's key
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_anc,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ms,
    stride_mt,
    stride_mh,
    PAGE_SIZE: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SWAP: tl.constexpr,
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
    kv_len = P + n_nodes
    if SPLIT:
        lo = sp * split_keys
        hi = tl.minimum(lo + split_keys, kv_len)
    else:
        lo = 0
        hi = kv_len
    # Tiles [lo, mid) hold prefix keys only: no mask. [mid, hi) needs the tree mask.
    mid = tl.maximum(tl.minimum((P // BLOCK_N) * BLOCK_N, hi), lo)
    bt_row = Block_table + b.to(tl.int64) * stride_bt
    k_base = K_cache + h * stride_kh
    v_base = V_cache + h * stride_vh
    if SWAP:
        _body_cols(
            Q, Out, Part_acc, Part_ml, Anc_mask, bt_row, k_base, v_base, qb, node_start, n_nodes, h, sp, P, kv_len,
            lo, mid, hi, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb,
            stride_vs, stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
            PAGE_SIZE, G, G_PAD, HEAD_DIM, HEAD_PAD, SPLIT, IEEE, BLOCK_M, BLOCK_N,
        )
    else:
        _body_rows(
            Q, Out, Part_acc, Part_ml, Anc_mask, bt_row, k_base, v_base, qb, node_start, n_nodes, h, sp, P, kv_len,
            lo, mid, hi, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_vb,
            stride_vs, stride_anc, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
            PAGE_SIZE, G, G_PAD, HEAD_DIM, HEAD_PAD, SPLIT, IEEE, BLOCK_M, BLOCK_N,
        )


@triton.jit
def _tree_attn_reduce(
    Part_acc,
    Part_ml,
    Out,
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ms,
    stride_mt,
    stride_mh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
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


def _gpu_configs():
    """(BLOCK_M, BLOCK_N, warps, stages, SWAP), chosen by compiling for sm_90 on a machine without
    a GPU (Triton 3.9, head dim 256, bf16): all use wgmma with q from shared memory and cp.async
    gathers; registers / spill bytes: (64,32,8,3) 218/0, (128,16,8,3) 230/0, (64,16,4,3) 244/0,
    (128,32,8,3) 255/16, (64,32,4,3) 255/32, (64,64,8,2) 255/48, swapped (64,32,4,2) 254/0.
    Larger tiles spill hundreds of bytes or exceed 227 KB of shared memory."""
    cfgs = []
    for bm, bn, w, st, swap in [
        (64, 32, 8, 3, False),
        (128, 16, 8, 3, False),
        (64, 16, 4, 3, False),
        (128, 32, 8, 3, False),
        (64, 32, 4, 3, False),
        (64, 64, 8, 2, False),
        (64, 32, 4, 2, True),
    ]:
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "SWAP": swap}, num_warps=w, num_stages=st))
    return cfgs


def _prune(configs, named_args, **kwargs):
    g_pad = kwargs.get("G_PAD", named_args.get("G_PAD"))
    if kwargs.get("IEEE", named_args.get("IEEE")):
        # fp32 inputs (correctness paths only): big fp32 tiles spill kilobytes and compile for a minute.
        return [triton.Config({"BLOCK_M": max(16, g_pad), "BLOCK_N": 16, "SWAP": False}, num_warps=4, num_stages=1)]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] >= g_pad]
    return keep or [triton.Config({"BLOCK_M": g_pad, "BLOCK_N": 16, "SWAP": False}, num_warps=8, num_stages=2)]


_tree_attn_fwd_tuned = triton.autotune(
    configs=_gpu_configs(),
    key=["HEAD_PAD", "G_PAD", "SPLIT", "PAGE_SIZE", "IEEE", "tune_bucket"],
    prune_configs_by={"early_config_prune": _prune},
)(_tree_attn_fwd)

# Split-K granularity: every split is a multiple of this many keys (a multiple of every BLOCK_N).
SPLIT_ALIGN = 128
MIN_SPLIT_KEYS = 512


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_num_splits(batch: int, num_kv_heads: int, max_nodes: int, g_pad: int, max_kv_len: int, device) -> int:
    """Split the key range when the (request, kv head, query block) grid cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    base = batch * num_kv_heads * triton.cdiv(max_nodes * g_pad, 64)
    want = triton.cdiv(_num_sms(device), base)
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
) -> torch.Tensor:
    """Launch the tree attention kernel; arguments as ``vllm_bole.attention.tree_attention``.

    ``max_nodes`` / ``max_kv_len`` (host ints: the largest tree and largest prefix + tree of the
    batch; upper bounds are fine) size the grid and the splits without a device sync.
    ``block_m`` / ``block_n`` (and ``num_warps`` / ``num_stages``) force a tile (tests, sweeps);
    otherwise autotuned on GPU (keyed by head size, group, split, page size and a coarse size
    class) and (max(32, G_PAD), 16) in the interpreter.
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
    fixed_tile = block_m is not None or INTERPRET
    assert not swap or fixed_tile, "swap is an autotuned choice unless the tile is forced"
    bm = block_m if block_m is not None else max(32, G_PAD)
    bn = block_n if block_n is not None else 16
    S = num_splits if num_splits is not None else choose_num_splits(B, Hkv, max_nodes, G_PAD, max_kv_len, q.device)
    split_keys = 0
    if S > 1:
        align = bn if fixed_tile else SPLIT_ALIGN  # splits start on tile boundaries
        split_keys = triton.cdiv(triton.cdiv(max_kv_len, S), align) * align
        S = triton.cdiv(max_kv_len, split_keys)
    split = S > 1
    if split:
        part_acc = torch.empty(S, T, Hq, HEAD_PAD, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(S, T, Hq, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = torch.empty(1, 1, 1, 1, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(1, 1, 1, 2, device=q.device, dtype=torch.float32)
    ieee = q.dtype == torch.float32
    tune_bucket = (max(B * Hq * max_nodes, 1).bit_length() // 2) * 64 + max(max_kv_len, 1).bit_length() // 2
    args = (
        q, key_cache, value_cache, out, block_table, prefix_len, cu_nodes, anc_mask, part_acc, part_ml,
        float(scale) * _LOG2E, Hkv, split_keys, tune_bucket,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), anc_mask.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
    )
    consts = dict(PAGE_SIZE=page_size, G=G, G_PAD=G_PAD, HEAD_DIM=D, HEAD_PAD=HEAD_PAD, SPLIT=split, IEEE=ieee)
    if fixed_tile:
        assert bm >= G_PAD and bm >= 16 and bn >= 16 and (bm & (bm - 1)) == 0 and (bn & (bn - 1)) == 0
        grid = (triton.cdiv(max_nodes, bm // G_PAD), B * Hkv, S)
        _tree_attn_fwd[grid](
            *args, **consts, BLOCK_M=bm, BLOCK_N=bn, SWAP=bool(swap), num_warps=num_warps or 4,
            num_stages=num_stages or 2,
        )
    else:
        grid = lambda meta: (triton.cdiv(max_nodes, meta["BLOCK_M"] // G_PAD), B * Hkv, S)  # noqa: E731
        _tree_attn_fwd_tuned[grid](*args, **consts)
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


# ----------------------------------------------------------------------------- KV compaction
@triton.jit
def _compact_kv(
    Base,  # pointer of the first layer's key cache; every cache is Base + its element offset
    Offsets,  # [2 * L] int64: element offsets of layer l's key cache (2l) and value cache (2l+1)
    Block_table,
    Prefix_len,
    Accepted,  # [B, W] int32: local node indices of the accepted path, root first, -1 padded
    W,
    num_kv_heads,
    stride_b,
    stride_s,
    stride_h,
    stride_bt,
    stride_acc,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    W_PAD: tl.constexpr,
    D_CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)  # layer x {K, V}
    h = tl.program_id(2)
    j = tl.arange(0, W_PAD)
    src = tl.load(Accepted + b.to(tl.int64) * stride_acc + j, mask=j < W, other=-1)
    move = (src >= 0) & (src != j)
    P = tl.load(Prefix_len + b).to(tl.int32)
    src_pos = P + tl.where(move, src, 0)
    dst_pos = P + j
    bt_row = Block_table + b.to(tl.int64) * stride_bt
    src_blk = tl.load(bt_row + src_pos // PAGE_SIZE, mask=move, other=0).to(tl.int64)
    dst_blk = tl.load(bt_row + dst_pos // PAGE_SIZE, mask=move, other=0).to(tl.int64)
    off = tl.load(Offsets + c)
    base = Base + off + h * stride_h
    src_row = src_blk * stride_b + (src_pos % PAGE_SIZE) * stride_s
    dst_row = dst_blk * stride_b + (dst_pos % PAGE_SIZE) * stride_s
    offs_d = tl.arange(0, D_CHUNK)
    # Chunks of the head dimension touch disjoint addresses: only load -> store needs a barrier.
    for d0 in range(0, HEAD_DIM, D_CHUNK):
        d = d0 + offs_d
        msk = move[:, None] & (d < HEAD_DIM)[None, :]
        x = tl.load(base + src_row[:, None] + d[None, :], mask=msk, other=0.0)
        tl.debug_barrier()
        tl.store(base + dst_row[:, None] + d[None, :], x, mask=msk)
        tl.debug_barrier()


def compact_accepted_kv_triton(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    accepted: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> None:
    """One launch for all layers; see ``vllm_bole.attention.tree_attention.compact_accepted_kv``.

    ``offsets`` (int64 [2L] on the device, from ``cache_offsets``) may be precomputed once, since
    the caches do not move; otherwise it is built here (a small host-to-device copy).
    """
    ref = key_caches[0]
    caches = [c for pair in zip(key_caches, value_caches) for c in pair]
    for c in caches:
        assert c.dtype == ref.dtype and c.shape == ref.shape and c.stride() == ref.stride() and c.device == ref.device
    assert ref.stride(-1) == 1
    B, W = accepted.shape
    if B == 0 or W <= 1:
        return
    if offsets is None:
        offsets = cache_offsets(key_caches, value_caches)
    _, page_size, Hkv, D = ref.shape
    d_chunk = min(64, max(16, triton.next_power_of_2(D)))
    _compact_kv[(B, len(caches), Hkv)](
        ref, offsets, block_table, prefix_len, accepted, W, Hkv,
        ref.stride(0), ref.stride(1), ref.stride(2), block_table.stride(0), accepted.stride(0),
        PAGE_SIZE=page_size, HEAD_DIM=D, W_PAD=max(2, triton.next_power_of_2(W)), D_CHUNK=d_chunk,
        num_warps=4,
    )


def cache_offsets(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]) -> torch.Tensor:
    """int64 [2L] element offsets of every layer's K and V cache from ``key_caches[0]``."""
    ref = key_caches[0]
    es = ref.element_size()
    offs = []
    for c in (c for pair in zip(key_caches, value_caches) for c in pair):
        diff = c.data_ptr() - ref.data_ptr()
        assert diff % es == 0
        offs.append(diff // es)
    return torch.tensor(offs, dtype=torch.int64).to(ref.device)
