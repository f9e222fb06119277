"""Float64 reference of tree attention (the oracle of ``vllm_bole.attention.tree_attention``).

Node ``i`` attends to the whole committed prefix of its request plus its ancestors-or-self; no
causal mask inside the prefix is needed (the prefix precedes every node). Dense attention per
request in float64 from the nodes' own K/V and the prefixes (not from a paged cache).
Siblings: ``csrc_triton/tree_attention.py`` (kernel), ``vllm_bole/attention/tree_attention/naive.py``.
"""
from __future__ import annotations

import torch

_F64 = torch.float64


def attention_tree_reference(tree, q, k, v, k_prefix, v_prefix, *, scale=None):
    """Full attention of the tree nodes.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (the nodes' own K/V, RoPE already applied); k_prefix,
    v_prefix: lists of B tensors [L_b, Hkv, D] (committed prefix per request, may be empty).
    Node i attends to its request's whole prefix plus its ancestors-or-self. Query head h uses
    kv head h // (Hq // Hkv); scale defaults to D ** -0.5. Returns o [T, Hq, D] float64.
    """
    T, Hq, Dh = q.shape
    Hkv = k.shape[1]
    assert Hq % Hkv == 0 and k.shape == v.shape == (T, Hkv, Dh), "k/v must be [T, Hkv, D], Hq % Hkv == 0"
    assert len(k_prefix) == len(v_prefix) == tree.num_requests, "one prefix per request"
    scale = Dh**-0.5 if scale is None else scale
    q, k, v = q.to(_F64), k.to(_F64), v.to(_F64)
    o = torch.zeros(T, Hq, Dh, dtype=_F64, device=q.device)
    cu = tree.cu_nodes.tolist()
    path = tree.path.long().to(q.device)
    depth = tree.depth.long().to(q.device)
    for r in range(tree.num_requests):
        s, e = cu[r], cu[r + 1]
        n, L = e - s, k_prefix[r].shape[0]
        # anc[i, j]: local j is an ancestor-or-self of local i  <=>  path[i, depth[j]] == j
        j = torch.arange(n, device=q.device)
        anc = path[s:e][:, depth[s:e]] == j[None, :]
        keys = torch.cat([k_prefix[r].to(q.device, _F64), k[s:e]]).repeat_interleave(Hq // Hkv, dim=1)
        vals = torch.cat([v_prefix[r].to(q.device, _F64), v[s:e]]).repeat_interleave(Hq // Hkv, dim=1)
        mask = torch.cat([torch.ones(n, L, dtype=torch.bool, device=q.device), anc], dim=1)  # [n, L + n]
        scores = torch.einsum("ihd,jhd->hij", q[s:e], keys) * scale
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o[s:e] = torch.einsum("hij,jhd->ihd", p, vals)
    return o
