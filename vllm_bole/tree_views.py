"""Views of a ``TreeBatch`` for the plain-torch twins and the float64 references.

* ``padded_tree`` / ``pad_nodes``: the padded per-request view ([B, N] positions) with its
  ancestor-or-self mask and a function padding node tensors, for the closed forms of the torch twins.
* ``depth_levels`` / ``start_state``: the depth-level walk of the sequential references (every
  node from its parent's state, or from its request's committed state for the root).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from vllm_bole.spec_decode.tree import TreeBatch


def padded_tree(tree: TreeBatch, dtype):
    """(pad, valid [B, N] bool, M [B, N, N] bool ancestor-or-self mask, False on padding rows and
    columns); N = largest tree, ``pad(x)`` = ``pad_nodes(x, idx, valid, dtype)`` with idx [B, N] the
    flat node of each padded position (0 in padding)."""
    B, N = tree.num_requests, int(tree.nodes_per_request.max())
    cu = tree.cu_nodes.long()
    pos = torch.arange(N, device=cu.device)
    valid = pos[None, :] < (cu[1:] - cu[:-1])[:, None]
    idx = torch.where(valid, cu[:-1, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    path = tree.path.long()[idx]  # [B, N, D + 1]
    dep = tree.depth.long()[idx]  # [B, N]
    M = (path.gather(2, dep[:, None, :].expand(B, N, N)) == pos[None, None, :]) & valid[:, :, None] & valid[:, None, :]
    return partial(pad_nodes, idx=idx, valid=valid, dtype=dtype), valid, M


def pad_nodes(x, idx, valid, dtype):
    """[T, H, X] -> [B, H, N, X] (or [T, H] -> [B, H, N]) in ``dtype``, zeros in padding."""
    y = x[idx].to(dtype)
    y = torch.where(valid.view(*valid.shape, *([1] * (y.dim() - 2))), y, torch.zeros_like(y))
    return y.transpose(1, 2)


def depth_levels(tree: TreeBatch, device):
    """Yield (flat node indices, parent flat indices (-1 = root), request index) per depth level."""
    parent = tree.parent_flat.to(device)
    req = tree.request_index.to(device)
    depth = tree.depth.to(device)
    for d in range(int(depth.max()) + 1 if depth.numel() else 0):
        idx = torch.nonzero(depth == d).flatten()
        yield idx, parent[idx], req[idx]


def start_state(states: Tensor, state0: Tensor, par: Tensor, req: Tensor) -> Tensor:
    """State each node starts from: its parent's (already computed) or the committed one."""
    is_root = (par < 0).view(-1, *([1] * (states.dim() - 1)))
    return torch.where(is_root, state0[req], states[par.clamp(min=0)])
