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
    Hkv = key_cache.shape[2]
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
        k, v = _request_kv(key_cache, value_cache, block_table, b, L, cdt, dev)
        words = anc[s:e, : (nk + 31) // 32]
        bits = ((words[:, :, None] >> shifts) & 1).reshape(n, -1)[:, :nk].bool()
        mask = torch.cat([torch.ones(n, P[b], dtype=torch.bool, device=dev), bits], dim=1)  # [n, L]
        scores = _scores(q[s:e].to(cdt), k, scale).view(Hkv, n, G, L)
        scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).view(Hkv, n * G, L)
        out[s:e] = _ungroup(torch.bmm(p, v.transpose(0, 1)), n).to(out.dtype)
    return out


def _request_kv(key_cache, value_cache, block_table, b: int, L: int, dtype, device):
    """Positions ``0 .. L - 1`` of request ``b``'s keys and values from the paged cache: [L, Hkv, D] each."""
    bs = key_cache.shape[1]
    pos = torch.arange(L, device=device)
    blk = block_table[b].to(device).long()[pos // bs]
    return key_cache[blk, pos % bs].to(dtype), value_cache[blk, pos % bs].to(dtype)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores of queries ``q`` [n, Hq, D] against keys ``k`` [L, Hkv, D], by kv group: [Hkv, n * G, L] (row
    ``i * G + g``: node ``i``, query head ``kv_head * G + g``)."""
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    qq = q.view(n, Hkv, Hq // Hkv, D).permute(1, 0, 2, 3).reshape(Hkv, -1, D)
    return torch.bmm(qq, k.permute(1, 2, 0)) * scale


def _ungroup(o: torch.Tensor, n: int) -> torch.Tensor:
    """[Hkv, n * G, D] rows in :func:`_scores`' order -> [n, Hq, D]."""
    Hkv, _, D = o.shape
    return o.view(Hkv, n, -1, D).permute(1, 0, 2, 3).reshape(n, -1, D)


def prefix_attention_torch(q, key_cache, value_cache, block_table, prefix_len, cu_nodes, *, scale, out, **_) -> torch.Tensor:
    """Every node's attention over its request's prefix alone (no tree keys), as FlashAttention computes it for
    ``tree_attention``'s ``prefix_attention``: writes the normalised output into ``out`` [T, Hq, D] (0 for a request
    without prefix) and returns the log-sum-exp of the scaled scores [Hq, T] fp32 (+inf without prefix, as
    FlashAttention's). The CPU stand-in of the adapter's FlashAttention call (tests, the torch path)."""
    T, Hq, D = q.shape
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
        k, v = _request_kv(key_cache, value_cache, block_table, b, L, torch.float32, q.device)
        scores = _scores(q[s:e].float(), k, scale)
        out[s:e] = _ungroup(torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1)), n).to(out.dtype)
        lse[:, s:e] = _ungroup(torch.logsumexp(scores, dim=-1)[..., None], n)[..., 0].T
    return lse
