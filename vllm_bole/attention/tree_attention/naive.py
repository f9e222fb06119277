"""Plain-torch twin of the tree attention kernel (``csrc_triton/tree_attention.py``): the CPU
path of ``vllm_bole.attention.tree_attention.tree_attention``. The float64 reference beside it is
``vllm_bole.attention.tree_attention.reference``.
"""
from __future__ import annotations

import torch


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
    num_keys: torch.Tensor | None = None,
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
    NK = num_keys.tolist() if num_keys is not None else None
    anc = tree.anc_mask.to(dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        n = e - s
        if n == 0:
            continue
        nk = NK[b] if NK is not None else n
        L = P[b] + nk
        pos = torch.arange(L, device=dev)
        blk = block_table[b].to(dev).long()[pos // bs]
        off = pos % bs
        k = key_cache[blk, off].to(cdt)  # [L, Hkv, D]
        v = value_cache[blk, off].to(cdt)
        words = anc[s:e, : (nk + 31) // 32]
        bits = ((words[:, :, None] >> shifts) & 1).reshape(n, -1)[:, :nk].bool()
        mask = torch.cat([torch.ones(n, P[b], dtype=torch.bool, device=dev), bits], dim=1)  # [n, L]
        qq = q[s:e].to(cdt).view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
        scores = torch.bmm(qq, k.permute(1, 2, 0)).view(Hkv, n, G, L) * scale
        scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).view(Hkv, n * G, L)
        o = torch.bmm(p, v.transpose(0, 1)).view(Hkv, n, G, D).permute(1, 0, 2, 3)
        out[s:e] = o.reshape(n, Hq, D).to(out.dtype)
    return out


def prefix_attention_torch(q, key_cache, value_cache, block_table, prefix_len, cu_nodes, *, scale, out, **_) -> torch.Tensor:
    """Every node's attention over its request's prefix alone (no tree keys), as FlashAttention computes it for
    ``tree_attention``'s ``prefix_attention``: writes the normalised output into ``out`` [T, Hq, D] (0 for a request
    without prefix) and returns the log-sum-exp of the scaled scores [Hq, T] fp32 (+inf without prefix, as
    FlashAttention's). The CPU stand-in of the adapter's FlashAttention call (tests, the torch path)."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = key_cache.shape
    G = Hq // Hkv
    lse = torch.full((Hq, T), float("inf"), dtype=torch.float32, device=q.device)
    cu, P = cu_nodes.tolist(), prefix_len.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        n, L = e - s, P[b]
        if n == 0:
            continue
        if L == 0:
            out[s:e] = 0
            continue
        pos = torch.arange(L, device=q.device)
        blk = block_table[b].long()[pos // bs]
        k = key_cache[blk, pos % bs].float()  # [L, Hkv, D]
        v = value_cache[blk, pos % bs].float()
        qq = q[s:e].float().view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
        scores = torch.bmm(qq, k.permute(1, 2, 0)) * scale  # [Hkv, n G, L]
        o = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))
        out[s:e] = o.view(Hkv, n, G, D).permute(1, 0, 2, 3).reshape(n, Hq, D).to(out.dtype)
        lse[:, s:e] = torch.logsumexp(scores, dim=-1).view(Hkv, n, G).permute(0, 2, 1).reshape(Hq, n)
    return lse
