"""Plain-torch twin of the KV compaction kernel (``csrc_triton/kv_compaction.py``): the CPU path of
``vllm_bole.attention.kv_compaction.compact_accepted_kv``. The sequential reference beside it is
``vllm_bole.attention.kv_compaction.reference``.
"""
from __future__ import annotations

from typing import Sequence

import torch


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
