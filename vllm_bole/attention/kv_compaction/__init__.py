"""Accepted-path KV compaction over the paged caches of every full-attention layer: the public API.

After acceptance, each request's accepted-path K/V (written at the tree's slots, flat node order,
``vllm_bole.attention.tree_attention.tree_slot_mapping``) moves to positions
``prefix_len .. prefix_len + m - 1``, so the cache holds exactly what autoregressive decoding of
the accepted tokens would have written. Three implementations side by side:
  csrc_triton/kv_compaction.py                     the Triton kernel (one launch for all layers)
  vllm_bole/attention/kv_compaction/naive.py       its plain-torch twin (one gather, one scatter)
  vllm_bole/attention/kv_compaction/reference.py   the sequential reference (position by position)
Paged layout as ``vllm_bole.attention.tree_attention``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from vllm_bole.attention.kv_compaction.naive import compact_accepted_kv_torch
from vllm_bole.dispatch import use_triton


def compact_accepted_kv(
    key_caches: Sequence[torch.Tensor] | torch.Tensor,
    value_caches: Sequence[torch.Tensor] | torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: torch.Tensor,
    accepted: torch.Tensor,
    *,
    kernels: str = "auto",
) -> None:
    """Move each request's accepted-path K/V to positions ``prefix_len .. prefix_len + m - 1``,
    in place, for every layer at once.

    key_caches / value_caches: the full-attention layers' paged views (module docstring), a list
    (one per layer, all with one shape, dtype and strides, sharing ``block_table``) or a single
    tensor for one layer. accepted: [B, W] int32 local node indices of the accepted path, root
    first (``accepted[b, 0] == 0``), strictly increasing, padded with -1 (``accepted_path``).
    Node ``accepted[b, j]`` sits at position ``prefix_len + accepted[b, j] >= prefix_len + j``
    (written in flat node order), so sources and destinations may overlap; both backends
    gather before they scatter. Triton: one launch for all layers (the caches' offsets from the first
    are kept per set of cache addresses: ``csrc_triton.kv_compaction.cache_offsets``).
    """
    if isinstance(key_caches, torch.Tensor):
        key_caches, value_caches = [key_caches], [value_caches]
    key_caches, value_caches = list(key_caches), list(value_caches)
    if len(key_caches) != len(value_caches) or not key_caches:
        raise ValueError("need one value cache per key cache, at least one layer")
    if not use_triton(kernels, key_caches[0]):
        return compact_accepted_kv_torch(key_caches, value_caches, block_table, prefix_len, accepted)
    from csrc_triton.kv_compaction import compact_accepted_kv_triton  # lazy, as the interpreter requires

    compact_accepted_kv_triton(key_caches, value_caches, block_table, prefix_len, accepted)
