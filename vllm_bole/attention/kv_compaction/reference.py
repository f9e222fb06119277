"""Sequential reference of the KV compaction (the oracle of ``vllm_bole.attention.kv_compaction``):
what autoregressive decoding of the accepted tokens writes, position by position, from a snapshot
of the cache taken before the move (so overlapping sources and destinations cannot matter).
Siblings: ``csrc_triton/kv_compaction.py`` (kernel), ``vllm_bole/attention/kv_compaction/naive.py``.
"""
from __future__ import annotations

from typing import Sequence

import torch


def compaction_reference(caches: Sequence[torch.Tensor], block_table, prefix_len, accepted) -> list[torch.Tensor]:
    """Copies of ``caches`` (one layer side each, ``[num_blocks, block_size, Hkv, D]``) after the
    compaction of ``accepted`` ([B, W] local node indices, root first, -1 padded)."""
    bs = caches[0].shape[1]
    snap = [c.detach().cpu().clone() for c in caches]
    out = [c.clone() for c in snap]
    bt, P = block_table.cpu().long(), prefix_len.cpu().long()
    for b, row in enumerate(accepted.cpu().tolist()):
        for j, node in enumerate(x for x in row if x >= 0):
            src, dst = int(P[b]) + node, int(P[b]) + j
            for s, o in zip(snap, out):
                o[bt[b, dst // bs], dst % bs] = s[bt[b, src // bs], src % bs]
    return out
