"""Triton kernel: accepted-path KV compaction over the paged caches of every layer at once.

``_compact_kv``: one program per (request, layer x {K, V}, kv head); all layers' caches are
addressed as element offsets from the first layer's pointer, so every layer goes in one launch.
Each program gathers the whole accepted path of its head into registers, then a barrier, then
scatters it: overlapping sources and destinations are safe. Paged layout as
``csrc_triton.tree_attention``; API, dispatch and torch twin: ``vllm_bole.attention.kv_compaction``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
) -> None:
    """One launch for all layers; see ``vllm_bole.attention.kv_compaction.compact_accepted_kv``."""
    ref = key_caches[0]
    caches = [c for pair in zip(key_caches, value_caches) for c in pair]
    for c in caches:
        assert c.dtype == ref.dtype and c.shape == ref.shape and c.stride() == ref.stride() and c.device == ref.device
    assert ref.stride(-1) == 1
    B, W = accepted.shape
    if B == 0 or W <= 1:
        return
    offsets = cache_offsets(caches)
    _, page_size, Hkv, D = ref.shape
    d_chunk = min(64, max(16, triton.next_power_of_2(D)))
    _compact_kv[(B, len(caches), Hkv)](
        ref, offsets, block_table, prefix_len, accepted, W, Hkv,
        ref.stride(0), ref.stride(1), ref.stride(2), block_table.stride(0), accepted.stride(0),
        PAGE_SIZE=page_size, HEAD_DIM=D, W_PAD=max(2, triton.next_power_of_2(W)), D_CHUNK=d_chunk,
        num_warps=4,
    )


_OFFSETS: dict[tuple, torch.Tensor] = {}


def cache_offsets(caches: list[torch.Tensor]) -> torch.Tensor:
    """int64 [2L] element offsets of the caches ``[K_0, V_0, K_1, ...]`` from ``caches[0]``, kept per set of
    cache addresses (caches do not move): no host-to-device copy per step, none inside a CUDA graph
    capture once the same caches were seen outside it (the tree graphs' eager run comes first)."""
    ref = caches[0]
    key = (ref.device, ref.element_size(), *(c.data_ptr() for c in caches))
    if key not in _OFFSETS:
        es = ref.element_size()
        offs = []
        for c in caches:
            diff = c.data_ptr() - ref.data_ptr()
            assert diff % es == 0
            offs.append(diff // es)
        if len(_OFFSETS) >= 64:  # caches re-allocated many times (tests): forget the old ones
            _OFFSETS.clear()
        _OFFSETS[key] = torch.tensor(offs, dtype=torch.int64).to(ref.device)
    return _OFFSETS[key]
